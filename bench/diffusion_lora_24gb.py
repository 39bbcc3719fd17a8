"""Will a rank-16 LoRA of a 2.6B DiT train at 1024x1024 on a 24 GB card, and how?

Lumina-Image-2.0's DiT (dit-lumina2, 2.61B parameters) at 1024 px (128x128 latents), a LoRA of
rank 16 on the attention projections (diffusers' scripts' targets), base weights in bf16
(precision bf16-pure), AdamW on the adapter. For each checkpointing choice and batch size: the
predicted peak on the rtx4090 preset (allocated and reserved, CUDA context beside), whether it fits
the card (reserved + context <= capacity), and with ``--times`` the step time the planner's time
model predicts (memfit.planner.timing.step_seconds). ``--compile`` adds compiled blocks with
activation budgets 0.5 and 0.1, and with block checkpointing (each predicted through Inductor's
CUDA path for the card, memfit.techniques.cuda_lowering). Predictions only: no GPU ran these.

    .venv/bin/python -m bench.diffusion_lora_24gb [--batches 1,2,4] [--compile] [--times]
"""

from __future__ import annotations

import argparse
import time
import warnings

warnings.simplefilter("ignore")

from memfit.devices import get_device  # noqa: E402
from memfit.memory.estimate import estimate  # noqa: E402
from memfit.plans import Plan  # noqa: E402

DEVICE = "rtx4090"
BASE = dict(adapter="lora:r=16", precision="bf16-pure")
SETTINGS = {
    "no checkpointing": {},
    "blocks checkpointed": {"checkpointing": "blocks"},
}
COMPILED = {
    "compiled blocks, blocks checkpointed": {"compile": "blocks", "checkpointing": "blocks"},
    "compiled blocks, activation budget 0.5": {"compile": "blocks", "checkpointing": "budget:0.5"},
    "compiled blocks, activation budget 0.1": {"compile": "blocks", "checkpointing": "budget:0.1"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--compile", action="store_true", help="also the compiled rows (traced through Inductor: slow)")
    ap.add_argument("--times", action="store_true", help="also the predicted step time (one more trace a row)")
    ap.add_argument("--plans", default=None, help="only the plans whose label contains one of these (comma-separated)")
    opts = ap.parse_args()
    dev = get_device(DEVICE)
    settings = {**SETTINGS, **(COMPILED if opts.compile else {})}
    if opts.plans:
        settings = {k: v for k, v in settings.items() if any(p in k for p in opts.plans.split(","))}
    print(f"device {DEVICE}: {dev.total_bytes / 2**30:.2f} GiB")
    print("| plan | batch | allocated | reserved + context | fits | step (predicted) | trace s |")
    print("|---|---|---|---|---|---|---|")
    for label, keys in settings.items():
        for bs in (int(b) for b in opts.batches.split(",")):
            t0 = time.perf_counter()
            plan = Plan(**BASE, **keys)
            r = estimate("dit-lumina2", plan, batch_size=bs, device=DEVICE, resolution=1024)
            used = (r.reserved_bytes or r.peak_bytes) + (r.cuda_context_bytes or 0)
            step = f"{_step_seconds(plan, bs) * 1e3:.0f} ms" if opts.times else "-"
            print(f"| {label} | {bs} | {r.peak_bytes / 2**30:.2f} GiB | {used / 2**30:.2f} GiB | "
                  f"{'yes' if used <= dev.total_bytes else 'no'} | {step} | {time.perf_counter() - t0:.0f} |", flush=True)


def _step_seconds(plan: Plan, batch_size: int) -> float:
    from memfit.planner.timing import step_seconds
    from memfit.target import Target
    target = Target.resolve("dit-lumina2", plan, batch_size, DEVICE, resolution=1024)
    return step_seconds(target).seconds


if __name__ == "__main__":
    main()
