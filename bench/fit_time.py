"""Planning time of ``memfit fit`` (issue 53's target: ``memfit fit llama --seq-len 2048`` in <= 90 s on a
2-core machine), each run in a new Python process as a user runs it.

Prints the command's wall seconds, the planning seconds, traces, full-depth traces and plans shared between
architectures that its ``--json`` reports. ``--against DIR`` runs another checkout's ``src`` in turns with
this one (A, B, A, B...), so that a ratio is measured under the same load (this machine's speed drifts by up
to 2x within the hour), and says whether the two gave the same cells.

    .venv/bin/python -m bench.fit_time [--model llama] [--seq-len 2048] [--repeat 2] [--against /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.planning_time import _cpu_model

ROOT = Path(__file__).resolve().parent.parent


def run_fit(args: list[str], src: Path) -> tuple[float, dict]:
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memfit.cli.main", "fit", *args, "--json"], env=env,
                          capture_output=True, text=True, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"memfit fit {' '.join(args)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return wall, json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--seq-len", default="2048")
    parser.add_argument("--devices", help="GPU presets (default: every one)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--against", type=Path, help="another checkout, timed in turns with this one")
    args = parser.parse_args()
    fit_args = [args.model, "--seq-len", args.seq_len, *(["--devices", args.devices] if args.devices else [])]
    sources = {"this": ROOT / "src", **({"against": args.against / "src"} if args.against else {})}
    print(f"machine: {_cpu_model()}, {os.cpu_count()} cores; command: memfit fit {' '.join(fit_args)} --json")
    planning: dict[str, list[float]] = {k: [] for k in sources}
    cells: dict[str, list] = {}
    for i in range(args.repeat):
        for which, src in sources.items():
            wall, out = run_fit(fit_args, src)
            planning[which].append(out["seconds"])
            cells.setdefault(which, out["cells"])
            print(f"{which:7s} run {i + 1}: {out['seconds']:6.1f} s planning, {wall:6.1f} s wall, {out['traces']} traces "
                  f"({out['full_traces']} at full depth), {out['plans_shared_between_architectures']} plans shared; "
                  f"same cells as the first run of 'this': {out['cells'] == cells['this']}", flush=True)
    line = "  ".join(f"{k} median {statistics.median(v):.1f} s" for k, v in planning.items())
    if args.against:
        ratios = [a / b for a, b in zip(planning["this"], planning["against"])]
        line += f"  this/against {statistics.median(ratios):.2f}x (median of {len(ratios)} turns)"
    print(line)


if __name__ == "__main__":
    main()
