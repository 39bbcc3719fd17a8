"""How memfit reads a trainer's example configs: how many it reads, refuses (and why), and warns about, and which
fields (``bench.axolotl_examples``, ``bench.llamafactory_examples``). Each config is mapped as ``--from`` maps it
(the ``h100-80gb`` preset; no model is built, nothing is traced), and its "is not mapped" warnings counted."""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path

import yaml

from memfit.devices import get_device
from memfit.errors import UserError


def survey(root: Path, is_config: Callable[[object], bool], map_config: Callable) -> dict:
    """Counts over the example configs under ``root/examples`` that ``is_config`` takes."""
    out = {"configs": 0, "refused": 0, "warned": 0, "lines": 0, "fields": collections.Counter(),
           "refusals": collections.Counter()}
    for path in sorted((root / "examples").rglob("*.y*ml")):
        try:
            data = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError):
            continue
        if not is_config(data):
            continue
        out["configs"] += 1
        where = str(path.relative_to(root))
        try:
            config = map_config(data, where, get_device("h100-80gb"))
        except UserError as e:
            out["refused"] += 1
            out["refusals"][str(e).removeprefix(f"--from {where}: ").split(":")[0]] += 1
            continue
        unmapped = [w.split(": ", 1)[1] for w in config.warnings if "is not mapped" in w]
        out["warned"] += bool(unmapped)
        out["lines"] += len(unmapped)
        out["fields"].update(w.split(" is not mapped")[0].split(" ")[0] for w in unmapped)
    return out


def report(s: dict) -> None:
    read = s["configs"] - s["refused"]
    print(f"{s['configs']} example configs: {s['refused']} refused in one line, {read} read; {s['warned']} of those "
          f"with a 'not mapped' warning ({s['lines']} lines)")
    if s["refusals"]:
        print("refused for: " + ", ".join(f"{field} {n}" for field, n in s["refusals"].most_common()))
    for field, n in s["fields"].most_common(15):
        print(f"  {n:4d}  {field}")
