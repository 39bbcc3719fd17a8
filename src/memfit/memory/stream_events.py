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


# NOTE [ Two kinds of block, as two containers ]
# ``swap_blocks: N`` of a stack's L blocks keeps the first L - N resident and streams the last N: two
# kinds of block in one container, which make other allocations (a swapped block's weights are copied in
# and out; the first resident block fetches the first swapped one's). The shallow pair keeps the full
# model's share (NOTE [ A shallow pair of a plan that swaps the last N blocks ] in memfit.planner.shallow),
# so the deeper trace inserts resident blocks after the resident ones and swapped blocks after the
# swapped ones: two stretches in each run, of one kind each. Copied at full depth, a resident stretch
# moves the resident blocks' events, and not the swapped ones', which stay the last N; a swapped stretch
# moves only the swapped ones'. That is how the copies of two stacks' stretches move their own stack's
# blocks (FLUX.1's; NOTE [ Allocations at full depth ] in memfit.memory.deep_stream), so the swapped
# blocks of a container are named as a container of their own (``<container>~swapped``), counted from its
# first swapped block, and each container's blocks a copy inserts are those it grew by in the pair (2
# resident and 1 swapped a copy for 14 of Gemma-2's 42 blocks, traced at 6 and 9 blocks). Checked against
# full traces (batch 2 x 2048 or 1024 px, RTX 4090 preset, LoRA r=16, bf16-pure; blocks or selective
# checkpointing or none): Llama-2-7B with 8, 16 and 24 of 32 blocks swapped, Gemma-2-9B with 14, 21 and
# 28 of 42, FLUX.1-dev with 38 of 57 (and 19 without checkpointing): allocated peak and reserved bytes
# equal to the byte, 19 plans. No stream (the full trace decides, as before) for Llama-2-7B with 24 of 32
# swapped and no checkpointing (traced at 4 and 8 blocks: one resident block at the shallower depth, which
# fetches the first swapped block's weights and frees its own output there, where two blocks split the
# two), and FLUX.1-dev with fp8 base weights and blocks checkpointed (19 or 38 swapped), whose step frees
# some of the build's tensors at other places at the two depths.
SWAPPED = "~swapped"


def second_kind(containers: tuple[str, ...], swapped_from: dict[str, int] | None):
    """(module with ``#``, block) -> the same, with a swapped block's container and index as its own
    (NOTE [ Two kinds of block, as two containers ]); None where no container has two kinds."""
    firsts = {c: k for c, k in (swapped_from or {}).items() if k > 0}
    if not firsts:
        return None

    def renamed(module: str, block: int) -> tuple[str, int]:
        path = module.split("#")[0].rstrip(".")
        # (the tracker may name a container by a tail of its path: the longest match)
        owners = [c for c in containers if c == path or c.endswith("." + path) or path.endswith("." + c)]
        own = max(owners, key=len) if owners else None
        first = firsts.get(own)
        if first is None or block < first:
            return module, block
        head, tail = module.split("#", 1)
        return head.rstrip(".") + SWAPPED + ".#" + tail, block - first
    return renamed
