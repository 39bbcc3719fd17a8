#!/bin/bash
# One device call that produces everything tests/data/ still lacks (issue 10, items 3-4), in priority order:
# GPU facts, allocator-snapshot digests (SNAPSHOTS=1), `memfit profile --device cuda`, then the ground-truth cases of
# tools/gpu/ground_truth.py (4 overlapped, with memfit's predictions made there) until a deadline (545 s after the start, so the call ends inside 600 s).
#
# Before the call, here (the device machine has no network):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .whl bitsandbytes==0.50.2
# (its Requires-Dist: torch, numpy, packaging, all on the image). The call:
#   run(command="bash tools/gpu/session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt", carry=[".whl"])
# Files back under $OUT: log.txt, facts.json, snapshots.tgz (digests, and raw snapshots if < 15 MB),
# profile_cuda.json, profile_timeline.png, profile_small.txt, gt.jsonl. GT_ONLY=REGEX limits the cases.
export PYTHONUNBUFFERED=1 MEMFIT_COMMIT="$1"
OUT=${OUT:-out}; mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "no wheels in .whl: adamw8bit rows will fall back"
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
python3 -c "import torch, bitsandbytes, transformers, timm; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), bitsandbytes.__version__, transformers.__version__, timm.__version__)"
el facts; python3 -m tools.gpu.facts --out $OUT/facts.json > /dev/null || echo facts failed
if [ -n "$SNAPSHOTS" ]; then
el snapshots; mkdir -p /tmp/snaps; python3 -m tools.gpu.snapshots --out-dir /tmp/snaps
tar czf $OUT/snapshots.tgz -C /tmp/snaps . ; ls -la /tmp/snaps $OUT/snapshots.tgz
if [ $(stat -c %s $OUT/snapshots.tgz) -gt 15000000 ]; then tar czf $OUT/snapshots.tgz -C /tmp/snaps --exclude='*.pickle.gz' . ; echo "pickles left out"; fi
fi
el profile; python3 -m memfit.cli.main profile gpt2 --device cuda --precision bf16 --batch-size 8 --seq-len 1024 --json --timeline $OUT/profile_timeline.png > $OUT/profile_cuda.json; echo rc=$?
el profile-small; python3 -m memfit.cli.main profile gpt2:n_layer=2 --device cuda --precision bf16 --batch-size 2 --seq-len 512 --modules 5 > $OUT/profile_small.txt 2>&1; echo rc=$?
el ground-truth; left=$(( 545 - $(date +%s) + T0 ))
python3 -m tools.gpu.ground_truth --out $OUT/gt.jsonl --jobs 4 --predict --timeout 240 --deadline $(( left - 90 )) \
  ${GT_ONLY:+--only "$GT_ONLY"} ${GT_CASES:+--cases "$GT_CASES"}
el done
