"""memfit estimate: predict the peak memory of a training step on fake tensors."""

from __future__ import annotations

import argparse

from memfit.cli.common import (
    SIZE_FLAGS,
    add_command,
    add_plan_args,
    add_report_args,
    add_workload_args,
    apply_config,
    max_size,
    plan_from_args,
    print_json,
    print_report_extras,
    report_args,
    sized_free,
    sized_workload,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "estimate", run,
                    help="predict a training step's peak memory (fake tensors: no memory, no GPU)",
                    description="Trace the steady-state training step (the second: optimizer states exist) on "
                                "fake tensors and report its peak memory with a breakdown by category. With "
                                "--batch-size, --seq-len or --resolution max: the largest value that fits the "
                                "budget under the plan, exact (its trace fits, the next value's does not).")
    add_workload_args(p, max_values=True, from_config=True)
    add_plan_args(p)
    p.add_argument("--budget", help="with a size given as max: the memory budget (20GiB, 1.5GB, 80%% of the device); "
                                    "default: the whole device (what the report's verdict counts: reserved + CUDA "
                                    "context on a GPU preset)")
    p.add_argument("--host-memory", metavar="SIZE",
                   help="the training machine's memory (64GB, or 80%% of this machine's): the report says whether "
                        "the plan's host copies (offloaded, swapped, paged out) fit it. Default: with --device "
                        "cuda, what this machine can still give; on a preset, not checked")
    add_report_args(p, "write the step's memory timeline, stacked by category",
                    "write the trace as a torch.cuda.memory._snapshot() pickle: segments and blocks (a GPU "
                    "preset's from memfit's caching-allocator model), allocations with their module, category "
                    "and phase as frames")


def run(args: argparse.Namespace) -> int:
    from memfit.memory.estimate import estimate
    from memfit.report.tables import print_estimate

    apply_config(args)
    modules = report_args(args)
    free = max_size(args)
    if free is not None:
        return _largest(args, free, modules)
    if args.budget is not None:
        from memfit.errors import UserError
        raise UserError("estimate --budget is for a size given as max (e.g. --batch-size max); memfit plan plans "
                        "for a budget")
    workload, bs, seq = sized_workload(args)
    _say_config(args)
    host = _host_limit(args)
    report = estimate(workload, plan_from_args(args), batch_size=bs, device=args.device, seq_len=seq,
                      timeline=args.timeline, snapshot=args.snapshot)
    if args.json:
        print_json({**report.to_json(), **_host_json(report, host)})
        return 0
    print_estimate(report, host_limit=host)
    print_report_extras(report, args, modules)
    return 0


def _largest(args: argparse.Namespace, key: str, modules: int | None) -> int:
    """``max``: the largest value that fits under the plan, and the report at it."""
    from memfit.devices import get_device
    from memfit.errors import UserError
    from memfit.planner.sized import budget_for, largest_estimate
    from memfit.report.tables import print_estimate
    from memfit.units import fmt_bytes

    if args.timeline or args.snapshot:
        raise UserError(f"{SIZE_FLAGS[key]} max traces several values; give the value it finds to write "
                        "--timeline or --snapshot")
    device = get_device(args.device)
    host = _host_limit(args)
    sized = sized_free(args, key)
    budget = budget_for(args.budget, device)
    plan = plan_from_args(args)
    _say_config(args)
    found, report = largest_estimate(sized, plan, device, budget)
    if found.value is None:
        what = "reserved + CUDA context" if device.is_gpu else "the step's peak"
        raise UserError(f"estimate {SIZE_FLAGS[key]} max: not even {found.axis.show(found.next_value)} fits the "
                        f"budget of {fmt_bytes(budget.bytes)} on {device.name}: it needs {fmt_bytes(found.next_used_bytes)} "
                        f"({what}); give a larger --budget, or a plan that saves memory (memfit plan finds one)")
    if args.json:
        print_json({**report.to_json(), **_host_json(report, host), "largest": found.to_json()})
        return 0
    print_estimate(report, host_limit=host)
    print_report_extras(report, args, modules)
    print(found.describe())
    return 0


def _host_limit(args: argparse.Namespace) -> int | None:
    """The training machine's memory the step's host copies are held to (``--host-memory``; None: not
    checked), as ``memfit plan`` resolves it (memfit.memory.budget.Budget.with_host)."""
    from memfit.devices import get_device
    from memfit.memory.budget import Budget
    return Budget.resolve(None, get_device(args.device)).with_host(args.host_memory).host_bytes


def _host_json(report, limit: int | None) -> dict:
    need = report.host_held_bytes
    return {"host_bytes": need, "host_budget_bytes": limit, "host_fits": None if limit is None else need <= limit}


def _say_config(args: argparse.Namespace) -> None:
    """``--from``: what the config became (not with --json: one object only)."""
    summary = getattr(args, "config_summary", None)
    if summary and not args.json:
        print(summary)
