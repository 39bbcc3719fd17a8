#!/bin/bash
# One device call for issue 51's two GPU checks, when a session is lent 15 minutes of a card (2026-12-04):
#   1. memfit's 24 GB plan for Llama-3-8B sizes (batch 2 x 2048), then torchtune's recipe, each alone under the
#      rtx4090 ballast (recipe_session.sh's cases, one turn each: A then B);
#   2. the ten held-out plans of Phi-3-mini and Qwen2.5-7B (heldout_session.sh's cases), each alone, until the end.
# Blind predictions committed before: tools/gpu/recipe_predicted*.jsonl, tools/gpu/heldout_predicted*.jsonl.
# Before the call, here: bitsandbytes (the paged states, the QLoRA cases) in .whl, as tools/gpu/session.sh says.
#   run(command="bash tools/gpu/principal_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl"], timeout_s=560)
# Then: append $OUT/recipe.jsonl and $OUT/heldout.jsonl to tests/data/h200.jsonl (or h100.jsonl).
END_SECONDS=${END_SECONDS:-540}; source tools/gpu/session_env.sh "$1"
python3 -c "import torch, bitsandbytes, transformers; print(torch.__version__, torch.version.cuda, bitsandbytes.__version__, transformers.__version__)"
for who in memfit torchtune; do
  el "recipe: $who"; python3 -m tools.gpu.ground_truth --cases tools/gpu/recipe_cases.json --only "^r-$who-" \
    --out $OUT/recipe.jsonl --timeout 200
done
python3 -m tools.gpu.compare_blind $OUT/recipe.jsonl $(predicted recipe) --card $CARD
el "held-out plans"; python3 -m tools.gpu.ground_truth --cases tools/gpu/heldout_cases.json --out $OUT/heldout.jsonl \
  --timeout 100 --deadline $(( $(left) - 105 ))
el done
python3 -m tools.gpu.compare_blind $OUT/heldout.jsonl $(predicted heldout) --card $CARD
