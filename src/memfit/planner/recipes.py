"""The plans ``memfit fit`` tries on every card: a few well-known recipes per method, fastest first.

``memfit plan`` searches every technique for one card; ``memfit fit`` answers for a dozen cards and
three methods at once, so it tries the recipes people run, each built from the values the planner's
own search space offers for the workload (memfit.planner.space: block checkpointing only where the
model has repeated blocks, a chunked loss only for causal language models, the host only on GPUs).
``P`` is the card's 16-bit precision: bf16 weights (``bf16-pure``) where the card has bf16, fp16
autocast where it has not.

| recipe | full fine-tuning | LoRA, QLoRA (the method's adapter and base weights) |
|---|---|---|
| fast | P | P |
| checkpointed | P, blocks checkpointed, 8-bit AdamW, loss in chunks | P, blocks checkpointed, loss in chunks |
| offloaded | P, blocks, loss in chunks, AdamW stepped on the host (in backward, but with fp16) | (the adapter's states are small) |
| paged (``host_light``: in place of offloaded, where the host's memory does not hold its states) | P, blocks, loss in chunks, bitsandbytes' paged 8-bit AdamW stepped in backward (torchtune's full fine-tuning on one card, uncompiled): the states, a quarter of offloaded's, in CUDA managed memory; what the card has no room for pages to the host and back each step | (the adapter's states are small) |
| swapped | (every weight trains: none to swap) | P, blocks checkpointed, loss in chunks, every block's frozen weights on the host (where they take more than 3/4 of the card: FLUX.1 on 8-24 GB cards) |
| sharded over N cards | P, blocks, loss in chunks, AdamW stepped in backward (but with fp16), FSDP2 | P, blocks, loss in chunks, FSDP2 |

The last single-card recipe saves the most: the largest batch a card takes under any recipe is its
largest, and the plan shown is the fastest recipe that takes that batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.devices import Device
from memfit.errors import UserError
from memfit.planner.methods import Method
from memfit.planner.space import ModelFacts, default_space
from memfit.plans import Plan

PRECISIONS = ("bf16-pure", "fp16", "bf16", "fp32")
"""The first of these the card's search space offers is the recipes' precision."""


@dataclass(frozen=True)
class Recipe:
    name: str
    plan: Plan


def recipes(method: Method, facts: ModelFacts, device: Device, budget_bytes: int | None = None, *,
            host_light: bool = False) -> list[Recipe]:
    """The single-card recipes of ``method`` for the workload on ``device``, fastest first (the module
    docstring). ``budget_bytes``: the card's budget, where the weights' share of it decides whether
    blocks are swapped (memfit.techniques.swap_blocks.search; None: never). ``host_light``: ``paged``
    in place of ``offloaded``, for a machine whose memory does not hold the offloaded states."""
    values = default_space(facts, device, 1, budget_bytes=budget_bytes, base_weights=method.keys.get("base_weights")).values
    base = {**method.keys, "precision": _precision(values)}
    frugal = _frugal(values)
    out = [Recipe("fast", Plan(**base))]
    adapter = not Plan(**method.keys).config("adapter").is_default
    checkpointed = {**frugal, **({"optimizer": "adamw8bit"} if not adapter and _offers(values, "optimizer", "adamw8bit")
                                 else {})}
    if checkpointed:
        out.append(Recipe("checkpointed", Plan(**base, **checkpointed)))
    host = _offers(values, "offload", ("optimizer_states",)) and _offers(values, "optimizer_in_backward", True)
    if not adapter and host_light and _offers(values, "optimizer", "adamw8bit-paged"):
        out.append(Recipe("paged", _first_valid({**base, **frugal, "optimizer": "adamw8bit-paged"},
                                                {"optimizer_in_backward": True})))
    elif not adapter and host:
        out.append(Recipe("offloaded", _first_valid({**base, **frugal, "offload": ["optimizer_states"]},
                                                    {"optimizer_in_backward": True})))
    swapped = max(values.get("swap_blocks") or [0])
    if adapter and swapped:
        out.append(Recipe("swapped", Plan(**base, **frugal, swap_blocks=swapped)))
    return out


def sharded(method: Method, facts: ModelFacts, device: Device, world: int) -> Recipe:
    """The recipe of ``method`` over ``world`` cards with FSDP2 (the module docstring)."""
    values = default_space(facts, device, world).values
    base = {**method.keys, "precision": _precision(values)}
    extra = {"optimizer_in_backward": True} if Plan(**method.keys).config("adapter").is_default else {}
    return Recipe(f"FSDP2 over {world}", _first_valid({**base, **_frugal(values), "world_size": world}, extra))


def _first_valid(fields: dict, extra: dict) -> Plan:
    """The plan of ``fields`` and ``extra``, or of ``fields`` alone where the two do not combine (the
    step in backward with fp16's gradient scaler, on a card without bf16)."""
    try:
        return Plan(**fields, **extra)
    except UserError:
        return Plan(**fields)


def _offers(values: dict, key: str, value) -> bool:
    """The search space tries ``value`` for plan key ``key`` with this workload and card."""
    return value in values.get(key, ())


def _precision(values: dict) -> str:
    return next((p for p in PRECISIONS if _offers(values, "precision", p)), "fp32")


def _frugal(values: dict) -> dict:
    """Block checkpointing and a chunked loss, where the space offers them."""
    out = {}
    if _offers(values, "checkpointing", "blocks"):
        out["checkpointing"] = "blocks"
    chunks = max(values.get("loss_chunks") or [0])
    if chunks:
        out["loss_chunks"] = chunks
    return out
