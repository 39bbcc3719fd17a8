"""memfit train: train a workload with a plan (given, or found for --budget)."""

from __future__ import annotations

import argparse

from memfit.cli.common import (
    add_command,
    add_plan_args,
    add_resolution_arg,
    plan_from_args,
    print_json,
    sized_workload,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "train", run,
                    help="train with a plan (given, or the planner's for --budget)",
                    description="Train on the one TrainStep; metrics.jsonl, atomic checkpoints and an "
                                "end-of-run report (report.json, memory-timeline.png) go to --out. With a budget "
                                "on a CPU, a guard raises CUDA's out-of-memory error when device memory would "
                                "pass it, and the run adapts (smaller micro-batches, then checkpointing, then "
                                "offload) without changing the training. SIGTERM or SIGUSR1 ends the run after its "
                                "current step with a checkpoint (exit 0, the command that resumes printed); a second "
                                "signal exits at once.")
    p.add_argument("workload", help="built-in name or path/to/file.py:NAME")
    p.add_argument("--batch-size", "-b", metavar="N")
    p.add_argument("--seq-len", metavar="T")
    add_resolution_arg(p)
    p.add_argument("--budget", help="memory budget (e.g. 6GiB, 80%%): the planner chooses the plan when no --plan "
                                    "or plan flag is given; with one, the plan is kept and the budget enforced")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    p.add_argument("--steps", default="20", help="optimizer steps to reach")
    p.add_argument("--data", help="text file or folder for built-in language models (default: Python's own sources)")
    p.add_argument("--workers", metavar="N", help="DataLoader worker processes (default: 2 on a GPU, 0 on a CPU)")
    p.add_argument("--out", default="memfit-out", help="output folder: metrics.jsonl, checkpoint-<step>.pt, report.json")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out that loads")
    p.add_argument("--overwrite", action="store_true", help="start over in an --out folder that holds a checkpoint")
    p.add_argument("--seed", default="0")
    p.add_argument("--checkpoint-every", default="10", metavar="N")
    p.add_argument("--keep-checkpoints", default="2", metavar="K",
                   help="how many of the newest checkpoints stay in --out (default 2): resume takes the newest that "
                        "loads; an older one is removed only once a newer one is complete")
    p.add_argument("--nproc", metavar="N", help="train on N processes of this machine, one rank each (torchrun's "
                                                "launcher, one node): FSDP2 over the N ranks, gloo on a CPU, NCCL on "
                                                "GPUs; --batch-size is the global batch and --budget is per rank")
    p.add_argument("--port", metavar="P", help="with --nproc: the ranks' rendezvous port on 127.0.0.1 (default: a free "
                                               "one)")
    p.add_argument("--no-report", action="store_true", help="skip the end-of-run report (a few fake traces)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    add_plan_args(p)


def run(args: argparse.Namespace) -> int:
    from memfit.errors import UserError
    from memfit.outputs import check_output_dir
    from memfit.plans import Plan
    from memfit.training.distributed import current
    from memfit.training.loop import train
    from memfit.training.report import render
    from memfit.units import parse_positive_int

    workload, bs, seq = sized_workload(args)
    given = plan_from_args(args)
    plan = given if (args.plan or given != Plan() or args.budget is None) else None
    try:
        seed = int(args.seed)
        every = int(args.checkpoint_every)
        workers = None if args.workers is None else int(args.workers)
    except ValueError:
        raise UserError("--seed, --checkpoint-every and --workers take whole numbers") from None
    if every < 0 or (workers is not None and workers < 0):
        raise UserError("--checkpoint-every and --workers must be >= 0")
    keep = parse_positive_int(args.keep_checkpoints, "--keep-checkpoints")
    if not -2**63 <= seed < 2**64:  # torch.manual_seed's range
        raise UserError(f"--seed {seed} is out of range; give a whole number from {-2**63} to {2**64 - 1}")
    steps = parse_positive_int(args.steps, "--steps")
    check_output_dir(args.out, "--out")
    nproc = parse_positive_int(args.nproc, "--nproc") if args.nproc is not None else 1
    ranks = current()
    if ranks is None and nproc > 1:
        return _launch(args, workload, nproc, plan=plan, bs=bs, seq=seq, seed=seed, every=every, workers=workers,
                       steps=steps, keep=keep)
    if ranks is not None and args.nproc is not None and nproc != ranks.world_size:
        raise UserError(f"--nproc {nproc}, and the launcher started {ranks.world_size} processes; make them the same")
    if args.port is not None and ranks is None:
        raise UserError("--port is the rendezvous port of --nproc ranks; add --nproc N, or remove --port")
    result = train(workload, plan=plan, budget=args.budget, steps=steps,
                   out=args.out, data=args.data, resume=args.resume, overwrite=args.overwrite, seed=seed,
                   batch_size=bs, seq_len=seq, device=args.device, workers=workers, checkpoint_every=every,
                   progress=not args.json, report=not args.no_report, keep_checkpoints=keep)
    if result.stopped_by is not None:
        return _stopped(args, result, ranks, planned=plan is None)
    summary = result.report or {
        "steps": result.steps, "final_loss": result.losses[-1] if result.losses else None,
        "predicted_peak_bytes": result.predicted_peak_bytes, "measured_peak_bytes": result.measured_peak_bytes,
        "plan": result.plan, "adapted_plan": result.adapted_plan, "adaptations": result.adaptations,
        "budget_bytes": result.budget_bytes, "guard_peak_bytes": result.guard_peak_bytes,
        "world_size": result.world_size, "measured_peak_bytes_per_rank": result.measured_peak_bytes_per_rank}
    summary["out"] = result.out_dir
    if ranks is not None and not ranks.is_main:
        return 0  # (rank 0 says it)
    if args.json:
        print_json(summary)
    else:
        text = render(summary)
        if text:
            print(text)
        extra = " · report.json" if result.report else ""
        saved = f" · checkpoint: {result.last_checkpoint}" if result.last_checkpoint else ""
        print(f"metrics: {result.out_dir}/metrics.jsonl{saved}{extra}")
    return 0


PLANNED = "planned.yaml"
"""The plan the planner chose for --budget, written to --out when a resume needs it: planning again
could choose another plan (on a CPU it times real steps), which the checkpoint would refuse."""


def resume_command(argv: list[str], plan_file=None) -> str:
    """The command line that continues a run started with ``memfit *argv``: --resume instead of
    --overwrite, and the plan it trained (``plan_file``) when the planner chose it."""
    import shlex
    rest = [a for a in argv if a not in ("--overwrite", "--resume")]
    plan = ["--plan", str(plan_file)] if plan_file is not None and "--plan" not in rest else []
    return shlex.join(["memfit", *rest, *plan, "--resume"])


def _stopped(args: argparse.Namespace, result, ranks, *, planned: bool) -> int:
    """A signal ended the run after a checkpoint: say where, and how to continue (exit 0)."""
    from pathlib import Path

    from memfit.plans import Plan
    from memfit.training.distributed import record_stop
    line = (f"memfit train: stopped by {result.stopped_by} after step {result.last_step}; "
            f"its checkpoint is {result.last_checkpoint}")
    if ranks is not None and record_stop(line):
        return 0  # (a launched rank: the launcher says it, with the command that resumes)
    if ranks is not None and not ranks.is_main:
        return 0
    plan_file = None
    if planned:
        plan_file = Path(result.out_dir) / PLANNED
        Plan.from_dict(result.plan, source="the run's plan").save(plan_file)
    command = resume_command(args.argv, plan_file)
    if args.json:
        print_json({"stopped_by": result.stopped_by, "step": result.last_step, "checkpoint": result.last_checkpoint,
                    "resume_command": command, "out": result.out_dir})
    else:
        launcher = " (under the same launcher)" if ranks is not None else ""
        print(f"{line}; resume with{launcher}: {command}", flush=True)
    return 0


def _launch(args: argparse.Namespace, workload, nproc: int, *, plan, bs, seq, seed, every, workers, steps,
            keep) -> int:
    """Check and plan the run here, once, then start ``nproc`` ranks that run this same command (with
    the plan found, when the planner chose it)."""
    from pathlib import Path

    from memfit.errors import UserError
    from memfit.training.distributed import check_launch, launch
    from memfit.training.loop import prepare

    port = None
    if args.port is not None:
        try:
            port = int(args.port)
        except ValueError:
            raise UserError(f"--port {args.port!r}: give a port number, or leave --port out") from None
    target, *_ = prepare(workload, plan=plan, budget=args.budget, steps=steps, out=args.out, data=args.data,
                         resume=args.resume, overwrite=args.overwrite, seed=seed, batch_size=bs, seq_len=seq,
                         device=args.device, workers=workers, checkpoint_every=every, progress=False, report=False,
                         world_size=nproc, keep_checkpoints=keep)
    check_launch(nproc, target.device.kind, port)
    argv = args.argv[args.argv.index("train") + 1:]
    if args.debug and "--debug" not in argv:
        argv.append("--debug")
    chosen = None
    if plan is None:  # the planner chose it: the ranks train that plan (and keep the budget), and so does a resume
        chosen = Path(args.out) / PLANNED
        target.plan.save(chosen)
        argv += ["--plan", str(chosen)]
    if not args.json:
        print(f"memfit train: {nproc} ranks on this machine (FSDP2, {target.rank_batch_size} of each batch of "
              f"{target.batch_size} per rank): {target.plan.describe()}", flush=True)
    return launch(argv, nproc, port=port, debug=args.debug, resume=resume_command(args.argv, chosen))

