"""Export a plan to Hugging Face TrainingArguments or Lightning Trainer arguments.

Each technique maps itself (``Config.export``): what maps is returned as keyword arguments; what
has no equivalent there is listed, so nothing is silently dropped (memfit's TrainStep applies all
of it).
"""

from __future__ import annotations

from memfit.plans import Plan
from memfit.techniques.base import Export


def export(plan: Plan, batch_size: int) -> Export:
    into = Export(batch_size)
    for config in plan.techniques:
        config.export(into)
    return into


def to_hf(plan: Plan, batch_size: int) -> tuple[dict, list[str]]:
    into = export(plan, batch_size)
    return into.hf, into.hf_unmapped


def to_lightning(plan: Plan, batch_size: int) -> tuple[dict, list[str]]:
    into = export(plan, batch_size)
    return into.lightning, into.lightning_unmapped
