"""memfit train: train a workload with a plan (given, or found for --budget)."""

from __future__ import annotations

import argparse

from memfit.cli.common import add_plan_args, batch_and_seq, plan_from_args, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train with a plan (given, or the planner's for --budget)",
                       description="Train on the one TrainStep; metrics.jsonl and atomic checkpoints go to --out.")
    p.add_argument("workload", help="built-in name or path/to/file.py:NAME")
    p.add_argument("--batch-size", "-b", metavar="N")
    p.add_argument("--seq-len", metavar="T")
    p.add_argument("--budget", help="find the plan with the planner for this budget (when no --plan is given)")
    p.add_argument("--steps", default="20", help="optimizer steps to reach")
    p.add_argument("--data", help="text file or folder for built-in language models (default: Python's own sources)")
    p.add_argument("--out", default="memfit-out", help="output folder: metrics.jsonl, checkpoint.pt")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--seed", default="0")
    p.add_argument("--checkpoint-every", default="10", metavar="N")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    add_plan_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from memfit.plans import Plan
    from memfit.train.loop import train
    from memfit.units import parse_positive_int

    bs, seq = batch_and_seq(args)
    given = plan_from_args(args)
    plan = given if (args.plan or given != Plan() or args.budget is None) else None
    try:
        seed = int(args.seed)
    except ValueError:
        from memfit.errors import UserError
        raise UserError(f"--seed {args.seed!r} is not a whole number") from None
    result = train(args.workload, plan=plan, budget=args.budget, steps=parse_positive_int(args.steps, "--steps"),
                   out=args.out, data=args.data, resume=args.resume, seed=seed, batch_size=bs, seq_len=seq,
                   checkpoint_every=int(args.checkpoint_every), progress=not args.json)
    summary = {"steps": result.steps, "final_loss": result.losses[-1] if result.losses else None,
               "predicted_peak_bytes": result.predicted_peak_bytes, "measured_peak_bytes": result.measured_peak_bytes,
               "out": result.out_dir, "plan": result.plan}
    if args.json:
        print_json(summary)
    else:
        if result.measured_peak_bytes:
            err = 100 * (result.predicted_peak_bytes - result.measured_peak_bytes) / result.measured_peak_bytes
            print(f"steady-state peak: predicted {result.predicted_peak_bytes / 2**20:,.1f} MiB, measured "
                  f"{result.measured_peak_bytes / 2**20:,.1f} MiB ({err:+.2f}%)")
        print(f"metrics: {result.out_dir}/metrics.jsonl · checkpoint: {result.out_dir}/checkpoint.pt")
    return 0
