"""memfit estimate: predict the peak memory of a training step on fake tensors."""

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


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "estimate", run,
                    help="predict a training step's peak memory (fake tensors: no memory, no GPU)",
                    description="Trace the steady-state training step (the second: optimizer states exist) on "
                                "fake tensors and report its peak memory with a breakdown by category.")
    add_workload_args(p)
    add_plan_args(p)
    add_report_args(p, "write the step's memory timeline, stacked by category",
                    "write the trace as a torch.cuda.memory._snapshot() pickle: segments and blocks (a GPU "
                    "preset's from memfit's caching-allocator model), allocations with their module, category "
                    "and phase as frames")


def run(args: argparse.Namespace) -> int:
    from memfit.memory.estimate import estimate
    from memfit.report.tables import print_estimate

    workload, bs, seq = sized_workload(args)
    modules = report_args(args)
    report = estimate(workload, plan_from_args(args), batch_size=bs, device=args.device, seq_len=seq,
                      timeline=args.timeline, snapshot=args.snapshot)
    if args.json:
        print_json(report.to_json())
        return 0
    print_estimate(report)
    print_report_extras(report, args, modules)
    return 0
