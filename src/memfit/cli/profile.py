"""memfit profile: run the step for real here; measured peak next to the prediction."""

from __future__ import annotations

import argparse

from memfit.cli.common import (
    add_command,
    add_plan_args,
    add_report_args,
    add_workload_args,
    plan_from_args,
    print_json,
    print_report_extras,
    report_args,
    sized_workload,
)
from memfit.units import parse_positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "profile", run,
                    help="run the step for real on this machine and compare with the prediction",
                    description="Run the training step for real, measure its steady-state peak independently "
                                "of memfit's tracker (on a CPU: the PyTorch profiler's allocator events; with "
                                "--device cuda: the CUDA caching allocator's max_memory_allocated and "
                                "max_memory_reserved over the step), and show it beside the prediction of "
                                "`memfit estimate` for the same device.")
    add_workload_args(p)
    add_plan_args(p)
    add_report_args(p, "write the step's memory timeline: stacked by category on a CPU; on a GPU from the caching "
                       "allocator's history, stacked by the phase that allocated each block",
                    "write the real run as a torch.cuda.memory._snapshot() pickle: on a CPU from memfit's tracker "
                    "(module, category and phase as frames); on a GPU the caching allocator's own, over the step")
    p.add_argument("--repeats", default="5", metavar="N", help="timed steps for step_seconds (median)")


def run(args: argparse.Namespace) -> int:
    from memfit.memory.measure import profile
    from memfit.report.tables import print_profile

    workload, bs, seq = sized_workload(args)
    modules = report_args(args)
    result = profile(workload, plan_from_args(args), batch_size=bs, device=args.device, seq_len=seq,
                     repeats=parse_positive_int(args.repeats, "--repeats"), timeline=args.timeline,
                     snapshot=args.snapshot)
    if args.json:
        print_json(result.to_json())
        return 0
    print_profile(result)
    print_report_extras(result.measured, args, modules)
    return 0
