"""What the subcommands share: their registration (:func:`add_command`) and the arguments of estimate,
profile, plan and train (workload, batch, plan, device, outputs).

The plan flags are the plan's keys (``--checkpointing``, ``--loss-chunks``, ...): each technique
declares its keys with their help text and how command-line text becomes a value
(``memfit.techniques.base.Key``), so a new technique's flags appear here by themselves.
"""

from __future__ import annotations

import argparse
import json
import sys

from memfit.errors import UserError
from memfit.outputs import IMAGE_SUFFIXES, check_output_file
from memfit.plans import Plan, keys
from memfit.units import MAX_SIZE, parse_positive_int


def add_command(sub: argparse._SubParsersAction, name: str, run, help: str,
                description: str | None = None) -> argparse.ArgumentParser:
    """Register the subcommand ``name``, which ``run(args)`` runs (its exit status), and return its
    parser for its own arguments; ``--debug`` (show tracebacks) works after the subcommand too."""
    p = sub.add_parser(name, help=help, description=description)
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run)
    return p


WORKLOAD_HELP = ("built-in name (gpt2, llama:num_hidden_layers=2, cnn, ...; see `memfit workloads`), path/to/file.py:NAME, "
                 "a Hugging Face model folder (./dir or hf:./dir), or a hub id (org/name, org/name@revision; through "
                 "the Hugging Face cache): its config.json only, no weights read")
MAX_HELP = ("; max: the largest that fits the budget (estimate: under the given plan; plan: the fastest value and plan, "
            "and the largest under any plan)")


def add_workload_args(p: argparse.ArgumentParser, *, max_values: bool = False, from_config: bool = False) -> None:
    """The workload and its sizes; ``max_values``: a size may be ``max`` (estimate, plan);
    ``from_config``: ``--from config.yml`` (an axolotl, ai-toolkit, LLaMA-Factory, torchtune, kohya or SimpleTuner config) may name the workload
    instead."""
    more = MAX_HELP if max_values else ""
    if from_config:
        p.add_argument("workload", nargs="?", help=WORKLOAD_HELP + "; or --from")
        p.add_argument("--from", dest="from_config", metavar="CONFIG",
                       help="an axolotl, ai-toolkit, LLaMA-Factory or torchtune config (.yml, .yaml), a kohya-ss sd-scripts "
                            "config (.toml) or a SimpleTuner config (.json, .toml, .env): its model, adapter, "
                            "quantization, sizes, checkpointing, precision and optimizer become the workload and the "
                            "plan (flags given here override it; a kohya config training a checkpoint file of an SD "
                            "or SDXL UNet takes the workload's name beside it)")
    else:
        p.add_argument("workload", help=WORKLOAD_HELP)
    p.add_argument("--batch-size", "-b", metavar="N", help="global batch size (default: the workload's)" + more)
    p.add_argument("--seq-len", metavar="T", help="sequence length for built-in language models and model folders "
                                                  "(default: the config's, a folder's capped at 2048)" + more)
    add_resolution_arg(p, more)
    p.add_argument("--device", "-d", default="cpu", help="cpu (this machine) or a GPU preset (see `memfit devices`)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_resolution_arg(p: argparse.ArgumentParser, more: str = "") -> None:
    p.add_argument("--resolution", metavar="PX", help="image size in pixels for the image- and video-generation "
                                                      "models (dit-flux, unet-sdxl, ...; default: the model's native, "
                                                      "e.g. 1024): PX square, or WIDTHxHEIGHT (e.g. 1216x832); their "
                                                      "latents are PX/8 on a side; a timm model's or vision-language "
                                                      "model's image (0: text only)" + more)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan", "a plan file, and flags that override its fields")
    g.add_argument("--plan", metavar="FILE", help="plan file (.yaml or .json)")
    for key in keys():
        flag = "--" + key.name.replace("_", "-")
        if key.annotation == "bool":
            g.add_argument(flag, dest=f"plan_{key.name}", nargs="?", const="true", metavar=key.metavar, help=key.doc)
        else:
            g.add_argument(flag, dest=f"plan_{key.name}", metavar=key.metavar, help=key.doc)


def given_fields(args: argparse.Namespace, given: Plan) -> dict:
    """The plan fields the user set, which the planner keeps: those ``given`` (the plan file and flags)
    sets apart from the default, and every plan flag given, a default value too (``--checkpointing
    none``: the user's step as written, not a field left to the search)."""
    flagged = {key.name for key in keys() if getattr(args, f"plan_{key.name}", None) is not None}
    default = Plan().to_dict()
    return {k: v for k, v in given.to_dict().items() if v != default[k] or k in flagged}


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan file (or an axolotl config's plan, ``--from``), with the plan flags over it."""
    plan = Plan.load(args.plan) if args.plan else getattr(args, "config_plan", None) or Plan()
    changes = {key.name: key.from_text(value) for key in keys()
               if (value := getattr(args, f"plan_{key.name}", None)) is not None}
    return plan.replace(**changes) if changes else plan


def add_report_args(p: argparse.ArgumentParser, timeline_help: str, snapshot_help: str) -> None:
    """``--timeline FILE.png``, ``--snapshot FILE.pickle`` and ``--modules N`` (estimate and profile)."""
    p.add_argument("--timeline", metavar="FILE.png", help=timeline_help)
    p.add_argument("--snapshot", metavar="FILE.pickle", help=snapshot_help + "; open it at https://pytorch.org/memory_viz")
    p.add_argument("--modules", metavar="N", help="also print the N modules holding most memory at the peak")


def report_args(args: argparse.Namespace) -> int | None:
    """Check ``--timeline``, ``--snapshot`` and ``--modules`` before any work; returns the number of modules to print."""
    if args.timeline:
        check_output_file(args.timeline, "--timeline", example="timeline.png", suffixes=IMAGE_SUFFIXES)
    if args.snapshot:
        from memfit.memory.snapshot import check_snapshot_path
        check_snapshot_path(args.snapshot)
    return parse_positive_int(args.modules, "--modules") if args.modules else None


def print_report_extras(report, args: argparse.Namespace, modules: int | None) -> None:
    """After the tables: the top modules (``--modules``) and where the timeline and snapshot went."""
    from memfit.report.tables import print_modules
    if modules:
        print_modules(report, modules)
    if args.timeline:
        print(f"timeline written to {args.timeline}")
    if args.snapshot:
        print(f"snapshot written to {args.snapshot} (open it at https://pytorch.org/memory_viz)")


SIZE_FLAGS = {"batch_size": "--batch-size", "seq_len": "--seq-len", "resolution": "--resolution"}


def max_size(args: argparse.Namespace) -> str | None:
    """The size given as ``max`` (``batch_size``, ``seq_len`` or ``resolution``), or None."""
    given = [key for key in SIZE_FLAGS if str(getattr(args, key, None) or "").strip().lower() == "max"]
    if len(given) > 1:
        raise UserError(f"{' and '.join(SIZE_FLAGS[k] for k in given)} are both max; ask for one size at a time "
                        "and give the other")
    return given[0] if given else None


def _size(args: argparse.Namespace, key: str) -> int | None:
    text = getattr(args, key, None)
    if text is None or str(text).strip().lower() == "max":
        return None
    if key == "resolution":
        return parse_resolution(text)
    return parse_positive_int(text, SIZE_FLAGS[key], MAX_SIZE)


def parse_resolution(text: str) -> int | tuple[int, int]:
    """``--resolution``: pixels on a side, ``WIDTHxHEIGHT`` as ``(width, height)`` (NOTE [ A resolution's
    width ] in memfit.workloads.checks), or 0 (a vision-language model's text only: NOTE [ Image-text batches ])."""
    text = str(text).strip()
    if text == "0":
        return 0
    width, sep, height = text.lower().replace("×", "x").replace(",", "x").partition("x")  # (kohya: width,height)
    if sep:
        if not (width.strip().isdigit() and height.strip().isdigit()):
            raise UserError(f"--resolution {text}: give PIXELS (a square, e.g. 1024) or WIDTHxHEIGHT (e.g. 1216x832)")
        return (parse_positive_int(width, "--resolution's width", MAX_SIZE),
                parse_positive_int(height, "--resolution's height", MAX_SIZE))
    return parse_positive_int(text, "--resolution", MAX_SIZE)


def batch_and_seq(args: argparse.Namespace) -> tuple[int | None, int | None]:
    return _size(args, "batch_size"), _size(args, "seq_len")


def sized_workload(args: argparse.Namespace, *, allow_max: bool = False) -> tuple[object, int | None, int | None]:
    """(workload, batch size, sequence length) from the arguments. With ``--resolution`` the workload
    is built here at that resolution (a Workload, sized: the sequence length is then in it), so that
    estimate, profile, plan and train all take it the same way; otherwise it is the name as given.
    A size given as ``max`` is None here (``allow_max``: estimate and plan take it, see :func:`max_size`)."""
    free = max_size(args)
    if free is not None and not allow_max:
        raise UserError(f"{SIZE_FLAGS[free]} max is for memfit estimate and memfit plan; give a number")
    bs, seq = batch_and_seq(args)
    res = _size(args, "resolution")
    if res is None:
        return args.workload, bs, seq
    from memfit.workloads import load_workload
    return load_workload(args.workload, seq_len=seq, resolution=res), bs, None


def sized_free(args: argparse.Namespace, key: str):
    """The workload with ``key`` left free (``max``), its other sizes as given (memfit.planner.sized)."""
    from memfit.planner.sized import Sized
    return Sized.of(args.workload, key, batch_size=_size(args, "batch_size"), seq_len=_size(args, "seq_len"),
                    resolution=_size(args, "resolution"))


def apply_config(args: argparse.Namespace, device=None) -> None:
    """``--from FILE``: the training config's workload, sizes and plan, under what the command line gives
    (memfit.integrations.configs); its unmapped fields are warned about, one line each. ``device``: the card the
    config is read for (default ``--device``'s)."""
    path = getattr(args, "from_config", None)
    if path is None:
        if getattr(args, "workload", "") is None:
            raise UserError("name a workload (e.g. gpt2), or a training config with --from config.yml (axolotl, "
                            "ai-toolkit, LLaMA-Factory, torchtune) or config.toml (kohya-ss sd-scripts)")
        return
    import warnings

    from memfit.devices import get_device
    from memfit.integrations.from_file import read_training_config
    mapped = read_training_config(path, device or get_device(args.device), args.workload)
    for line in mapped.warnings:
        warnings.warn(line, stacklevel=2)
    args.workload = mapped.workload
    res = mapped.resolution
    if getattr(args, "resolution", None) == "max" and isinstance(res, tuple):  # (max grows the height at the
        from memfit.workloads.config_overrides import with_override  # config's width)
        args.workload = with_override(mapped.workload, "width", res[0])
    batch_from_config = getattr(args, "batch_size", None) is None
    sizes = (("batch_size", mapped.batch_size), ("seq_len", mapped.seq_len),
             ("resolution", f"{res[0]}x{res[1]}" if isinstance(res, tuple) else res))
    for key, value in sizes:
        if getattr(args, key, None) is None and value is not None:
            setattr(args, key, str(value))
    args.config_plan = mapped.plan
    per_rank = mapped.ranks_from_launcher or mapped.batch_per_rank  # (as the plan holds them: flags and plan file)
    ranks = plan_from_args(args).world_size if per_rank else 1
    if mapped.ranks_from_launcher and ranks == 1 and getattr(args, "max_world_size", None) is None:
        raise UserError(f"--from {path}: fsdp: {mapped.ranks_from_launcher}")
    if mapped.batch_per_rank and ranks > 1 and batch_from_config:  # (memfit's batch is all the ranks')
        args.batch_size = str(mapped.batch_size * ranks)
    # (--max-world-size tries 1, 2, 4, ... ranks: each gets the config's batch, so memfit's grows with the ranks)
    args.batch_per_rank = mapped.batch_size if mapped.batch_per_rank and ranks == 1 and batch_from_config else None
    if max_size(args) == "batch_size":  # (max: what one step holds at once; the answer is the micro-batch)
        args.config_plan = mapped.plan.replace(micro_batch_size=None, grad_accum_steps=1)
    args.config_summary = mapped.summary()


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
