"""The least a plan holds on one GPU before anything runs: its weights, where and as the plan keeps them.

NOTE [ Plans whose weights alone exceed the budget ]
A plan is measured by traces: a shallow pair (2-4 s each for a 7B model here), or a full-depth trace where the
pair cannot stand for it. Some candidates cannot fit whatever their activations: gpt-oss-20b's LoRA under bf16
autocast keeps its 20.9 B frozen weights in fp32 (78 GiB), and with 16 of its 24 blocks swapped still 35 GiB, on a
24 GB card; its search traced such plans before their traces said "too big" (a LoRA under autocast: 45 GiB).
So each candidate is weighed first, on the meta model the search already holds: the
weights that stay on the device with its ``swap_blocks`` (memfit.techniques.swap_blocks.resident_weight_bytes:
the linear weights ``base_weights`` quantizes in its format, scales left out; the others in 16 bits, or in 32
where the plan's precision keeps fp32 weights and the model builds them so), plus the card's CUDA context. That is
at most what the step holds at its peak (adapters, gradients, states and activations come on top), so a plan
over the budget by it cannot fit and is not traced; the report counts them. Where every candidate is over, none
is left out: the search's own answer (the smallest plan and what it needs) stands. On one rank only (a sharded
rank holds a share of the weights), and on GPU presets (on a CPU device swapped blocks stay in the same memory).
The time model's own traces (memfit.planner.baseline: a value's time measured on the workload's plain plan) are
not candidates and are still traced: gpt-oss-20b's `plan --methods` traced 97 plans before (169.9 s) and 89 after
(181.2 s, the machine's speed drifting), its full-depth ones the baseline's.
"""

from __future__ import annotations

import torch

from memfit.errors import WeightsExceedBudget
from memfit.plans import Plan
from memfit.techniques.base_weights import STORED_BYTES, least_weight_bytes
from memfit.techniques.quantized_experts import experts_left_said
from memfit.techniques.swap_blocks import least_resident_bytes, resident_weight_bytes
from memfit.units import fmt_bytes


class WeightFloor:
    """:meth:`bytes` of a plan on ``model`` (meta): NOTE [ Plans whose weights alone exceed the budget ]."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        sizes = {p.element_size() for p in model.parameters() if p.is_floating_point()}
        self.full = min(sizes, default=2)
        """The bytes of a weight in fp32 plans: the model's own (a model built in 16 bits counts 2)."""
        self._known: dict[tuple, int] = {}

    def bytes(self, plan: Plan) -> int:
        """The least ``plan`` holds of the model's weights on the device."""
        other = 2 if plan.config("precision").weights != "fp32" else self.full
        adapter = not plan.config("adapter").is_default
        key = (str(plan.base_weights or "as-is"), int(plan.swap_blocks or 0), adapter, other)
        if key not in self._known:
            self._known[key] = resident_weight_bytes(self.model, *key)
        return self._known[key]


def leave_out_heavier_than(plans: list[Plan], floor: WeightFloor, room: int, notes: list[str]) -> list[Plan]:
    """``plans`` less those whose weights alone exceed ``room`` (the budget less the CUDA context), said in
    ``notes``; none left out where every one would be (NOTE [ Plans whose weights alone exceed the budget ])."""
    kept = [p for p in plans if p.world_size > 1 or floor.bytes(p) <= room]
    if not kept or len(kept) == len(plans):
        return plans
    notes.append(f"{len(plans) - len(kept)} plans left out: their weights alone, where and as they keep them, "
                 "exceed the budget")
    return kept


def check_budget_above_weights(budget: int, facts, dev, world_size: int = 1, base_weights=None,
                                adapter=None) -> None:
    """The weights that stay on the device in every plan fit the budget: all of them in 16 bits, or
    in ``base_weights``' format (one rank's share), or, where ``swap_blocks`` can keep blocks' frozen
    weights on the host (one GPU), those outside the repeated blocks and two blocks
    (memfit.techniques.swap_blocks.least_resident_bytes)."""
    other = 2 if dev.bf16 or dev.fp16 else 4
    min_bytes = least_weight_bytes(facts.model.parameters(), facts.model, base_weights, other) // world_size
    adapted = adapter is not None and not Plan(adapter=adapter).config("adapter").is_default
    resident = least_resident_bytes(facts.model, base_weights, adapter=adapted) if world_size == 1 and dev.is_gpu else None
    if resident is not None:
        min_bytes = min(min_bytes, resident)
    if budget < min_bytes:
        share = f", 1/{world_size} of them per rank" if world_size > 1 else ""
        fmt = str(base_weights or "as-is").split(":", 1)[0]
        how = f"with {fmt} linear weights" if fmt in STORED_BYTES else "in 16 bits"
        how += experts_left_said(facts.model, base_weights, other) if fmt in STORED_BYTES else ""
        raise WeightsExceedBudget(f"budget {fmt_bytes(budget)} is below the model's own parameters "
                                  f"({fmt_bytes(min_bytes)} for {facts.n_params / 1e6:.1f}M parameters {how}{share}); "
                                  "give a budget above that, or shard the model over more ranks (--world-size)", min_bytes)
