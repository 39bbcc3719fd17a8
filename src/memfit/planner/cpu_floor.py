"""Floors under a GPU-preset plan's estimated step time: the CPU's time to issue its ops, and the host's
time to update offloaded optimizer states."""

from __future__ import annotations

import functools
from collections.abc import Iterable

UPDATE = ("optimizer", "optimizer_in_backward")
"""Techniques whose extra CPU work is in the update (and offloaded optimizer states)."""
SAVED = ("checkpointing",)
"""Techniques that change the tensors saved for backward (and offloaded activations): checkpointed
blocks leave fewer to offload, so their extras overlap too."""


FLOOR_SHARE = 0.95
"""The share of the summed parts taken as the floor: each part is measured, their sum only
approximates a combination's CPU work (the extras scaled between precisions by the step's ratio)."""


def overlap_group(key: tuple[str, object]) -> str:
    """The values whose extras may share work: of each group, only the largest counts."""
    name, value = key
    if name == "offload":
        return "saved" if any(str(v).startswith("activations") for v in value) else "update"
    if name in UPDATE:
        return "update"
    return "saved" if name in SAVED else name


# NOTE [ The CPU's floor under an estimate ]
# An unmeasured plan's time is estimated as a measured part's time times the ratio each added value
# had alone (memfit.planner.time_model). A ratio is of the whole step, which a small model's base
# spends mostly waiting on the GPU, so a value that adds launches is cheap alone; a plan that also
# splits the batch issues its forward and backward once per micro-batch, the CPU then sets the pace,
# and the ratios' product errs low. So an estimate is at least the CPU's floor, what the plan's ops
# cost the CPU, from parts measured alone (the same per-op CPU costs as the time model's:
# memfit.planner.timing):
#
# - the step of the plan's precision alone, its forward and backward once more per extra micro-batch;
# - each added value's extra CPU seconds alone, once per micro-batch (recomputed blocks, loss chunks
#   and offloaded activations run in every micro-batch's forward and backward), scaled to the
#   precision's step where it was measured against another (fewer cast ops in a bf16-pure forward
#   leave fewer to recompute);
# - of values that may share their work, only the largest extra: on the optimizer's side (the
#   optimizer, its step in backward, offloaded states; counted once: the update runs once), where a
#   per-parameter update in backward runs the per-parameter updates a low-bit optimizer runs anyway;
#   and of checkpointing and offloaded activations (checkpointed blocks leave fewer tensors to offload).
#
# The sum approximates the combination's CPU work, so ``FLOOR_SHARE`` of it is the floor. A value
# that saves CPU time alone (fewer ops) lowers the floor by its saving in every micro-batch: a floor
# must not err high. Compiled plans have no floor (a compiled region issues fused kernels), nor do
# plans that step the optimizer on the host (its worker thread's clock is not the issuing CPU's), nor
# sharded ones. Measured: docs/planner-notes.md.
def cpu_floor(ref_cpu: float, ref_forward_backward: float, micro_batches: int,
              extras: Iterable[tuple[tuple[str, object], float, float]]) -> float:
    """Seconds the CPU at least spends issuing a plan's step (NOTE [ The CPU's floor under an
    estimate ]).

    ``ref_cpu``: the CPU seconds of the plan's precision alone at the whole batch, of which
    ``ref_forward_backward`` issue its forward and backward; ``micro_batches``: how many the plan
    splits the batch into; ``extras``: (key, extra CPU seconds of that value alone, CPU seconds of
    the step it was measured against) for each other value of the plan.
    """
    largest: dict[str, float] = {}
    saved = 0.0
    for key, extra, against in extras:
        if against <= 0:
            continue
        scaled = extra * min(1.0, ref_cpu / against)
        if scaled < 0:  # (it saves CPU time: all of it, in every micro-batch, keeps the floor low)
            saved += micro_batches * scaled
            continue
        group = overlap_group(key)
        largest[group] = max(largest.get(group, 0.0), scaled)
    update = largest.pop("update", 0.0)
    work = ref_cpu + (micro_batches - 1) * ref_forward_backward + micro_batches * sum(largest.values()) + update
    return max(0.0, FLOOR_SHARE * (work + saved))


# NOTE [ The host's update under an estimate ]
# A plan that steps its offloaded optimizer states on the host (memfit.techniques.offload_optimizer) runs
# every trained parameter's update on a worker thread, and its step waits for that thread (NOTE [ Host
# optimizer ] in memfit.planner.timing): a step lasts at least the worker's busy seconds. Those depend on
# the optimizer and the parameters, not on when the update runs or what the forward keeps: Qwen2.5-7B's
# full fine-tune on the rtx4090 preset priced 8.435 s of worker for bitsandbytes' 8-bit AdamW stepped on
# the host (1.034 s for torch's AdamW) in every plan measured, with and without its step in backward,
# micro-batches of 1, blocks, selective or every-2 checkpointing, 8 loss chunks. Estimates from the ratios
# alone knew nothing of it (8-bit AdamW is fast on the device, state offload alone cheap), so the walk
# measured six such plans, each estimated near 2.1 s and each priced over 9.2 s. So once a plan updating
# on the host is measured, FLOOR_SHARE of its worker's seconds is a floor under the estimate of every plan
# whose update is the same (``update_signature``: its fields but UPDATE_FREE, of its offload only the
# optimizer's item). Measured: docs/planner.md.
UPDATE_FREE = ("micro_batch_size", "grad_accum_steps", "checkpointing", "loss_chunks", "optimizer_in_backward",
               "attention", "allocator")
"""Plan fields that leave the host's update of the offloaded states as it is (with offloaded activations)."""


@functools.lru_cache(maxsize=4096)
def update_signature(plan) -> tuple:
    """What decides a plan's update on the host (NOTE [ The host's update under an estimate ])."""
    values = {k: v for k, v in plan.to_dict().items() if k not in UPDATE_FREE}
    values["offload"] = sorted(str(x) for x in plan.offload if str(x).startswith("optimizer"))
    return tuple(sorted((k, repr(v)) for k, v in values.items()))


def updates_on_host(plan) -> bool:
    """The plan updates its offloaded optimizer states on the host (not ``optimizer_states:step=device``, whose
    update runs on the device: no worker thread)."""
    return plan.config("offload").states == "optimizer_states"
