"""Arguments shared by estimate, profile (and later plan, train): workload, batch, plan, device."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
from functools import cache

from memfit.errors import UserError
from memfit.plans import Plan
from memfit.units import MAX_SIZE, parse_positive_int


@cache
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal under each dataclass field), for CLI help."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="built-in name (gpt2, llama:num_hidden_layers=2, cnn, ...; see `memfit workloads`) "
                                    "or path/to/file.py:NAME")
    p.add_argument("--batch-size", "-b", metavar="N", help="global batch size (default: the workload's)")
    p.add_argument("--seq-len", metavar="T", help="sequence length for built-in language models")
    p.add_argument("--device", "-d", default="cpu", help="cpu (this machine) or a GPU preset (see `memfit devices`)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan", "a plan file, and flags that override its fields")
    g.add_argument("--plan", metavar="FILE", help="plan file (.yaml or .json)")
    docs = field_docs(Plan)
    for f in dataclasses.fields(Plan):
        flag = "--" + f.name.replace("_", "-")
        help_text = docs.get(f.name, "")
        if f.type in ("bool", bool):
            g.add_argument(flag, dest=f"plan_{f.name}", nargs="?", const="true", metavar="BOOL", help=help_text)
        else:
            g.add_argument(flag, dest=f"plan_{f.name}", metavar=f.name.upper().split("_")[0], help=help_text)


def plan_from_args(args: argparse.Namespace) -> Plan:
    import yaml
    plan = Plan.load(args.plan) if args.plan else Plan()
    changes = {}
    for f in dataclasses.fields(Plan):
        value = getattr(args, f"plan_{f.name}", None)
        if value is None:
            continue
        if f.name == "offload":
            changes[f.name] = [v for v in value.split(",") if v]
        elif f.name == "ema":
            if value in ("null", "none", ""):
                changes[f.name] = None
            elif "=" in value:  # --ema decay=0.999,device=cpu,every=1
                from memfit.workloads import parse_overrides
                changes[f.name] = parse_overrides(value, "--ema")
            else:  # --ema '{decay: 0.999, device: cpu}'
                try:
                    changes[f.name] = yaml.safe_load(value)
                except yaml.YAMLError as e:
                    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                    raise UserError(f"--ema {value!r} is not a valid mapping ({problem}); write e.g. "
                                    "--ema decay=0.999,device=cpu or --ema '{decay: 0.999, device: cpu}'") from None
        elif f.name in ("micro_batch_size", "grad_accum_steps", "loss_chunks"):
            if f.name == "micro_batch_size" and value in ("null", "none"):
                changes[f.name] = None
            else:
                try:
                    changes[f.name] = int(value)
                except ValueError:
                    raise UserError(f"--{f.name.replace('_', '-')} {value!r} is not a whole number") from None
        elif f.name == "optimizer_in_backward":
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise UserError(f"--optimizer-in-backward {value!r}: give true or false")
            changes[f.name] = value.lower() in ("true", "1", "yes")
        else:
            changes[f.name] = value
    return plan.replace(**changes) if changes else plan


def batch_and_seq(args: argparse.Namespace) -> tuple[int | None, int | None]:
    bs = parse_positive_int(args.batch_size, "--batch-size", MAX_SIZE) if args.batch_size is not None else None
    seq = parse_positive_int(args.seq_len, "--seq-len", MAX_SIZE) if args.seq_len is not None else None
    return bs, seq


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
