"""memfit estimate: predict the peak memory of a training step on fake tensors."""

from __future__ import annotations

import argparse

from memfit.cli.common import add_plan_args, add_workload_args, batch_and_seq, plan_from_args, print_json
from memfit.outputs import IMAGE_SUFFIXES, check_output_file
from memfit.units import parse_positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="predict a training step's peak memory (fake tensors: no memory, no GPU)",
                       description="Trace the steady-state training step (the second: optimizer states exist) on "
                                   "fake tensors and report its peak memory with a breakdown by category.")
    add_workload_args(p)
    add_plan_args(p)
    p.add_argument("--timeline", metavar="FILE.png", help="write the step's memory timeline, stacked by category")
    p.add_argument("--modules", metavar="N", help="also print the N modules holding most memory at the peak")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memfit.memory.estimate import estimate
    from memfit.report.tables import print_estimate, print_modules

    bs, seq = batch_and_seq(args)
    modules = parse_positive_int(args.modules, "--modules") if args.modules else None
    if args.timeline:
        check_output_file(args.timeline, "--timeline", example="timeline.png", suffixes=IMAGE_SUFFIXES)
    report = estimate(args.workload, plan_from_args(args), batch_size=bs, device=args.device, seq_len=seq,
                      timeline=args.timeline)
    if args.json:
        print_json(report.to_json())
        return 0
    print_estimate(report)
    if modules:
        print_modules(report, modules)
    if args.timeline:
        print(f"timeline written to {args.timeline}")
    return 0
