"""Predictions of a fixed grid of (workload, plan, device) cases, one JSON line each: run it before and
after a change that must not change predictions, and compare the files (diff; approximation texts
carry source line numbers, so compare without them).

    .venv/bin/python -m bench.prediction_grid > before.jsonl   # (on the old commit)
    .venv/bin/python -m bench.prediction_grid > after.jsonl
"""
from __future__ import annotations

import json
import warnings

from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.workloads.small import SMALL_HF

SMALL, LLAMA = SMALL_HF["gpt2"], SMALL_HF["llama"]
plans = [
    {}, {"precision": "bf16"}, {"precision": "fp16"}, {"precision": "bf16-pure", "bf16_update": "kahan"},
    {"checkpointing": "blocks"}, {"checkpointing": "selective"}, {"checkpointing": "blocks:every=2"},
    {"micro_batch_size": 2}, {"optimizer": "adamw8bit"}, {"optimizer": "adafactor"}, {"optimizer": "sgd"},
    {"optimizer_in_backward": True}, {"offload": ["optimizer_states"]}, {"offload": ["activations"]},
    {"ema": {"decay": 0.9, "device": "cpu"}}, {"ema": {"decay": 0.9, "device": "device"}},
    {"loss_chunks": 4}, {"attention": "chunked"}, {"attention": "math"}, {"attention": "sdpa"},
    {"precision": "bf16", "checkpointing": "blocks", "attention": "chunked", "loss_chunks": 4, "micro_batch_size": 2},
    {"precision": "bf16-pure", "bf16_update": "stochastic", "optimizer_in_backward": True, "checkpointing": "blocks"},
]
cases = []
for wl in (SMALL, LLAMA):
    for p in plans:
        for dev in ("cpu", "h100-80gb"):
            cases.append((wl, p, dev, 4, 64))
for wl in ("cnn", "lstm", "mha", "dit", "transformer"):
    for p in ({}, {"precision": "bf16"}, {"checkpointing": "blocks"}, {"attention": "chunked"}, {"micro_batch_size": 2}):
        for dev in ("cpu", "a100-40gb"):
            cases.append((wl, p, dev, 4, None))
warnings.filterwarnings("ignore")
for wl, p, dev, bs, seq in cases:
    try:
        r = estimate(wl, Plan.from_dict(p), batch_size=bs, device=dev, seq_len=seq)
        out = {k: getattr(r, k) for k in ("peak_bytes", "reserved_bytes", "host_peak_bytes", "process_peak_bytes",
                                          "breakdown", "fits", "precision", "peak_phase", "cuda_workspace_bytes")}
        out["approx"] = r.approximations
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps({"case": [wl.split(":")[0], p, dev], **out}), flush=True)
