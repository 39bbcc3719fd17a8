"""How memfit reads axolotl's example configs: how many it reads, refuses, and warns about, and which fields.

Usage: ``python -m bench.axolotl_examples PATH`` with PATH a checkout of axolotl (its ``examples/``): each
YAML with a ``base_model`` is mapped as ``--from`` maps it (memfit.integrations.axolotl.map_config, the
``h100-80gb`` preset; no model is built, nothing is traced), and the "is not mapped" warnings counted
(bench.config_examples).
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.config_examples import report, survey
from memfit.integrations.axolotl import map_config


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not (Path(argv[0]) / "examples").is_dir():
        sys.exit("usage: python -m bench.axolotl_examples PATH (a checkout of axolotl, with its examples/)")
    report(survey(Path(argv[0]), lambda data: isinstance(data, dict) and "base_model" in data, map_config))


if __name__ == "__main__":
    main(sys.argv[1:])
