#!/bin/bash
# A second, short device call on the warm machine after principal_session.sh (2026-12-04), in priority order:
#   1. issue 52's blind compiled rows of GPT-2 and a 1B Llama (compile_blind_session.sh's cases, 3 overlapping
#      their CPU work, each alone on the GPU, with --predict);
#   2. issue 49: QLoRA as users load it (bench.qlora_load_gpu: from_pretrained with BitsAndBytesConfig of a saved
#      Llama-3.2-3B-sized checkpoint), if time is left;
#   3. issue 52's seed case (Lumina2 LoRA, compiled blocks + budget 0.5, batch 2, 24 GiB left), if time is left.
#   run(command="bash tools/gpu/second_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl"], timeout_s=N)   # END_SECONDS=N-20
END_SECONDS=${END_SECONDS:-240}; source tools/gpu/session_env.sh "$1"
CASES=tools/gpu/compile_blind_cases.json
el "gpt2 and llama compiled"; python3 -m tools.gpu.ground_truth --cases $CASES --only "^b-(gpt2|llama1b)" --jobs 3 \
  --predict --preset none --out $OUT/compile.jsonl --timeout 150 --deadline $(( $(left) - 150 ))
python3 -m tools.gpu.compare_blind $OUT/compile.jsonl $(predicted compile_blind) --card $CARD
if [ "$(left)" -gt 80 ]; then
  el "qlora load"; timeout $(( $(left) - 5 )) python3 -m bench.qlora_load_gpu --preset h200-141gb --out $OUT/qlora_load.jsonl
fi
if [ "$(left)" -gt 100 ]; then
  el "seed case"; python3 -m tools.gpu.ground_truth --cases $CASES --only "^b-lumina2" --predict --preset none \
    --out $OUT/compile.jsonl --timeout $(( $(left) - 5 ))
fi
el done
