"""What the trace book keeps of a plan (memfit.planner.traces): its figures from its own traces."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.techniques.base import GraphSize

PEAK_MARGIN = 0.02
"""How far an extrapolated allocated peak may be above the full trace's (caching-allocator rounding;
1% seen with ``blocks:every=2`` on a small model): the lower bound that prunes is that much lower."""


@dataclass
class Measured:
    """A plan's figures from its own traces (a shallow pair extrapolated, or a full trace)."""

    peak_bytes: int
    """Allocated peak."""
    used_lower: int
    """A lower bound of the allocator side of what the budget counts (allocated peak, less
    ``PEAK_MARGIN`` when it is extrapolated, + CUDA context)."""
    used_bytes: int | None = None
    """The allocator side of what the budget counts (reserved + context): full traces only (and a plan
    at a batch, NOTE [ A book for every batch ])."""
    managed_bytes: int = 0
    """CUDA managed memory (a paged optimizer's states), outside the allocator side: the budget counts
    what fits beside it (memfit.memory.budget.Budget.counted), the rest migrates each step."""
    graph: GraphSize = field(default_factory=GraphSize)
    ops: list | None = None
    """The step's ops at full depth (None: the pair's ops did not line up, see ``pair``)."""
    pair: tuple | None = None
    """Where the pair's ops did not line up: (ops at d, ops at e, d, e, full depth), for the time
    on the line through both depths."""
    shallower_only: bool = False
    """Over the budget at the shallower depth, its deeper trace skipped: no ops, and the peak and
    lower bound the shallower trace's (NOTE [ The deeper trace of a plan over the budget at the
    shallower depth ])."""
    full: bool = False
    host_bytes: int = 0
    """Peak bytes in host memory (a shallow pair's on the line through its two depths: NOTE [ Host
    bytes from a shallow pair ] in memfit.planner.traces; the shallower trace's alone: a lower bound)."""


class ShallowFailed(Exception):
    """A shallow trace failed for the model's sake: trace at full depth."""
