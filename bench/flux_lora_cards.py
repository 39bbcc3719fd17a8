"""A rank-16 Flux LoRA on 8, 12, 16 and 24 GB cards: the plan memfit chooses, the largest batch.

FLUX.1-dev (dit-flux, 11.9B; ``--model dit-qwenimage`` or ``dit-flux2`` for Qwen-Image's 20.4B or
FLUX.2-dev's 32.2B, the same way) at 512 and 1024 px, a LoRA of rank 16 on its attention and
feed-forward layers, base weights in fp8 (kohya's ``--fp8_base``: ``--base-weights fp8``), bf16
weights (``--precision bf16-pure``), latents and text states cached. For each card: the plan
``memfit plan`` chooses at batch 1 (it searches ``swap_blocks``, checkpointing, offload, the
optimizer...) with its predicted seconds per step; and the largest batch that fits under the most
frugal plan (every block swapped, blocks checkpointed, optimizer states and activations on the
host), found from two traces (memory is affine in the batch) and confirmed by tracing N (fits) and
N + 1 (does not), with its predicted seconds per step. Cards: the rtx4090 preset (24 GB), and its
kernels and link under a budget of 8, 12 and 16 GiB for the smaller cards. Predictions only: no GPU
ran these.

    .venv/bin/python -m bench.flux_lora_cards [--model dit-flux] [--resolutions 512,1024] [--budgets 8,12,16,24]
        [--no-plan]
"""

from __future__ import annotations

import argparse
import time
import warnings

warnings.simplefilter("ignore")

import torch  # noqa: E402

from memfit.devices import get_device  # noqa: E402
from memfit.hosts import get_host  # noqa: E402
from memfit.memory.budget import Budget  # noqa: E402
from memfit.planner.roofline import for_host  # noqa: E402
from memfit.planner.search import plan  # noqa: E402
from memfit.planner.timing import trace_step  # noqa: E402
from memfit.plans import Plan  # noqa: E402
from memfit.target import Target  # noqa: E402
from memfit.techniques.checkpointing import find_blocks  # noqa: E402
from memfit.workloads import load_workload  # noqa: E402

DEVICE = "rtx4090"
FIXED = {"adapter": "lora:r=16", "base_weights": "fp8", "precision": "bf16-pure"}


def frugal(model: str) -> Plan:
    """Every block swapped, blocks checkpointed, optimizer states and activations on the host."""
    with torch.device("meta"):
        blocks = sum(len(children) for _, children in find_blocks(load_workload(model).model()))
    return Plan(**FIXED, swap_blocks=blocks, checkpointing="blocks", offload=("activations", "optimizer_states"))


def _budget(gib: int) -> str | None:
    return None if gib == 24 else f"{gib}GiB"  # (24: the rtx4090 preset's own capacity)


class Batches:
    """The frugal plan's trace at each batch size, traced once."""

    def __init__(self, model: str, resolution: int):
        self.model, self.resolution, self.seen = model, resolution, {}
        self.frugal = frugal(model)
        self.k = for_host(get_host(None))

    def at(self, batch: int):
        if batch not in self.seen:
            target = Target.resolve(self.model, self.frugal, batch, DEVICE, resolution=self.resolution)
            report, step, _ = trace_step(target, self.k)
            self.seen[batch] = (report, step.seconds)
        return self.seen[batch]

    def largest(self, budget: Budget) -> int:
        """N with N fitting and N + 1 not, from the line through batches 1 and 2, then confirmed."""
        used = {b: budget.used_bytes(self.at(b)[0]) for b in (1, 2)}
        if used[1] > budget.bytes:
            return 0
        slope = max(1, used[2] - used[1])
        n = max(1, int((budget.bytes - used[1]) // slope) + 1)
        while n > 1 and not budget.fits(self.at(n)[0]):
            n -= 1
        while budget.fits(self.at(n + 1)[0]):
            n += 1
        return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dit-flux", help="dit-flux, dit-qwenimage or dit-flux2")
    ap.add_argument("--resolutions", default="512,1024")
    ap.add_argument("--budgets", default="8,12,16,24", help="GiB; 24 is the rtx4090 preset itself")
    ap.add_argument("--no-plan", action="store_true", help="only the largest batch (no planner search)")
    opts = ap.parse_args()
    dev = get_device(DEVICE)
    print(f"{opts.model} on device {DEVICE}: {dev.total_bytes / 2**30:.2f} GiB; fixed: {FIXED}; frugal: "
          f"{frugal(opts.model).short()}", flush=True)
    print("| px | card | chosen plan (batch 1) | needs | s/step | largest batch (frugal plan) | s/step at it | "
          "plan s |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for res in (int(r) for r in opts.resolutions.split(",")):
        batches = Batches(opts.model, res)
        for gib in (int(g) for g in opts.budgets.split(",")):
            budget = Budget.resolve(_budget(gib), dev)
            n = batches.largest(budget)
            at_n = f"{batches.at(n)[1]:.2f}" if n else "-"
            chosen, needs, secs, t0 = "-", "-", "-", time.perf_counter()
            if not opts.no_plan:
                result = plan(load_workload(opts.model, resolution=res), budget=_budget(gib), device=DEVICE,
                              batch_size=1, fixed=FIXED)
                c = result.chosen
                if c is not None:
                    chosen = c.plan.short(1)
                    needs = f"{c.used_bytes / 2**30:.2f} GiB"
                    secs = f"{c.seconds:.2f}"
                else:
                    chosen = "nothing fits"
            print(f"| {res} | {gib} GB | {chosen} | {needs} | {secs} | {n} | {at_n} | "
                  f"{time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
