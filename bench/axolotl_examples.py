"""How memfit reads axolotl's example configs: how many it reads, refuses, and warns about, and which fields.

Usage: ``python -m bench.axolotl_examples PATH`` with PATH a checkout of axolotl (its ``examples/``): each
YAML with a ``base_model`` is mapped as ``--from`` maps it (memfit.integrations.axolotl.map_config, the
``h100-80gb`` preset; no model is built, nothing is traced), and the "is not mapped" warnings counted.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import yaml

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.axolotl import map_config


def survey(root: Path) -> dict:
    """Counts over the example configs under ``root/examples``."""
    out = {"configs": 0, "refused": 0, "warned": 0, "lines": 0, "fields": collections.Counter()}
    for path in sorted((root / "examples").rglob("*.y*ml")):
        try:
            data = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError):
            continue
        if not isinstance(data, dict) or "base_model" not in data:
            continue
        out["configs"] += 1
        try:
            config = map_config(data, str(path.relative_to(root)), get_device("h100-80gb"))
        except UserError:
            out["refused"] += 1
            continue
        unmapped = [w.split(": ", 1)[1] for w in config.warnings if "is not mapped" in w]
        out["warned"] += bool(unmapped)
        out["lines"] += len(unmapped)
        out["fields"].update(w.split(" is not mapped")[0].split(" ")[0] for w in unmapped)
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not (Path(argv[0]) / "examples").is_dir():
        sys.exit("usage: python -m bench.axolotl_examples PATH (a checkout of axolotl, with its examples/)")
    s = survey(Path(argv[0]))
    read = s["configs"] - s["refused"]
    print(f"{s['configs']} example configs: {s['refused']} refused in one line, {read} read; {s['warned']} of those "
          f"with a 'not mapped' warning ({s['lines']} lines)")
    for field, n in s["fields"].most_common(15):
        print(f"  {n:4d}  {field}")


if __name__ == "__main__":
    main(sys.argv[1:])
