#!/bin/bash
# flash-linear-attention on the card (prepared 2026-12-06, stop 114; no loan yet): a 4-layer Qwen3.5 at transformers'
# default widths (3 gated-delta-rule layers, 1 full attention; tools/gpu/qwen35_4layers), first as transformers runs it
# without fla (its torch fallback), then with fla 0.6.0, whose Triton kernels memfit traces with their launches skipped
# (NOTE [ Triton kernels on fake tensors ]). Both predicted blind on a CPU before the call:
# tools/gpu/fla_fallback_predicted*.jsonl and tools/gpu/fla_predicted*.jsonl (h100: the _h100 files).
# Before the call, here (fla's wheels apart from .whl, which session_env installs for both passes):
#   .venv/bin/pip download --no-deps -d .whl-fla flash-linear-attention==0.6.0 fla-core==0.6.0 einops
#   run(command="bash tools/gpu/fla_session.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl", ".whl-fla"], timeout_s=420)
# Then: the rows to tests/data/ (h100_fla.jsonl or h200_fla.jsonl), and the figures to docs/limits.md.
END_SECONDS=${END_SECONDS:-400}; source tools/gpu/session_env.sh "$1"
el "without fla: transformers' torch fallback"
python3 -m tools.gpu.ground_truth --cases tools/gpu/fla_cases.json --out $OUT/fallback.jsonl --timeout 100 \
  --deadline $(( $(left) - 200 ))
python3 -m tools.gpu.compare_blind $OUT/fallback.jsonl $(predicted fla_fallback) --card $CARD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl-fla/*.whl || echo "fla did not install"
el "with fla"
PYTHONPATH=/tmp/fla:$PYTHONPATH python3 -m tools.gpu.ground_truth --cases tools/gpu/fla_cases.json --out $OUT/fla.jsonl \
  --timeout 100 --deadline $(( $(left) - 20 ))
python3 -m tools.gpu.compare_blind $OUT/fla.jsonl $(predicted fla) --card $CARD
el "done"
