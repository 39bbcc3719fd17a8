"""Planner vs an exhaustive grid of real runs, and vs an OOM-trial batch-size search (issue: planner).

For each workload (batch 8, CPU) the grid measures every valid plan of the search space for real:
peak with the profiler's allocator events, step time as the median of short steps. Then, for
budgets of 30%, 50% and 80% of the fp32 AdamW peak, the planner runs (calibration included) and its
plan is looked up in the grid: does it fit (measured peak <= budget)? how does its measured time
compare with the fastest grid plan that fits? how long did planning take compared with the grid?
Last, an Accelerate/Lightning-style search halves the batch from 64 after each (simulated) OOM
until a real step fits the budget, and its time is reported.

    .venv/bin/python -m bench.planner [--workloads mha,gpt2,cnn]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import warnings

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
warnings.simplefilter("ignore")

from torch.profiler import ProfilerActivity, record_function  # noqa: E402
from torch.profiler import profile as torch_profile  # noqa: E402

from memfit.devices import get_device  # noqa: E402
from memfit.memory.categories import STEADY_STEP  # noqa: E402
from memfit.memory.faketrace import run_tracked  # noqa: E402
from memfit.memory.measure import STEP_RANGE  # noqa: E402
from memfit.memory.profiler_events import profiler_peak  # noqa: E402
from memfit.planner.cost import time_plan  # noqa: E402
from memfit.planner.search import plan  # noqa: E402
from memfit.planner.space import SearchSpace, candidates, model_facts  # noqa: E402
from memfit.plans import Plan  # noqa: E402
from memfit.quiet import QuietProfiler  # noqa: E402
from memfit.target import Target  # noqa: E402
from memfit.techniques.checkpointing import find_blocks  # noqa: E402
from memfit.units import fmt_bytes  # noqa: E402
from memfit.workloads import load_workload  # noqa: E402

WORKLOADS = {
    "mha": ("mha:layers=4,seq_len=128", False),
    "gpt2": ("gpt2:n_layer=2,n_embd=128,n_head=4,vocab_size=2000,n_positions=256", True),
    "cnn": ("cnn:width=32,depth=6,image_size=64", False),
}
BATCH = 8
CPU = get_device("cpu")


def space_for(causal_lm: bool, has_blocks: bool = True) -> SearchSpace:
    values = {"precision": ["fp32", "bf16", "bf16-pure"],
              "checkpointing": ["none", "blocks:every=2", "blocks"] if has_blocks else ["none"],
              "optimizer": ["adamw"], "optimizer_in_backward": [False, True], "offload": [()],
              "loss_chunks": [0, 8] if causal_lm else [0], "attention": ["auto"]}
    return SearchSpace(values=values, micro_batches=[8, 4, 2])


def measured_peak(wl, p: Plan, batch: int = BATCH) -> int:
    prof = torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    run_tracked(Target.resolve(wl, p, batch, CPU), fake=False, outer=QuietProfiler(prof),
                around_step=lambda i: record_function(STEP_RANGE) if i == STEADY_STEP else contextlib.nullcontext())
    return profiler_peak(prof, STEP_RANGE)


def oom_trial_search(wl, budget: int, start: int = 64) -> tuple[int, float, int]:
    """Halve the batch after each OOM (peak over budget) until a real step fits."""
    t0, batch, trials = time.perf_counter(), start, 0
    while batch >= 1:
        trials += 1
        if measured_peak(wl, Plan(), batch) <= budget:
            return batch, time.perf_counter() - t0, trials
        batch //= 2
    return 0, time.perf_counter() - t0, trials


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    a = ap.parse_args()
    print("| workload | budget | planner plan | fits (measured) | time vs fastest fitting grid plan | "
          "planning time | grid time | speed-up | OOM-trial search |")
    print("|---|---|---|---|---:|---:|---:|---:|---|")
    for name in a.workloads.split(","):
        spec, causal = WORKLOADS[name]
        wl = load_workload(spec)
        space = space_for(causal, bool(find_blocks(model_facts(wl).model)))
        t0 = time.perf_counter()
        grid = {}
        for p in candidates(space, BATCH):
            grid[p] = (measured_peak(wl, p), time_plan(Target.resolve(wl, p, BATCH, CPU), 2))
        grid_seconds = time.perf_counter() - t0
        base_peak = grid[Plan()][0]
        for frac in (0.3, 0.5, 0.8):
            budget = int(base_peak * frac)
            fitting = [(t, p) for p, (peak, t) in grid.items() if peak <= budget]
            t1 = time.perf_counter()
            result = plan(wl, budget=budget, batch_size=BATCH, space=space)
            planning = time.perf_counter() - t1
            oom = oom_trial_search(wl, budget)
            oom_text = f"batch {oom[0]} after {oom[2]} trials, {oom[1]:.1f} s"
            if result.chosen is None:
                best = f"nothing fits (grid: {len(fitting)} fit)"
                print(f"| {name} | {frac:.0%} = {fmt_bytes(budget)} | {best} | - | - | {planning:.1f} s | "
                      f"{grid_seconds:.0f} s | {grid_seconds / planning:.0f}x | {oom_text} |", flush=True)
                continue
            chosen = result.chosen.plan
            peak, t = grid[chosen]
            fastest = min(fitting)[0] if fitting else float("nan")
            print(f"| {name} | {frac:.0%} = {fmt_bytes(budget)} | {chosen.short(BATCH)} | "
                  f"{'yes' if peak <= budget else 'NO'} ({fmt_bytes(peak)}) | {t / fastest:.2f}x | {planning:.1f} s | "
                  f"{grid_seconds:.0f} s ({len(grid)} plans) | {grid_seconds / planning:.0f}x | {oom_text} |",
                  flush=True)


if __name__ == "__main__":
    main()
