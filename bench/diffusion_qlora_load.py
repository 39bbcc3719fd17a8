"""QLoRA of the built-in diffusers models as users load them: the step's and the load's bytes.

Each of ``dit-lumina2``, ``dit-sd3``, ``unet-sdxl`` and ``unet-sd15`` at its native resolution, batch 1,
a rank-16 LoRA on nf4 base weights, block checkpointing, ``bf16-pure`` and bf16 autocast, predicted for
the ``rtx4090`` preset: allocated, reserved (PyTorch's default segments and expandable ones) and the
load's peak and reserved bytes (memfit.techniques.loading). Predictions only: no GPU ran these.
Another checkout's figures (the code before the built-ins loaded as checkpoints, dcdd208) come from the
same script with its ``src`` first on the path:

    .venv/bin/python -m bench.diffusion_qlora_load
    PYTHONPATH=/tmp/old/src .venv/bin/python -m bench.diffusion_qlora_load
"""

from __future__ import annotations

import argparse
import time
import warnings

warnings.simplefilter("ignore")

from memfit.memory.estimate import estimate  # noqa: E402
from memfit.plans import Plan  # noqa: E402

MODELS = ("dit-lumina2", "dit-sd3", "unet-sdxl", "unet-sd15")
PRECISIONS = ("bf16-pure", "bf16")
DEVICE = "rtx4090"
GiB = 2 ** 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    opts = ap.parse_args()
    print("| model | precision | allocated | reserved | with expandable | load peak | load reserved | s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model in opts.models.split(","):
        for precision in PRECISIONS:
            t0 = time.perf_counter()
            plan = Plan(base_weights="nf4", adapter="lora:r=16", checkpointing="blocks", precision=precision)
            r = estimate(model, plan, batch_size=1, device=DEVICE)
            print(f"| {model} | {precision} | {r.peak_bytes / GiB:.2f} GiB | {r.reserved_bytes / GiB:.2f} GiB | "
                  f"{r.expandable_reserved_bytes / GiB:.2f} GiB | {r.load_peak_bytes / GiB:.2f} GiB | "
                  f"{r.load_reserved_bytes / GiB:.2f} GiB | {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
