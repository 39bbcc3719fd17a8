#!/bin/bash
# One device call for the fine-tuning issues' GPU rows (tools/gpu/finetune_cases.json), in priority order:
#   1. the planner's Llama-2-7B plan for a 24 GB card (AdamW, states on the host), trained under a 24 GiB
#      per-process memory fraction of the card, and the unconstrained AdamW plan beside it (tokens/s), each
#      alone on the GPU (the torchao-on-the-host case, llama7b-24gib-8bit-ao-host, only with ONLY7B=all);
#   2. the rest of the cases (LoRA/QLoRA Llama, diffusers LoRA; measured 2026-11-26: rows 77-82 of
#      tests/data/h100.jsonl), 3 overlapping their CPU work, with ADAPTERS=1;
#      or the cases matching MORE (a regex: MORE=^llama1b-full runs torchao's low-bit AdamW on a 1B Llama);
#      MORE=profiled: the QLoRA case with its top CUDA kernels (measured on an H200 2026-11-27);
#   3. if time is left: bench.offload_gpu's optimizer-state and activation offload rows (their reserved bytes
#      since NOTE [ Gradients in flight ]).
# Predictions are made on a CPU afterwards (fake tensors, the h100-80gb preset), not here.
# Before the call, here: wheels the image lacks or has at another version, in .whl (git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     torchao==0.18.0 bitsandbytes==0.50.2 diffusers==0.42.1 importlib_metadata==10.2.0 peft==0.21.2
#   run(command="bash tools/gpu/finetune_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt", carry=[".whl"])
END_SECONDS=${END_SECONDS:-540}; source tools/gpu/session_env.sh "$1"
python3 -c "import torch, transformers, peft, diffusers, bitsandbytes, torchao; print(torch.__version__, torch.version.cuda, \
transformers.__version__, peft.__version__, diffusers.__version__, bitsandbytes.__version__, torchao.__version__)"
CASES=tools/gpu/finetune_cases.json
el 7b; python3 -m tools.gpu.ground_truth --cases $CASES --only "$( [ "$ONLY7B" = all ] && echo ^llama7b || echo "^(llama7b-(24gib-chosen|h100)|llama3-8b-24gib)")" \
  --out $OUT/gt.jsonl --timeout $(( $(left) / 2 - 10 ))
MORE=${MORE:-$( [ -n "$ADAPTERS" ] && echo lora )}
if [ -n "$MORE" ]; then
  el "more: $MORE"; python3 -m tools.gpu.ground_truth --cases $CASES --only "$MORE" --jobs 3 --out $OUT/gt.jsonl \
    --timeout 200 --deadline $(( $(left) - 200 ))
fi
if [ $(left) -gt 130 ]; then
  el offload; timeout $(( $(left) - 10 )) python3 -m bench.offload_gpu --only llama4-offopt,gpt2-offact --repeats 6 \
    --out $OUT/offload.jsonl
fi
el done
