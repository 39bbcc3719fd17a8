#!/bin/bash
# One device call for what users ask first (issues 53 and 49), each case alone on the GPU, in priority order:
#   1. `--batch-size max` on a card (issue 53): GPT-2 124M, bf16, 1024 tokens, under a ballast that leaves 12 GiB and
#      the allocator capped there. memfit's answer for that card (`memfit estimate gpt2 -b max --seq-len 1024
#      --precision bf16 --device h200-141gb --budget 13437501440`: 12 GiB + the preset's 527 MiB context) is batch 6
#      (11.17 GiB), 7 needing 12.86 GiB: batch 6 must train and batch 7 run out of memory (the allocator frees its
#      cache and retries before it raises: a 7 that trains says the answer is conservative by one);
#   2. a FLUX.1-dev LoRA r=16 at 1024 px with fp8 base weights (issue 53): the plan memfit chooses for a 12 GB card
#      (28 of 57 blocks swapped, blocks checkpointed; its AdamW states on the device since NOTE [ A technique pays
#      for itself ]: the `ondevice` cases, first) under a ballast leaving 12 GiB, and for 16 GB (no swap); then the
#      plans it chose before (states on the host), and 28 swapped under 16 GiB: each must fit, be within 3%
#      allocated, its s/it recorded;
#   3. QLoRA as users load it (issue 49): bench.qlora_load_gpu, from_pretrained with BitsAndBytesConfig of a saved
#      Llama-3.2-3B-sized checkpoint, peft LoRA, torch AdamW, batch 2 x 2048: load and step peaks against memfit's.
# Blind: memory and step times of 1-2 were predicted on a CPU and committed first (tools/gpu/users_predicted.jsonl, users_predicted_h100.jsonl for an H100:
# `python -m tools.gpu.predict_cases --cases tools/gpu/users_cases.json --preset h200-141gb --times h200`).
# Before the call, here: bitsandbytes (fp8 needs none; QLoRA does) in .whl, as tools/gpu/session.sh says.
#   run(command="bash tools/gpu/users_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl"], timeout_s=600)
# Then: append $OUT/gt.jsonl to tests/data/h200.jsonl (or h100.jsonl), $OUT/qlora_load.jsonl to bench/results/.
END_SECONDS=${END_SECONDS:-570}; source tools/gpu/session_env.sh "$1"
CASES=tools/gpu/users_cases.json
el "batch max"; python3 -m tools.gpu.ground_truth --cases $CASES --only "^m-" --out $OUT/gt.jsonl --timeout 100
el "flux"; python3 -m tools.gpu.ground_truth --cases $CASES --only "^f-" --out $OUT/gt.jsonl --timeout 180 \
  --deadline $(( $(left) - 200 ))
if [ "$(left)" -gt 150 ]; then
  el "qlora load"; timeout $(( $(left) - 10 )) python3 -m bench.qlora_load_gpu --preset h200-141gb --out $OUT/qlora_load.jsonl
fi
el done
python3 -m tools.gpu.compare_blind $OUT/gt.jsonl $(predicted users) --card $CARD
