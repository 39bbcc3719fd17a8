"""Planning time of the GPU-preset planner on its issue's target cases (issue: planner on GPUs).

Runs ``memfit.planner.search.plan`` cold, once per case, in this process, and prints the planning
seconds the result reports (the ``memfit plan`` header's figure: Python and torch starting are not
in it), the traces (and how many at full depth), and the chosen plan. Targets, cold, on a 2-core
machine: GPT-2 <= 20 s, Llama-2-7B <= 60 s.

    .venv/bin/python -m bench.planning_time [--cases llama-40,gpt2-8,llama]
"""

from __future__ import annotations

import argparse
import os
import platform
import warnings

warnings.simplefilter("ignore")

from memfit.planner.search import plan  # noqa: E402

CASES = {
    "llama-40": dict(workload="llama", budget="40GiB"),
    "gpt2-8": dict(workload="gpt2", budget="8GiB", batch_size=8, seq_len=1024),
    "llama": dict(workload="llama"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    for name in args.cases.split(","):
        r = plan(**CASES[name], device="h100-80gb")
        full = r.time_model.split(" at full depth")[0].rsplit("(", 1)[-1]
        print(f"{name:9s} planning {r.seconds:6.1f} s  traces {r.traces} ({full} at full depth)  "
              f"chosen: {r.chosen.plan.describe() if r.chosen else None}")


if __name__ == "__main__":
    main()
