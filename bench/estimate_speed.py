"""Speed and real memory of `memfit estimate llama --batch-size 1 --seq-len 2048 --precision bf16`.

Each repeat runs the CLI in a fresh process (what a user runs) and reads its wall time, its CPU
time (user + system; about the wall time on an idle machine, so a wall time well above it says the
machine was busy) and its peak resident memory (VmHWM); a second process that only imports torch
and transformers (what any estimate must load) gives the baseline, so the memory the estimate
itself adds is visible.

    .venv/bin/python -m bench.estimate_speed [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROBE = r"""
import json, resource, sys, time
t = time.perf_counter()
sys.argv = ["memfit"] + sys.argv[1:]
from memfit.cli.main import main
code = main()  # as the memfit script calls it, so the process also exits as it does
print(json.dumps({"seconds": time.perf_counter() - t,
                  "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), file=sys.stderr)
sys.exit(code)
"""
BASELINE = r"""
import json, resource, torch, transformers
from transformers import LlamaForCausalLM
from torch._subclasses.fake_tensor import FakeTensorMode
print(json.dumps({"maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    cmd = ["estimate", "llama", "--batch-size", "1", "--seq-len", "2048", "--precision", "bf16", "--device",
           a.device, "--json"]
    runs = []
    for _ in range(a.repeats):
        t0, c0 = time.perf_counter(), os.times()
        p = subprocess.run([sys.executable, "-c", PROBE, *cmd], capture_output=True, text=True, check=True)
        wall, c1 = time.perf_counter() - t0, os.times()
        cpu = (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
        stats = json.loads(p.stderr.strip().splitlines()[-1])
        report = json.loads(p.stdout)
        runs.append((wall, stats["seconds"], report["trace_seconds"], stats["maxrss_mib"], report["peak_bytes"], cpu))
    base = json.loads(subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True,
                                     check=True).stdout)["maxrss_mib"]
    med = lambda i: statistics.median(r[i] for r in runs)  # noqa: E731
    print(f"memfit {' '.join(cmd)}")
    print(f"  process wall time     : {med(0):.2f} s (median of {a.repeats}; target <= 10 s)")
    print(f"  process CPU time      : {med(5):.2f} s (user + system; a wall time well above it: the machine was busy)")
    print(f"  estimate() in-process : {med(1):.2f} s, of which trace {med(2):.2f} s")
    print(f"  peak RSS of process   : {med(3):.0f} MiB")
    print(f"  peak RSS of imports   : {base:.0f} MiB (torch + transformers + Llama class, no estimate)")
    print(f"  added by the estimate : {med(3) - base:.0f} MiB")
    print(f"  predicted peak        : {runs[0][4] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
