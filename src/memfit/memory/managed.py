"""CUDA managed memory: what a paged optimizer's states need of the card, and cost when it is short.

A paged optimizer (memfit.techniques.optimizers_paged) keeps its large states in CUDA unified memory
(``cudaMallocManaged``). The driver, not PyTorch's caching allocator, holds it: it is in neither
``torch.cuda.max_memory_allocated()`` nor ``torch.cuda.max_memory_reserved()``, and
``set_per_process_memory_fraction`` does not cap it. While the card has room it is device memory
like any other, and :class:`memfit.memory.budget.Budget` counts it against the card up to the room
the allocator's segments and the context leave. When the card is short, the driver moves pages
between host and device memory each step, and the step waits for the host link: :func:`migration`
says how many bytes and how long (the planner adds that time to the step).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.units import fmt_bytes

NOT_IN_RESERVED = ("managed (unified) memory is allocated by the CUDA driver, not PyTorch's caching allocator: it "
                   "is not in torch.cuda.max_memory_reserved() (nor max_memory_allocated()), and "
                   "set_per_process_memory_fraction does not cap it; memfit counts it against the card up to the room the "
                   "allocator leaves, and the rest as pages that migrate each step")


@dataclass(frozen=True)
class Migration:
    """The pages of managed memory that move over the host link in each step."""

    short_bytes: int
    """What the card lacks for the managed bytes beside the allocator's and the context (0: nothing moves)."""
    in_bytes: int
    """Host to device, each step."""
    out_bytes: int
    """Device to host (the states are written by the update: every evicted page is written back)."""
    seconds: float
    """Their time over the host link, in and out one after the other."""
    least_bytes: int
    """Each way, under the best eviction the driver could make (the pages needed last): the lower bound."""


# NOTE [ Pages that migrate ]
# The caching allocator keeps its segments from one step to the next, so after the first step the
# room managed memory has on the card is ``capacity - reserved - context``. Each step the paged
# optimizer updates every state tensor in the same order, prefetching it to the device first
# (bitsandbytes' ``prefetch_state``); the driver makes room by evicting the least recently used 2 MiB
# chunks. A cyclic sweep over M bytes with a room of R < M bytes then never hits under LRU: a page was
# last used M - 1 pages ago, and only R fit. So every managed byte moves in once a step, and is
# written back out once (the update dirties it): M each way, the prediction. An eviction that kept
# the pages needed soonest would move only M - R each way (``least_bytes``). The driver migrates
# faulted pages and writes back evicted ones on the same copy path, so the two directions are added,
# at the device's host link bandwidth: an estimate of the link's share, not measured on a GPU yet.
def paged_out_bytes(managed_bytes: int, room_bytes: int) -> int:
    """The managed bytes the card has no room for (``room_bytes``: what the allocator's segments and
    the context leave): they live on the host, and migrate each step."""
    return max(0, managed_bytes - max(0, room_bytes))


def migration(managed_bytes: int, room_bytes: int, link_bandwidth: float) -> Migration:
    """The managed bytes that migrate each step (NOTE [ Pages that migrate ]): ``managed_bytes`` of
    states swept each step, ``room_bytes`` of the card left to them (capacity - reserved - context),
    ``link_bandwidth`` the host link's bytes per second."""
    short = paged_out_bytes(managed_bytes, room_bytes)
    if not short:
        return Migration(0, 0, 0, 0.0, 0)
    moved = managed_bytes
    seconds = 2 * moved / link_bandwidth if link_bandwidth > 0 else float("inf")
    return Migration(short, moved, moved, seconds, short)


def step_migration(reserved_bytes: int, context_bytes: int, managed_bytes: int, device) -> Migration:
    """:func:`migration` on ``device`` (a memfit Device) for a step holding these bytes at its peak."""
    return migration(managed_bytes, device.total_bytes - reserved_bytes - context_bytes, device.host_link_bandwidth)


def managed_notes(reserved_bytes: int, context_bytes: int, managed_bytes: int, device) -> list[str]:
    """What a report says of a step's managed bytes (none: nothing)."""
    if not managed_bytes:
        return []
    notes = [f"{fmt_bytes(managed_bytes)} of optimizer states in CUDA managed memory (paged): {NOT_IN_RESERVED}"]
    m = step_migration(reserved_bytes, context_bytes, managed_bytes, device)
    if m.short_bytes:
        notes.append(f"the card is {fmt_bytes(m.short_bytes)} short for the managed states: each step about "
                     f"{fmt_bytes(m.in_bytes)} of pages migrate in and {fmt_bytes(m.out_bytes)} out over the host link, "
                     f"~{m.seconds * 1e3:.0f} ms at {device.host_link_bandwidth / 1e9:.0f} GB/s (at least "
                     f"{fmt_bytes(m.least_bytes)} each way; memfit.memory.managed)")
    return notes
