"""A full fine-tune of a 7-8B model with AdamW-class updates on a 24 GB card, found by the planner
(issue: 7B full fine-tune on 24 GB).

Runs ``memfit plan`` for Llama-2-7B and Llama-3-8B (batch 1 x 2048 tokens on the ``rtx4090`` preset;
no weights: the models are built from config on fake tensors) with the default optimizer search
(the AdamW class: AdamW, bitsandbytes' 8-bit AdamW, torchao's 8-bit, 4-bit and fp8 AdamW), each in a
fresh process as a user runs it, for two cards: the 4090's own budget (24 GB) and a 16 GB card
(``--budget 14GiB`` on the same preset: a 16 GB card's capacity after the CUDA context, less the
planner's default 10% margin; memfit has no 16 GB bf16 preset). Prints the chosen plan (or the
answer that nothing fits), its predicted device memory and step time, the planning time (wall
seconds of the whole command, Python start included), and the chosen plan's memory by category
(``memfit estimate --plan`` of the plan the planner wrote)::

    .venv/bin/python -m bench.llama7b_24gb            # add --only llama2 / --cards 24GB to run fewer

Each command runs twice: **cold**, with an empty Inductor cache folder (``TORCHINDUCTOR_CACHE_DIR``,
as on a machine that never ran memfit or torch.compile: torchao's compiled update is generated
anew, and Inductor probes the C++ compiler), then **warm**, the same command again with that folder
(NOTE [ Predicted wrappers in Inductor's caches ] in memfit.techniques.fake_wrapper).

Planning times depend on this machine's load: run it on an idle machine. The memory figures are
predictions for the preset, not measurements; a GPU run is what proves them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMFIT = [sys.executable, "-m", "memfit.cli.main"]
MODELS = {
    "llama2": "llama",
    "llama3": "llama:vocab_size=128256,intermediate_size=14336,num_key_value_heads=8",
}
CARDS = {"24GB": [], "16GB": ["--budget", "14GiB"]}


SIZE = ["-b", "1", "--seq-len", "2048", "--device", "rtx4090"]
GiB = 2**30


def run(spec: str, extra: list[str], plan_file: Path, cache: Path) -> dict:
    argv = [*MEMFIT, "plan", spec, *SIZE, *extra, "--out", str(plan_file)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env)
    seconds = time.perf_counter() - start
    text = out.stdout + out.stderr
    chosen = re.search(r"^chosen: (.*) · predicted ([\d.]+ GiB) · ([\d.]+) ms/step", text, re.M)
    header = re.search(r"(\d+) candidate plans, (\d+) traced", text)
    answer = next((line for line in text.splitlines() if "nothing fits" in line.lower()), text.strip()[-300:])
    return {"seconds": seconds, "rc": out.returncode, "plan": chosen.group(1) if chosen else answer,
            "memory": chosen.group(2) if chosen else "-", "ms": chosen.group(3) if chosen else "-",
            "traced": header.group(2) if header else "-", "command": " ".join(argv[3:-2])}


def by_category(spec: str, plan_file: Path) -> str:
    """The chosen plan's predicted memory by category, one line."""
    out = subprocess.run([*MEMFIT, "estimate", spec, *SIZE, "--plan", str(plan_file), "--json"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    r = json.loads(out.stdout)
    parts = [f"{k} {v / GiB:.2f}" for k, v in r["breakdown"].items() if v >= GiB / 100]
    return (", ".join(parts) + f"; peak allocated {r['peak_bytes'] / GiB:.2f}, reserved "
            f"{r['reserved_bytes'] / GiB:.2f}, host {r['host_peak_bytes'] / GiB:.2f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(MODELS))
    ap.add_argument("--cards", default=",".join(CARDS), help="which cards, comma-separated (24GB,16GB)")
    args = ap.parse_args()
    for name, spec in MODELS.items():
        if args.only and name != args.only:
            continue
        for card, extra in CARDS.items():
            if card not in args.cards.split(","):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                plan_file, cache = Path(tmp) / "plan.yaml", Path(tmp) / "inductor"
                r = run(spec, extra, plan_file, cache)
                warm = run(spec, extra, plan_file, cache)
                same = "" if (warm["plan"], warm["memory"]) == (r["plan"], r["memory"]) else "  (warm: another answer!)"
                print(f"{name:7} {card:5} {r['memory']:>10} {r['ms']:>8} ms/step  {r['traced']:>4} traced  "
                      f"{r['seconds']:6.1f} s cold, {warm['seconds']:6.1f} s warm  {r['plan']}{same}")
                print(f"        memfit {r['command']}")
                if plan_file.is_file():
                    print(f"        by category (GiB): {by_category(spec, plan_file)}", flush=True)


if __name__ == "__main__":
    main()
