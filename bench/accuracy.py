"""Prediction vs measurement on the zoo (issue: foundation accuracy figure).

For every workload, fp32 and bf16 autocast, AdamW: the fake-tensor prediction, the measured peak
(PyTorch profiler allocator events, independent of memfit's tracker), the error, and what a
naive storage tracker alone would have said (memfit's tracker on the real run without kernel
probes: it misses oneDNN scratch and RNN workspaces).

    .venv/bin/python -m bench.accuracy            # markdown table on stdout
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
warnings.simplefilter("ignore")

from memfit.memory.measure import profile  # noqa: E402
from memfit.plans import Plan  # noqa: E402
from memfit.workloads.small import SMALL_HF  # noqa: E402
from memfit.workloads.small import SMALL_SEQ as SEQ  # noqa: E402

ZOO = ["cnn", "lstm", "transformer", "mha", "dit", *SMALL_HF]


def main() -> None:
    print("| workload | precision | predicted (B) | measured (B) | error | naive tracker error |")
    print("|---|---|---:|---:|---:|---:|")
    worst = 0.0
    for name in ZOO:
        for precision in ("fp32", "bf16"):
            r = profile(SMALL_HF.get(name, name), Plan(precision=precision), batch_size=4, seq_len=SEQ.get(name),
                        repeats=1)
            naive = 100 * (r.tracker_peak_bytes - r.peak_bytes) / r.peak_bytes
            worst = max(worst, abs(r.error_percent))
            print(f"| {name} | {precision} | {r.predicted.peak_bytes:,} | {r.peak_bytes:,} | "
                  f"{r.error_percent:+.3f}% | {naive:+.2f}% |", flush=True)
    print(f"\nworst |error|: {worst:.3f}% (target <= 1%)")


if __name__ == "__main__":
    main()
