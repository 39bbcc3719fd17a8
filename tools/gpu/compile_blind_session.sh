#!/bin/bash
# One device call for issue 52's blind rows (tools/gpu/compile_blind_cases.json): compiled GPT-2 124M
# (blocks, full, full + budget 0.5 and 0.1, full + bf16-pure + 8 loss chunks), a 1B Llama with compiled
# blocks + budget 0.5, and the seed case (Lumina2 LoRA r=16 at 1024 px, compiled blocks + budget 0.5,
# batch 2) under a ballast that leaves 24 GiB of the card (ground_truth.py's "leave_bytes").
# Blind: their predictions were made on a CPU and committed first (tools/gpu/compile_blind_predicted.jsonl,
# python -m tools.gpu.predict_cases); compare those, unchanged, with the rows this call writes.
# The rows also record the prediction for the local card made there (--predict: fake CUDA tensors).
# Before the call, here: the wheels of finetune_session.sh in .whl (diffusers and peft for the seed case).
#   run(command="bash tools/gpu/compile_blind_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl"], timeout_s=600)
# Then: append the rows to tests/data/h100.jsonl (or h200.jsonl) and compare with
#   python -m bench.gpu_accuracy   # (or tools/gpu/rows.py predict() on each new row)
END_SECONDS=${END_SECONDS:-560}; source tools/gpu/session_env.sh "$1"
python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"
CASES=tools/gpu/compile_blind_cases.json
el "gpt2 and llama"; python3 -m tools.gpu.ground_truth --cases $CASES --only "^b-(gpt2|llama1b)" --jobs 3 --predict \
  --preset none --out $OUT/gt.jsonl --timeout 240 --deadline $(( $(left) - 240 ))
el "seed case"; python3 -m tools.gpu.ground_truth --cases $CASES --only "^b-lumina2" --predict --preset none \
  --out $OUT/gt.jsonl --timeout $(( $(left) - 10 ))
el done
