"""compile and the activation memory budget on this CPU: predicted vs measured peak, step time,
compile time (issue 12's table).

For each plan, in a fresh process (so no plan inherits another's compiled graphs or caches):
``memfit.profile`` runs the step for real (Inductor's C++ kernels for compiled plans), measures
the steady-state peak with the profiler's allocator events and times further steps; the first
step's wall time, minus the eager first step's, is the compile (warm-up) time. The prediction is
``estimate``'s, made in the same process before the real run.

    .venv/bin/python -m bench.compile                      # GPT-2 124M, batch 2, seq 256, fp32
    .venv/bin/python -m bench.compile --workload gpt2:n_layer=4 --batch-size 4 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANS = [{}, {"compile": "blocks"}, {"compile": "full"}] + [
    {"compile": "full", "checkpointing": f"budget:{f}"} for f in (0, 0.25, 0.5, 0.75, 1)] + [
    {"checkpointing": "blocks"}, {"compile": "blocks", "checkpointing": "blocks"}]


def one(workload: str, plan: dict, batch_size: int, seq_len: int, repeats: int) -> dict:
    import warnings
    warnings.filterwarnings("ignore")
    import memfit
    from memfit.step import build_step, make_batch
    p = memfit.Plan(**plan)
    step = build_step(memfit.load_workload(workload, seq_len=seq_len), p, batch_size, "cpu")
    batch = make_batch(step.target)
    t0 = time.perf_counter()
    step(batch)
    first = time.perf_counter() - t0
    del step
    r = memfit.profile(workload, p, batch_size=batch_size, seq_len=seq_len, repeats=repeats)
    return {"plan": plan, "label": p.short(), "measured": r.peak_bytes, "predicted": r.predicted_peak_bytes,
            "error_percent": round(r.error_percent, 2), "step_ms": round(r.step_seconds * 1e3, 1),
            "first_step_s": round(first, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="gpt2")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.workload, json.loads(a.one), a.batch_size, a.seq_len, a.repeats)))
        return 0
    import platform
    print(f"{a.workload}, batch {a.batch_size}, seq {a.seq_len}, fp32, AdamW; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores")
    print("| plan | predicted peak | measured peak | error | step time | first step (compile) |")
    print("|---|---:|---:|---:|---:|---:|")
    for plan in PLANS:
        cmd = [sys.executable, __file__, "--one", json.dumps(plan), "--workload", a.workload, "--batch-size",
               str(a.batch_size), "--seq-len", str(a.seq_len), "--repeats", str(a.repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        rows = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not rows:
            print(f"| {plan} | failed: {(out.stderr or out.stdout).strip().splitlines()[-1][:200]} |||||")
            continue
        r = rows[0]
        print(f"| {r['label']} | {r['predicted'] / 2**20:,.1f} MiB | {r['measured'] / 2**20:,.1f} MiB | "
              f"{r['error_percent']:+.2f}% | {r['step_ms']:,.0f} ms | {r['first_step_s']:.1f} s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
