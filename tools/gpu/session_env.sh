# Sourced by the device-call scripts (choices_session.sh, finetune_session.sh): the commit to record, $OUT,
# the clock (el: a timestamped line; left: seconds to END, the script's own END_SECONDS default), the wheels
# carried in .whl installed to /tmp/site, the GPU named, and the host behind it measured ($OUT/host.json:
# tools/gpu/host_probe.py; NOTE [ One kind of machine, several hosts ] in memfit.hosts).
#   END_SECONDS=${END_SECONDS:-540}; source tools/gpu/session_env.sh "$1"
export PYTHONUNBUFFERED=1 MEMFIT_COMMIT="$1"
OUT=${OUT:-out}; mkdir -p "$OUT"
T0=$(date +%s); END=${END_SECONDS:-540}
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( END - $(date +%s) + T0 )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "wheels did not install"
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
# The machine (h100 or h200) and the blind predictions committed for it: predicted NAME -> tools/gpu/NAME_predicted*.jsonl
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -qi h100 && echo h100 || echo h200)
predicted() { if [ "$CARD" = h100 ]; then echo "tools/gpu/$1_predicted_h100.jsonl"; else echo "tools/gpu/$1_predicted.jsonl"; fi; }
timeout 60 python3 -m tools.gpu.host_probe --out "$OUT/host.json" || echo "host probe failed"
