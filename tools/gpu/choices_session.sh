#!/bin/bash
# One device call proving the planner's choices on the GPU (tools/gpu/choices_cases.json), then compiled steps:
#   1. GPT-2 124M at batch 8 x 1024: what `memfit plan gpt2 -b 8 --seq-len 1024 --device h100-80gb --budget B`
#      chooses at B = 16, 8, 4, 2 GiB, beside the runners-up it ranked next (and one it ruled out as too big),
#      each alone on the GPU (3 overlapping their CPU work): does the choice fit, and is it the fastest that fits?
#      (Overlapping inflates CPU-bound steps, and most of all an update on the host, which shares the host's cores
#      with the other cases' model building: run such plans with --jobs 1.)
#   2. if time is left: memfit's compiled GPT-2 steps (tools/gpu/compile_cases.json; never measured on a GPU),
#      a parallel pass filling the compile caches first, then each case alone with memfit's predictions made there;
#   3. if time is left: bench.offload_gpu's reserved bytes.
#   run(command="bash tools/gpu/choices_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt", carry=[".whl"])
END_SECONDS=${END_SECONDS:-555}; source tools/gpu/session_env.sh "$1"
python3 -c "import torch, transformers, torchao; print(torch.__version__, torch.version.cuda, transformers.__version__, torchao.__version__)"
python3 -c "import torch; torch.ones(1, device='cuda'); f, t = torch.cuda.mem_get_info(); print('context bytes', t - f)"
el choices; python3 -m tools.gpu.ground_truth --cases tools/gpu/choices_cases.json --jobs 3 --out $OUT/choices.jsonl \
  --timeout 150 --deadline $(( $(left) - 330 ))
if [ $(left) -gt 200 ]; then
  el compile-warm; timeout $(( $(left) / 2 )) python3 -m tools.gpu.ground_truth --cases tools/gpu/compile_cases.json \
    --only "${ONLY:-bf16-(eager|blocks|full|full-budget0.5|full-chunks)$}" --jobs 4 --no-lock --timeout 240 > $OUT/warm.txt 2>&1; tail -8 $OUT/warm.txt
  el compile-measure; python3 -m tools.gpu.ground_truth --cases tools/gpu/compile_cases.json \
    --only "${ONLY:-bf16-(eager|blocks|full|full-budget0.5|full-chunks)$}" --jobs 3 --predict --preset none \
    --out $OUT/compile.jsonl --timeout 150 --deadline $(( $(left) - 100 ))
fi
if [ $(left) -gt 90 ]; then
  el offload; timeout $(( $(left) - 10 )) python3 -m bench.offload_gpu --only llama4-offopt,gpt2-offact --repeats 6 \
    --out $OUT/offload.jsonl
fi
el done
