"""Comparing fine-tuning methods for one budget: full fine-tuning, LoRA, DoRA, QLoRA, QDoRA side by side.

NOTE [ Methods are the user's ] (memfit.techniques.adapter): the planner changes techniques freely
(the same model is trained, exactly or within a stated bound) but never the method, which decides
what is trained. ``memfit plan --methods full,lora,qlora`` asks for the comparison: each method is
planned on its own (its keys fixed, every technique searched as usual), and the table puts the
fastest fitting plan of each beside the others, with what each one trains.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.errors import UserError

DEFAULT_ADAPTER = "lora:r=16"

METHODS = {
    "full": "every parameter of the model trains (the workload as written)",
    "lora": "a low-rank adapter trains; the base weights are frozen",
    "dora": "a weight-decomposed low-rank adapter (DoRA) trains; the base weights are frozen",
    "qlora": "a low-rank adapter trains over base weights quantized to 4 bits (NF4) and frozen",
    "qdora": "a weight-decomposed low-rank adapter (DoRA) trains over base weights quantized to 4 bits (NF4) "
             "and frozen (Answer.AI's QDoRA)",
}
"""Method -> what it trains (shown beside its plan)."""

QUANTIZED = ("qlora", "qdora")
"""The methods that train over quantized base weights."""
CHECKPOINT_METHODS = ("lora",)
"""The methods of a checkpoint whose format is the card's (fine-grained FP8) on a card that keeps that format: an
adapter over the weights as the card loads them, ``as-is`` in the plan (memfit.target.as_checkpoint makes it the
format there); not DoRA, which memfit's float8 layer does not take."""
CHECKPOINT_METHODS_BY_CARD = ("full", "lora")
"""The methods of such a checkpoint asked of several cards (``fit``): full fine-tuning too, which trains the
weights a card without FP8 kernels dequantizes as it loads; each card that keeps the format says it cannot
(memfit.target.as_checkpoint: its float8 weights are frozen)."""

DIFFERENT_THINGS = ("these methods train different things: full fine-tuning updates every weight, an adapter "
                    "only its low-rank matrices (quality and what you ship differ); compare them on your "
                    "evaluation, not on memory and time alone")


@dataclass(frozen=True)
class Method:
    name: str
    keys: dict
    """The plan keys the method fixes (adapter, base_weights)."""

    @property
    def trains(self) -> str:
        return METHODS[self.name]


def parse_methods(text: str, adapter: str = "none") -> list[Method]:
    """``--methods full,lora,qlora`` -> the methods, each with its fixed keys. ``adapter``: the
    adapter the user gave (``--adapter``), used for the adapter methods' rank and targets."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise UserError(f"--methods: give some of {', '.join(METHODS)}, separated by commas")
    for name in names:
        if name not in METHODS:
            raise UserError(f"--methods: unknown method {name!r}; choose from {', '.join(METHODS)}")
    if len(set(names)) != len(names):
        raise UserError("--methods: a method is named twice; name each once (e.g. full,lora,qlora)")
    kind, colon, options = adapter.partition(":")  # (qlora's and qdora's rank and targets too: NOTE [ qlora as
    lora = f"lora{colon}{options}" if kind.removeprefix("q") in ("lora", "dora") else DEFAULT_ADAPTER  # an adapter ])
    keys = {
        "full": {"adapter": "none", "base_weights": "as-is"},
        "lora": {"adapter": lora, "base_weights": "as-is"},
        "dora": {"adapter": lora.replace("lora:", "dora:", 1), "base_weights": "as-is"},
        "qlora": {"adapter": lora, "base_weights": "nf4"},
        "qdora": {"adapter": lora.replace("lora:", "dora:", 1), "base_weights": "nf4"},
    }
    return [Method(name, keys[name]) for name in names]


def check_precision(methods: list[Method], precision: str, flag: str) -> None:
    """A precision that keeps an adapter apart (``bf16-base``) has no meaning for full fine-tuning: one line,
    before any search."""
    from memfit.plans import Plan
    if not Plan(precision=precision).config("precision").needs_adapter:
        return
    full = [m.name for m in methods if Plan(**m.keys).config("adapter").is_default]
    if full:
        raise UserError(f"{flag}: --precision {precision} keeps an adapter in fp32 over the 16-bit model, and "
                        f"{', '.join(full)} trains none; drop {', '.join(full)} from {flag}, or give a precision "
                        "every method takes (bf16-pure, bf16)")


def on_checkpoint(methods: list[Method], workload, flag: str, device=None) -> list[Method]:
    """``methods`` for ``workload``: a pre-quantized checkpoint trains only qlora or qdora, over its own
    format (its weights load in no other: memfit.target.as_checkpoint); any other workload takes them as
    given, and so does one that loads in full precision on ``device`` (a fine-grained FP8 checkpoint on a card
    without FP8 kernels: NOTE [ FP8 checkpoints by card ]). ``flag``: the option named in the error
    (``--methods``, ``fit --methods``); ``device``: the one card planned (None: several, ``fit``)."""
    from memfit.devices import get_device
    from memfit.workloads.checkpoint_formats import by_card, format_on
    fmt = workload.info.quantized
    if fmt is None or (device is not None and format_on(fmt, get_device(device)) is None):
        return methods
    allowed = (CHECKPOINT_METHODS if device is not None else CHECKPOINT_METHODS_BY_CARD) if by_card(fmt) else QUANTIZED
    if not methods or any(m.name not in allowed for m in methods):
        how = ("full fine-tuning where a card loads it in bf16, an adapter over its weights as each card loads them"
               if "full" in allowed else "an adapter over its quantized weights")
        raise UserError(f"{flag}: {workload.name} is a pre-quantized checkpoint ({fmt}); only {' or '.join(allowed)} "
                        f"trains it ({how}): use --methods {','.join(allowed)}, or plan the full-precision checkpoint")
    return [dataclasses.replace(m, keys={**m.keys, "base_weights": "as-is" if by_card(fmt) else fmt}) for m in methods]


def plan_method(**kwargs):
    """One method's search (memfit.planner.search.plan). A method whose weights alone exceed the
    budget gets a result with no plan and the bytes it needs at least, so that the other methods
    are still compared (a budget too small for full fine-tuning is the usual reason to ask)."""
    from memfit.devices import get_device
    from memfit.errors import WeightsExceedBudget
    from memfit.planner.search import PlanResult, plan, resolve_budget
    try:
        return plan(**kwargs)
    except WeightsExceedBudget as e:
        wl, dev = kwargs["workload"], get_device(kwargs["device"])
        return PlanResult(workload=getattr(wl, "name", wl), device=dev.name, batch_size=kwargs["batch_size"],
                          budget_bytes=resolve_budget(kwargs.get("budget"), dev), time_model="-",
                          chosen=None, notes=[str(e)], least_bytes=e.needs_bytes)


# NOTE [ A mixture of experts' QLoRA quantizes its experts ]
# transformers 5 holds a MoE's experts as 3-D parameters, which BitsAndBytesConfig leaves in 16 bits: QLoRA of
# Qwen3-30B-A3B that way keeps 57 GiB of bf16 experts beside 4-bit attention, and fits no single card under 80 GB.
# The QLoRA people run on these models quantizes the experts too (axolotl's quantize_moe_experts in every one of
# its MoE QLoRA examples, with bitsandbytes' own parametrization): so the qlora and qdora methods of a model with
# 3-D experts take ``nf4:experts=true`` (memfit.techniques.quantized_experts), and the plan's label says it
# (``nf4-experts``). ``--base-weights nf4`` with a single method plans transformers' own way.
def with_experts_quantized(methods: list[Method], workload) -> list[Method]:
    """``methods`` for ``workload``: a mixture of experts' qlora and qdora quantize its 3-D experts too (NOTE [ A
    mixture of experts' QLoRA quantizes its experts ]); a pre-quantized checkpoint keeps its own format."""
    if workload.info.quantized is not None or not any(m.name in QUANTIZED for m in methods):
        return methods
    from memfit.planner.space import model_facts
    from memfit.techniques.quantized_experts import experts_3d_parameters, with_experts
    if not experts_3d_parameters(model_facts(workload).model):
        return methods
    return [dataclasses.replace(m, keys={**m.keys, "base_weights": with_experts(m.keys["base_weights"])})
            if m.name in QUANTIZED else m for m in methods]
