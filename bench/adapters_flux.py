"""FLUX.1-dev's LoKr as each trainer runs it, on a 24 GB card: ai-toolkit's, PEFT's and SimpleTuner's (LyCORIS).

Each row runs ``memfit estimate --json`` as a user would, in a process of its own, at full size (1024 px, batch 1):

- ai-toolkit's FLUX.1 example for 24 GB (``tests/data/ai_toolkit/train_lora_flux_24gb.yaml``) with its network
  replaced by ai-toolkit's LoKr recipe (``type: lokr, lokr_full_rank: true, lokr_factor: 8``): fp8 base weights,
  blocks checkpointed, AdamW 8-bit, an EMA of the adapter; read by ``--from`` as ``lokr:...,factored=1``;
- the same config with PEFT's LoKr layer in its place (``--adapter lokr:r=full,targets=in-blocks,factor=8``);
- the same config with its own LoRA (r=16), for comparison;
- SimpleTuner's LoKr preset through LyCORIS over the bf16 model (``lycoris:algo=lokr,dim=10000,factor=16,
  modules=Attention+FeedForward``, ``bf16-base``, blocks checkpointed).

Printed: allocated, reserved, and on the device (reserved plus the CUDA context) for the ``rtx4090`` preset, and
whether it fits. Predictions only: no GPU ran these (docs/fine-tuning.md, LoKr).

    .venv/bin/python -m bench.adapters_flux [--only ai-toolkit,peft,lora,lycoris]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.planning_time import _cpu_model

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "tests" / "data" / "ai_toolkit" / "train_lora_flux_24gb.yaml"
DEVICE = "rtx4090"


def _lokr_config(folder: Path) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["config"]["process"][0]["network"] = {"type": "lokr", "lokr_full_rank": True, "lokr_factor": 8}
    path = folder / "train_lokr_flux_24gb.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _rows(config: Path) -> dict[str, list[str]]:
    return {
        "ai-toolkit": ["--from", str(config)],
        "peft": ["--from", str(config), "--adapter", "lokr:r=full,targets=in-blocks,factor=8"],
        "lora": ["--from", str(EXAMPLE)],
        "lycoris": ["dit-flux", "--adapter", "lycoris:algo=lokr,dim=10000,factor=16,modules=Attention+FeedForward",
                    "--precision", "bf16-base", "--checkpointing", "blocks", "--resolution", "1024", "-b", "1"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated rows (ai-toolkit, peft, lora, lycoris)")
    only = set(filter(None, parser.parse_args().only.split(",")))
    print(f"machine: {_cpu_model()}; preset {DEVICE}; predictions, no GPU")
    with tempfile.TemporaryDirectory() as folder:
        for name, args in _rows(_lokr_config(Path(folder))).items():
            if only and name not in only:
                continue
            argv = [sys.executable, "-m", "memfit.cli.main", "estimate", *args, "--device", DEVICE, "--json"]
            t0 = time.perf_counter()
            out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
            if out.returncode:
                print(f"{name:11s} rc {out.returncode}: {out.stderr.strip().splitlines()[-1]}")
                continue
            r = json.loads(out.stdout)
            device = r["reserved_bytes"] + r["cuda_context_bytes"]
            adapter = next((f for f in r["facts"] if f.startswith("adapter:")), "")
            print(f"{name:11s} allocated {r['peak_bytes'] / 2**30:6.2f} GiB  reserved {r['reserved_bytes'] / 2**30:6.2f} "
                  f"GiB  on the device {device / 2**30:6.2f} GiB ({'fits' if r['fits'] else 'does not fit'})  "
                  f"{time.perf_counter() - t0:5.0f} s  {r['plan']['adapter']}  {adapter.split(';')[-1].strip()}")


if __name__ == "__main__":
    main()
