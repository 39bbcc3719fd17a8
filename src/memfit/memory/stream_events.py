"""A device's allocations and frees, in order, as a shallow trace records them (memfit.memory.deep_stream)."""

from __future__ import annotations

from typing import NamedTuple

MARK = "mark"
SETUP = "setup"


class Stream(NamedTuple):
    """One device's allocations and frees, with the step's marks, in order.

    ``tokens[i]``: ``("+", nbytes, stream, phase, step, op, module)`` for an allocation
    (``phase``: the one it was made in; ``module``: in the forward, the one it was made in with
    its block's index as ``#``, else ""), ``("-", ...)`` with its allocation's fields for a free, or
    ``("mark", name, step)``. ``frees[i]``: the index of the allocation the free at ``i`` frees
    (-1 elsewhere). ``phases[i]``: the step phase the event happened in."""

    tokens: list
    frees: list
    phases: list
    blocks: list | None = None
    """``blocks[i]``: the repeated block an allocation was made in the forward (the index of its
    module in the block container), else -1."""
    kernels: list | None = None
    """``kernels[i]``: what sizes a reduction's staging buffer or semaphores allocated at ``i``
    (memfit.memory.cuda.reduce.Geometry), else None: :func:`widen` sizes them at another batch."""


def fields_but_op(token: tuple) -> tuple:
    """An allocation's or free's fields but its sign and the op that made the allocation (NOTE [ A chain's
    last link ] in memfit.memory.stretches)."""
    return token[1:5] + token[6:]
