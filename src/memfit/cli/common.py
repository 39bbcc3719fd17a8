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


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="built-in name (gpt2, llama:num_hidden_layers=2, cnn, ...; see `memfit workloads`), "
                                    "path/to/file.py:NAME, a Hugging Face model folder (./dir or hf:./dir), or a "
                                    "hub id (org/name, org/name@revision; through the Hugging Face cache): its "
                                    "config.json only, no weights read")
    p.add_argument("--batch-size", "-b", metavar="N", help="global batch size (default: the workload's)")
    p.add_argument("--seq-len", metavar="T", help="sequence length for built-in language models and model folders (default: the "
                                             "config's, a folder's capped at 2048)")
    add_resolution_arg(p)
    p.add_argument("--device", "-d", default="cpu", help="cpu (this machine) or a GPU preset (see `memfit devices`)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_resolution_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resolution", metavar="PX", help="image size in pixels for the built-in image-generation models "
                                                      "(dit-lumina2, unet-sdxl, ...; default: the model's native, e.g. "
                                                      "1024); their latents are PX/8 on a side")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan", "a plan file, and flags that override its fields")
    g.add_argument("--plan", metavar="FILE", help="plan file (.yaml or .json)")
    for key in keys():
        flag = "--" + key.name.replace("_", "-")
        if key.annotation == "bool":
            g.add_argument(flag, dest=f"plan_{key.name}", nargs="?", const="true", metavar=key.metavar, help=key.doc)
        else:
            g.add_argument(flag, dest=f"plan_{key.name}", metavar=key.metavar, help=key.doc)


def plan_from_args(args: argparse.Namespace) -> Plan:
    plan = Plan.load(args.plan) if args.plan else Plan()
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


def batch_and_seq(args: argparse.Namespace) -> tuple[int | None, int | None]:
    bs = parse_positive_int(args.batch_size, "--batch-size", MAX_SIZE) if args.batch_size is not None else None
    seq = parse_positive_int(args.seq_len, "--seq-len", MAX_SIZE) if args.seq_len is not None else None
    return bs, seq


def sized_workload(args: argparse.Namespace) -> tuple[object, int | None, int | None]:
    """(workload, batch size, sequence length) from the arguments. With ``--resolution`` the workload
    is built here at that resolution (a Workload, sized: the sequence length is then in it), so that
    estimate, profile, plan and train all take it the same way; otherwise it is the name as given."""
    bs, seq = batch_and_seq(args)
    if getattr(args, "resolution", None) is None:
        return args.workload, bs, seq
    from memfit.workloads import load_workload
    res = parse_positive_int(args.resolution, "--resolution", MAX_SIZE)
    return load_workload(args.workload, seq_len=seq, resolution=res), bs, None


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
