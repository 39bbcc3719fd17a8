"""Named points that a step's build or run puts in the memory tracker's timeline, where one watches it.

Techniques sit below ``memfit.memory`` and do not import it: the tracker is found as the dispatch mode
that marks the timeline (memfit.memory.tracker.MemoryTracker, entered around a trace or a profile). Marks
the memory report reads: ``loaded`` (a checkpoint's weights have all arrived, before the plan prepares
the model: :func:`memfit.step.build_step`) and ``empty_cache`` (the caching allocator gave its free
segments back: memfit.techniques.sharding).
"""

from __future__ import annotations


def watching_tracker():
    """The memory tracker watching this step, if any."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return next((m for m in _get_current_dispatch_mode_stack() if hasattr(m, "mark") and hasattr(m, "state")), None)


def mark(name: str) -> None:
    """Put ``name`` in the watching tracker's timeline (nothing where none watches)."""
    tracker = watching_tracker()
    if tracker is not None:
        tracker.mark(name)
