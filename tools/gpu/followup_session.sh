#!/bin/bash
# One short device call for the GPU figures the earlier calls left (2026-11-27), in priority order:
#   1. the README's `memfit plan gpt2:n_layer=2 --batch-size 8 --seq-len 1024 --device rtx4090 --budget 4GiB`:
#      its choice (bf16-pure in micro-batches of 4, torch's AdamW), the torchao fp8 plan it chose before
#      `adamw8bit-ao`/`adamwfp8-ao` left the default search, the runners-up and the fastest plan it ruled out;
#      then GPT-2 124M's runners-up at 8 and 4 GiB (their choices are rows 108-109 of tests/data/h100.jsonl);
#      3 cases overlapping their CPU work, each alone on the GPU (tools/gpu/choices_cases.json);
#   2. the QLoRA 3B case with its CUDA kernels (the time model overpredicted its step +118%), alone;
#   3. if time is left: bench.offload_gpu's optimizer-state and activation offload rows (reserved bytes).
# Predictions are made on a CPU afterwards (fake tensors), not here.
#   run(command="bash tools/gpu/followup_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl"], timeout_s=450)
END_SECONDS=${END_SECONDS:-420}; source tools/gpu/session_env.sh "$1"
python3 -c "import torch, transformers, peft, bitsandbytes, torchao; print(torch.__version__, torch.version.cuda, \
transformers.__version__, peft.__version__, bitsandbytes.__version__, torchao.__version__)"
python3 -c "import torch; torch.ones(1, device='cuda'); f, t = torch.cuda.mem_get_info(); print('context bytes', t - f)"
el choices; python3 -m tools.gpu.ground_truth --cases tools/gpu/choices_cases.json --only "${ONLY:-^(readme2l|choice[84]-next)}" \
  --jobs ${JOBS:-3} --out $OUT/choices.jsonl --timeout 120 --deadline $(( $(left) - 250 ))
el qlora; python3 -m tools.gpu.ground_truth --cases tools/gpu/finetune_cases.json --only "${QLORA:-profiled}" \
  --out $OUT/qlora.jsonl --timeout $(( $(left) - 60 ))
if [ $(left) -gt 100 ]; then
  el offload; timeout $(( $(left) - 10 )) python3 -m bench.offload_gpu --only llama4-offopt,gpt2-offact --repeats 6 \
    --out $OUT/offload.jsonl
fi
el done
