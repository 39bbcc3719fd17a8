#!/bin/bash
# One device call for issue 51's held-out plans: ten plans of two models outside the time model's fitting set
# (Phi-3-mini and Qwen2.5-7B from their configs in bench/hub_configs/: LoRA, QLoRA, full fine-tuning, with and
# without checkpointing, chunks, stepping in backward; tools/gpu/heldout_cases.json), each alone on the GPU
# (--jobs 1: tools/fit/held_out.py leaves out rows recorded beside other processes).
# Blind: their step times and memory were predicted on a CPU and committed first (tools/gpu/heldout_predicted.jsonl;
# heldout_predicted_h100.jsonl for an H100 machine,
# `python -m tools.gpu.predict_cases --cases tools/gpu/heldout_cases.json --preset h200-141gb --times h200`);
# compare those, unchanged, with the rows this call writes (targets: median |error| <= 5%, worst <= 20%,
# Spearman >= 0.95 among each model's plans).
# Before the call, here: bitsandbytes in .whl (the QLoRA cases), as tools/gpu/session.sh says.
#   run(command="bash tools/gpu/heldout_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl"], timeout_s=600)
# Then: append $OUT/gt.jsonl to tests/data/h200.jsonl (or h100.jsonl); python -m tools.fit.held_out reads them.
END_SECONDS=${END_SECONDS:-570}; source tools/gpu/session_env.sh "$1"
python3 -c "import torch, bitsandbytes, transformers; print(torch.__version__, bitsandbytes.__version__, transformers.__version__)"
el "held-out plans"; python3 -m tools.gpu.ground_truth --cases tools/gpu/heldout_cases.json --out $OUT/gt.jsonl \
  --timeout 120 --deadline $(( $(left) - 15 ))
el done
python3 -m tools.gpu.compare_blind $OUT/gt.jsonl $(predicted heldout) --card $CARD
