#!/bin/bash
# One device call for issue 51's principal GPU check: memfit's plan against torchtune's published recipe for a
# full fine-tune of Llama-3-8B sizes at batch 2 x 2048 on a 24 GB card (tools/gpu/recipe_cases.json), in turns:
#   1. memfit's plan (what `memfit plan <8B> -b 2 --seq-len 2048 --device h200-141gb --budget 21.28GiB --host
#      h200-box` chose: bf16-pure, blocks checkpointed, AdamW stepped in backward on the host, 8 loss chunks), then
#      torchtune's recipe (bf16-pure, compiled blocks, blocks checkpointed, bitsandbytes' PagedAdamW8bit stepped in
#      backward, 8 chunks), each in a process of its own; then both again while time is left (A, B, A, B: the
#      tokens/s ratio from turns, as the guide asks);
#   2. if time is left: bench.offload_gpu's optimizer-state offload row beside its physical bound.
# The card: each case allocates a ballast (cuMemAlloc, outside PyTorch's allocator) that leaves the rtx4090
# preset's memory less its CUDA context free (23.25 GiB), and caps the caching allocator there too
# (set_per_process_memory_fraction does not cap CUDA managed memory: the paged states' pages meet the ballast).
# Rows record max_memory_allocated/reserved, the paged states' bytes apart (managed_bytes: not in
# max_memory_reserved), free_after_step, tokens_per_second. Blind predictions, made on a CPU and committed first:
# tools/gpu/recipe_predicted.jsonl (memory; recipe_predicted_h100.jsonl for an H100) and docs/planner.md (times).
# Before the call, here (the device machine has no network): bitsandbytes in .whl, as tools/gpu/session.sh says.
#   run(command="bash tools/gpu/recipe_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl"], timeout_s=600)
# Then: append $OUT/gt.jsonl to tests/data/h200.jsonl (or h100.jsonl) and compare with the committed predictions.
END_SECONDS=${END_SECONDS:-570}; source tools/gpu/session_env.sh "$1"
python3 -c "import torch, bitsandbytes; print(torch.__version__, torch.version.cuda, bitsandbytes.__version__)"
CASES=tools/gpu/recipe_cases.json
for turn in 1 2; do
  for who in memfit torchtune; do
    if [ "$(left)" -lt 150 ]; then el "skipped $who (turn $turn): $(left) s left"; continue; fi
    el "$who, turn $turn"; python3 -m tools.gpu.ground_truth --cases $CASES --only "^r-$who-" --out $OUT/gt.jsonl \
      --timeout $(( $(left) - 20 ))
  done
done
if [ "$(left)" -gt 120 ]; then
  el "offload row"; timeout $(( $(left) - 10 )) python3 -m bench.offload_gpu --only llama4-offopt --repeats 6 \
    --out $OUT/offload_gpu.jsonl
fi
el done
python3 -m tools.gpu.compare_blind $OUT/gt.jsonl $(predicted recipe) --card $CARD
