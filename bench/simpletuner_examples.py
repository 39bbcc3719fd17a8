"""How memfit reads SimpleTuner's own example configs (``simpletuner/examples/*/config.json`` of a SimpleTuner
checkout): how many it reads, refuses (and why) and warns about, each mapped as ``--from`` maps it (the ``rtx4090``
preset; nothing traced), and with ``--estimate`` the examples shipped in ``tests/data/simpletuner/`` estimated on a
preset.

    git -C <SimpleTuner mirror> archive HEAD simpletuner/examples | tar -x -C /tmp/st
    .venv/bin/python -m bench.simpletuner_examples /tmp/st/simpletuner/examples
    .venv/bin/python -m bench.simpletuner_examples --estimate rtx4090    # the shipped examples, traced
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings
from pathlib import Path

from memfit.devices import get_device
from memfit.errors import UserError

SHIPPED = Path(__file__).resolve().parent.parent / "tests" / "data" / "simpletuner" / "examples"


def survey(root: Path) -> None:
    from memfit.integrations.simpletuner import read_config
    card = get_device("rtx4090")
    read, refused, warned = [], collections.Counter(), collections.Counter()
    for path in sorted(root.glob("*/config.json")):
        try:
            config = read_config(path, card)
        except UserError as e:
            refused[str(e).split(": ", 2)[1].split(" ")[0] if ": " in str(e) else str(e)] += 1
            print(f"refused  {path.parent.name}: {str(e).split(': ', 1)[-1][:150]}")
            continue
        read.append(config)
        for w in config.warnings:
            warned[w.split(": ", 2)[1].split(" ")[0] if w.count(": ") >= 2 else w[:40]] += 1
        print(f"read     {path.parent.name}: {config.workload} · batch {config.batch_size} · {config.resolution} · "
              f"{config.plan.short()}")
    total = len(read) + sum(refused.values())
    print(f"\n{total} example configs: {len(read)} read, {sum(refused.values())} refused in one line")
    print("refused for: " + ", ".join(f"{k} {n}" for k, n in refused.most_common()))
    print("warned about: " + ", ".join(f"{k} {n}" for k, n in warned.most_common()))


def estimate(preset: str) -> None:
    import memfit
    from memfit.integrations.simpletuner import read_config
    from memfit.units import fmt_bytes
    print("| example | read as | allocated | reserved | fits | trace |\n|---|---|---:|---:|---|---:|")
    for path in sorted(SHIPPED.glob("*/config.json")):
        config = read_config(path, get_device(preset))
        t0 = time.perf_counter()
        try:
            r = memfit.estimate(config.workload, config.plan, batch_size=config.batch_size, device=preset,
                                resolution=config.resolution)
        except UserError as e:  # (a hub id whose config is not in the cache here)
            print(f"| `{path.parent.name}` | `{config.workload}` | {str(e)[:120]} | | | |")
            continue
        print(f"| `{path.parent.name}` | `{config.workload}` {config.resolution} px, batch {config.batch_size}, "
              f"{config.plan.short()} | {fmt_bytes(r.peak_bytes)} | {fmt_bytes(r.reserved_bytes)} | "
              f"{'yes' if r.fits else 'no'} | {time.perf_counter() - t0:.0f} s |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("examples", nargs="?", help="a SimpleTuner checkout's simpletuner/examples folder")
    ap.add_argument("--estimate", metavar="PRESET", help="estimate the examples in tests/data/simpletuner on PRESET")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.examples:
        survey(Path(args.examples))
    if args.estimate:
        estimate(args.estimate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
