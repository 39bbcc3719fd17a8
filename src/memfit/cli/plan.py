"""memfit plan: the fastest plan that fits a memory budget."""

from __future__ import annotations

import argparse
import contextlib

from memfit.cli.common import (
    SIZE_FLAGS,
    add_command,
    add_plan_args,
    add_workload_args,
    apply_config,
    given_fields,
    max_size,
    plan_from_args,
    print_json,
    sized_free,
    sized_workload,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "plan", run,
                    help="find the fastest plan that fits a memory budget (no OOM trials)",
                    description="Search precision, checkpointing, optimizer, offload, loss chunking, attention, "
                                "compile and micro-batching on predictions: every candidate's memory comes from "
                                "an exact fake-tensor trace, its time from a cost model.")
    add_workload_args(p, max_values=True, from_config=True)
    add_plan_args(p)
    p.add_argument("--budget", help="memory budget: 20GiB, 1.5GB, 80%% of the device; default: capacity minus 10%%")
    p.add_argument("--out", metavar="FILE", help="write the chosen plan (YAML, or JSON for .json)")
    p.add_argument("--format", choices=("yaml", "hf", "lightning", "kohya", "ai-toolkit", "axolotl", "llamafactory",
                                        "torchtune"),
                   default="yaml",
                   help="also print the plan as Hugging Face TrainingArguments or Lightning Trainer keyword "
                        "arguments (accepted unchanged), what they cannot carry and memfit's callback that applies it; "
                        "kohya: the lines of a kohya-ss sd-scripts --config_file TOML; ai-toolkit: an ai-toolkit job "
                        "YAML; axolotl, llamafactory, torchtune: an axolotl, LLaMA-Factory or torchtune config's fields (these "
                        "five search only the plans that trainer runs)")
    p.add_argument("--pareto", metavar="FILE.png", help="write a memory vs time plot of the evaluated plans")
    p.add_argument("--optimizers", default=None,
                   help="optimizer variants to consider, from adamw, adamw8bit, adamw8bit-ao, adamw4bit-ao, "
                        "adamwfp8-ao, adafactor, sgd, or adamw-class (all the AdamW ones). Default for GPU "
                        "presets: the AdamW ones but the torchao variants whose states are no smaller than "
                        "adamw8bit's; adamw,adamw8bit on the CPU")
    p.add_argument("--host", metavar="HOST",
                   help="the machine that trains, for the host part of GPU step times: h100-box (the default on "
                        "a preset), h200-box, h200-box-a, h200-box-b, h200-box-c, a multiple of h100-box's dispatch costs (1.3), or measure "
                        "(this machine: its memory bandwidth by a CPU AdamW; the default with --device cuda)")
    p.add_argument("--host-memory", metavar="SIZE",
                   help="the training machine's memory for offloaded and swapped copies: 64GB, or 80%% of this "
                        "machine's; plans that need more are rejected. Default: with --device cuda, what this "
                        "machine can still give; on a preset, not checked")
    p.add_argument("--methods", metavar="METHODS",
                   help="compare fine-tuning methods side by side (full,lora,dora,qlora,qdora; they train different "
                        "things): each gets its fastest plan that fits. Default: the workload's own method only")
    p.add_argument("--max-traces", default="60", help="most candidate plans to trace")
    p.add_argument("--compile-modes", metavar="MODES",
                   help="compile modes to consider (none,blocks,full), the compiled ones also with activation "
                        "budgets 0.5 and 0.1; default: none (on the CPU timing them compiles each for real; on "
                        "GPU presets each candidate is traced through Inductor: slow for large models)")
    p.add_argument("--max-world-size", metavar="N",
                   help="shard over ranks when one device is not enough: try world sizes 1, 2, 4, ... up to N (FSDP2; "
                        "--budget is per rank) and choose the smallest whose fastest plan fits")
    p.add_argument("--steps", metavar="N", help="the run's length in steps: compile time then counts as compile "
                                                "seconds / N per step (default: a long run, compile time not counted)")


def run(args: argparse.Namespace) -> int:
    from memfit.errors import UserError
    from memfit.integrations.export import to_hf, to_lightning
    from memfit.outputs import IMAGE_SUFFIXES, check_output_file
    from memfit.planner.progress import PlanProgress
    from memfit.planner.search import plan
    from memfit.report.planner import print_plan_result, save_pareto_png
    from memfit.techniques.compile import MODES as COMPILE_MODES
    from memfit.techniques.optimizers import NAMES as OPTIMIZERS
    from memfit.units import parse_positive_int

    apply_config(args)
    free = max_size(args)
    workload, bs, seq = sized_workload(args, allow_max=True)
    if getattr(args, "config_summary", None) and not args.json:
        print(args.config_summary)
    max_traces = parse_positive_int(args.max_traces, "--max-traces")
    if args.out:
        check_output_file(args.out, "--out", example="plan.yaml")
    if args.pareto:
        check_output_file(args.pareto, "--pareto", example="pareto.png", suffixes=IMAGE_SUFFIXES)
    steps = parse_positive_int(args.steps, "--steps") if args.steps is not None else None
    compile_modes = None
    if args.compile_modes is not None:
        compile_modes = tuple(m.strip() for m in args.compile_modes.split(",") if m.strip())
        bad = [m for m in compile_modes if m not in COMPILE_MODES] or ([] if compile_modes else [""])
        if bad:
            raise UserError(f"--compile-modes: unknown mode {bad[0]!r}; give some of {', '.join(COMPILE_MODES)}, "
                            "separated by commas")
    from memfit.techniques.optimizers import ADAMW_CLASS
    optimizers = tuple(x for o in (args.optimizers or "").split(",") if o.strip()
                       for x in (ADAMW_CLASS if o.strip() == "adamw-class" else (o.strip(),))) or None
    for o in optimizers or ():
        if o not in OPTIMIZERS:
            raise UserError(f"--optimizers: unknown optimizer {o!r}; choose from {', '.join(OPTIMIZERS)}")
    given = plan_from_args(args)
    fixed = given_fields(args, given)
    from memfit.hosts import host_for
    host = host_for(args.host, args.device)
    if args.format != "yaml" and (free is not None or args.methods is not None):
        raise UserError(f"--format {args.format} prints one chosen plan; drop --methods and give the size (not max), "
                        "or leave --format out")
    if free is not None:
        return _largest(args, free, fixed, dict(optimizers=optimizers, max_traces=max_traces,
                                                compile_modes=compile_modes, steps=steps,
                                                host_memory=args.host_memory))
    if args.methods is not None:
        return _compare_methods(args, workload, given, fixed, bs, seq, optimizers, max_traces, compile_modes, steps,
                                host)
    from memfit.cli.trainer_formats import TARGETS
    trainer = TARGETS[args.format](workload, bs, args.device, args.workload, seq) if args.format in TARGETS else None
    fixed = trainer.own_fields(fixed) if trainer else fixed
    runs_in = trainer.runs_in(fixed) if trainer else None  # (refuses a model the trainer does not train, now)
    sizes = [given.world_size]
    per_rank = getattr(args, "batch_per_rank", None)  # (a config's batch is each rank's: apply_config)
    if args.max_world_size is not None:
        most = parse_positive_int(args.max_world_size, "--max-world-size")
        if given.world_size > 1:
            raise UserError("give --world-size (plan for that many ranks) or --max-world-size (find the smallest), "
                            "not both")
        sizes = _world_sizes(most, workload, bs, args.device, seq, per_rank)
    tried = []
    with PlanProgress() if not args.json else contextlib.nullcontext() as progress:
        for world in sizes:
            fields = {**fixed, "world_size": world} if world > 1 else fixed
            result = plan(workload, budget=args.budget, device=args.device,
                          batch_size=per_rank * world if per_rank else bs, seq_len=seq,
                          optimizers=optimizers, max_traces=max_traces,
                          fixed=fields, compile_modes=compile_modes, steps=steps, progress=progress, host=host,
                          host_memory=args.host_memory, runs_in=runs_in,
                          search_values=trainer.search_values() if trainer else None)
            tried.append(world)
            if result.chosen:
                break
    ranks = None
    if len(sizes) > 1:
        ranks = f"world sizes tried: {', '.join(map(str, tried))}; " + (
            f"the smallest that fits the budget per rank: {tried[-1]}" if result.chosen else
            f"none fits the budget per rank up to {tried[-1]} ranks") + (
            f" (the config's batch of {per_rank} a rank: {per_rank * tried[-1]} in all)" if per_rank else "")
    if args.pareto:
        save_pareto_png(result, args.pareto)
    if result.chosen and args.out:
        result.chosen.plan.save(args.out)
    if args.json:
        out = result.to_json()
        if result.chosen:
            exported = _exported(result, args, seq)
            for name, key, to in (("hf", "hf_training_arguments", to_hf), ("lightning", "lightning_trainer", to_lightning)):
                arguments = _arguments(to, result, args, exported)
                out[key] = arguments.kwargs
                out[f"{name}_unmapped"], out[f"{name}_notes"] = list(arguments.unmapped), list(arguments.notes)
                out[f"{name}_callback"] = arguments.callback if arguments.unmapped else None
        if result.chosen and trainer:
            out.update(trainer.export(result).json)
        if ranks:
            out["world_sizes_tried"] = tried
            out["smallest_world_size"] = tried[-1] if result.chosen else None
        print_json(out)
    else:
        print_plan_result(result)
        if ranks:
            print(ranks)
        if result.chosen and trainer:
            trainer.export(result).print()
        elif result.chosen and args.format != "yaml":
            arguments = _arguments(to_hf if args.format == "hf" else to_lightning, result, args,
                                   _exported(result, args, seq))
            print(arguments.python())
            for note in arguments.notes:
                print(f"  in your code: {note}")
            for setting in arguments.unmapped:
                print(f"  not carried by these arguments: {setting}")
            if arguments.unmapped:
                print(f"  -> {arguments.callback_line(args.out)}")
        if result.chosen and args.out:
            print(f"plan written to {args.out}")
        if args.pareto:
            print(f"Pareto plot written to {args.pareto}")
    return 0 if result.chosen else 1


def _exported(result, args, seq):
    """The chosen plan as a trainer's arguments carry it, and what it leaves to the checkpoint
    (memfit.target.as_exported)."""
    from memfit.devices import get_device
    from memfit.target import as_exported
    from memfit.workloads import load_workload
    return as_exported(result.chosen.plan, load_workload(args.workload, seq_len=seq), get_device(args.device))


def _arguments(to, result, args, exported):
    """The plan ``exported`` (:func:`_exported`) as ``to`` (memfit.integrations.export's ``to_hf``, ``to_lightning``)
    writes it, with what it leaves to the checkpoint said first."""
    import dataclasses
    plan, said = exported
    arguments = to(plan, result.batch_size, args.device)
    return dataclasses.replace(arguments, notes=(*said, *arguments.notes)) if said else arguments


def _world_sizes(most: int, workload, bs, device, seq, per_rank: int | None) -> list[int]:
    """``--max-world-size``'s world sizes: 1, 2, 4, ... up to ``most``. memfit's batch is all the ranks': each
    size must divide it, unless the batch is each rank's (``per_rank``: a training config's, as axolotl's
    ``micro_batch_size``), which then grows with the ranks."""
    sizes = [2 ** i for i in range(most.bit_length())]
    if per_rank:
        return sizes
    from memfit.target import Target
    batch = Target.resolve(workload, None, bs, device, seq_len=seq).batch_size
    return [w for w in sizes if w <= batch and batch % w == 0]


def _compare_methods(args, workload, given, fixed, bs, seq, optimizers, max_traces, compile_modes, steps,
                     host=None) -> int:
    """``--methods``: plan each method on its own (NOTE [ Methods are the user's ])."""
    from memfit.errors import UserError
    from memfit.planner.methods import (
        DIFFERENT_THINGS,
        check_precision,
        on_checkpoint,
        parse_methods,
        plan_method,
        with_experts_quantized,
    )
    from memfit.planner.progress import PlanProgress
    from memfit.planner.side_by_side import plan_side_by_side
    from memfit.report.planner import print_methods

    if args.max_world_size is not None or given.world_size > 1:
        raise UserError("--methods compares methods on one device; leave out --world-size and --max-world-size")
    if args.out or args.pareto:
        raise UserError("--methods compares several plans; plan the method you pick without --methods to write "
                        "--out or --pareto")
    from memfit.workloads import load_workload
    methods = parse_methods(args.methods, given.adapter)
    check_precision(methods, given.precision, "--methods")
    workload = load_workload(workload, seq_len=seq)  # once, here: the searches' processes share it (forked)
    methods = on_checkpoint(methods, workload, "--methods", args.device)
    methods = with_experts_quantized(methods, workload)
    searches = [(m.name, dict(workload=workload, budget=args.budget, device=args.device, batch_size=bs,
                              optimizers=optimizers, max_traces=max_traces, fixed={**fixed, **m.keys},
                              compile_modes=compile_modes, steps=steps, host=host,
                              host_memory=args.host_memory, field_recipes=False)) for m in methods]  # (listed by a one-method plan)
    with PlanProgress() if not args.json else contextlib.nullcontext() as progress:
        longest = next((i for i, m in enumerate(methods) if m.name == "full"), 0)
        results = plan_side_by_side(searches, progress, plan=plan_method, longest=longest)  # NOTE [ Methods planned side by side ]
    rows = [(m, r, r.trainable) for m, (r, _) in zip(methods, results)]
    if args.json:
        print_json({"note": DIFFERENT_THINGS, "methods": [
            {"method": m.name, "trains": m.trains, "trainable_parameters": n, **r.to_json()} for m, r, n in rows]})
    else:
        print_methods(rows)
    return 0 if any(r.chosen for _, r, _ in rows) else 1



def _largest(args: argparse.Namespace, key: str, fixed: dict, kwargs: dict) -> int:
    """A size given as ``max``: the fastest value and plan, and the largest value under any plan
    (memfit.planner.search_max)."""
    from memfit.errors import UserError
    from memfit.planner.progress import PlanProgress
    from memfit.planner.search_max import plan_largest
    from memfit.report.planner import print_largest_plan

    flag = SIZE_FLAGS[key]
    if args.methods is not None or args.max_world_size is not None or int(fixed.get("world_size") or 1) > 1:
        raise UserError(f"{flag} max plans one method on one device; drop --methods, --world-size and --max-world-size "
                        "(memfit fit compares cards and methods)")
    if args.pareto:
        raise UserError(f"{flag} max runs several searches; give the value it finds to write --pareto")
    sized = sized_free(args, key)
    with PlanProgress() if not args.json else contextlib.nullcontext() as progress:
        result = plan_largest(sized, budget=args.budget, device=args.device, fixed=fixed, progress=progress, **kwargs)
    if result.best and args.out:
        result.best.chosen.plan.save(args.out)
    if args.json:
        print_json(result.to_json())
    else:
        print_largest_plan(result)
        if result.best and args.out:
            print(f"plan written to {args.out}")
        elif result.best:  # (as plan's own table: the plan is written with --out, not dumped)
            print(f"--out plan.yaml writes the fastest plan; train with it at {result.sized.axis.flag} "
                  f"{result.best_value} (memfit train ... --plan plan.yaml)")
    return 0 if result.best else 1
