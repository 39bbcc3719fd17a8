#!/bin/bash
# One device call: memfit's compiled GPT-2 steps (tools/gpu/compile_cases.json) measured on the local GPU,
# with memfit's prediction for the local card made there (--predict --preset none).
# A first pass (4 cases at once, no GPU turns) fills torch.compile's caches in parallel; the measured
# pass then compiles from the caches, one case alone on the GPU at a time (3 overlapping their CPU work).
#   run(command="bash tools/gpu/compile_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt")
export PYTHONUNBUFFERED=1 MEMFIT_COMMIT="$1" PYTHONPATH=$PWD/src
OUT=${OUT:-out}; mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"
el warm; timeout ${WARM_SECONDS:-270} python3 -m tools.gpu.ground_truth --cases tools/gpu/compile_cases.json \
  --only "${ONLY:-compile|blocks|full}" --jobs 4 --no-lock --timeout 260 > $OUT/warm.txt 2>&1; tail -14 $OUT/warm.txt
el measure; left=$(( 580 - $(date +%s) + T0 ))
python3 -m tools.gpu.ground_truth --cases tools/gpu/compile_cases.json ${ONLY:+--only "$ONLY"} --jobs 3 --predict \
  --preset none --out $OUT/h100-compile.jsonl --timeout 200 --deadline $(( left - 200 ))
el done
