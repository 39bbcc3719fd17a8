#!/bin/bash
# A second environment on this machine with the GPU machine's torch (2.11.0; this checkout's is constraints.txt's),
# to predict blind rows with the torch that will run them: Inductor compiles some regions otherwise in the two
# (GPT-2's compiled chunked loss: 4.31 GB with 2.14, 5.86 GB with 2.11), and a few of memfit's paths needed a
# change for 2.11 (docs/planner.md, "Padded matmuls"). About 5 GB and 3 minutes from PyPI.
#   bash tools/gpu/device_torch_env.sh [/tmp/v211]
#   /tmp/v211/bin/python -m tools.gpu.predict_cases --cases tools/gpu/next_loan_cases.json \
#       --out tools/gpu/compile_t211_predicted.jsonl --preset h200-141gb
set -euo pipefail
V=${1:-/tmp/v211}
TORCH=${DEVICE_TORCH:-2.11.0}
python3 -m venv "$V"
"$V/bin/pip" install --quiet "torch==$TORCH"
grep -v -E "^(torch|torchvision|triton|nvidia|cuda)" constraints.txt > "$V/constraints.txt"
"$V/bin/pip" install --quiet -c "$V/constraints.txt" -e ".[dev]" "torch==$TORCH"
"$V/bin/python" -c "import torch, memfit; print('torch', torch.__version__, 'memfit', memfit.__file__)"
