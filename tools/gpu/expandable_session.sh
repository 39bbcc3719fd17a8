#!/bin/bash
# One device call for NOTE [ Reserved bytes with expandable segments, from the same trace ]: the expandable-segment
# allocator model (memfit.memory.expandable) has never met a GPU, and memfit plan / memfit fit now take
# `allocator: expandable` where it decides the fit (41 of the 54 cells of `memfit fit llama --seq-len 2048`).
# Each case of tools/gpu/expandable_cases.json runs alone (its own process: a fresh caching allocator), the same
# plan with PyTorch's default segments and with expandable ones, with memfit's prediction for the card beside it
# (--predict). What to compare: reserved (expandable) measured against predicted; the default's as a control.
# Before the call, here: bitsandbytes and peft wheels in .whl, as tools/gpu/finetune_session.sh says.
#   run(command="bash tools/gpu/expandable_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt", carry=[".whl"])
END_SECONDS=${END_SECONDS:-420}; source tools/gpu/session_env.sh "$1"
el expandable; python3 -m tools.gpu.ground_truth --cases tools/gpu/expandable_cases.json --predict --preset h100-80gb \
  --out $OUT/gt.jsonl --timeout $(( $(left) - 20 ))
el done
