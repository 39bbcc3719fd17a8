"""A plan's allocation stream at another batch, or on another card, from the streams traced
(memfit.memory.deep_stream): the same events, with the sizes the batch or the card gives them."""

from __future__ import annotations

import difflib
from typing import NamedTuple

from memfit.memory.cuda import reduce
from memfit.memory.cuda.model import WORKSPACE, WORKSPACE_SIZES, workspace_bytes
from memfit.memory.deep_stream import MARK, SETUP, Stream, sorted_free_runs
from memfit.memory.heap import without_collections
from memfit.techniques.cuda_facts import threads_per_sm


# NOTE [ A stream on another card ]
# Two cards whose kernels allocate alike (the same attention kernel, the same 4-bit kernels, the same
# dtypes) make the same allocations in the same order, but for what the card sizes: the cuBLAS and
# cuBLASLt workspaces (32 MiB a handle on Hopper and newer, 8 MiB before) and the reductions' staging
# buffers (by the SM count and the threads an SM runs, memfit.memory.cuda.reduce). ``on_card`` resizes those in a stream traced for
# one card, and the replay gives the other's allocated peak and reserved bytes without a trace of its own.
# Which cards allocate alike is measured, not assumed (memfit.planner.fit_books).
def card_sizes(device) -> tuple:
    """What ``on_card`` sizes a stream by: the card's library workspaces, its SM count and threads per SM."""
    return (*(getattr(device, field) for field in WORKSPACE_SIZES.values()), device.sm_count, threads_per_sm(device))


@without_collections
def on_card(stream: Stream, device) -> Stream | None:
    """``stream`` as ``device``'s kernels make it (NOTE [ A stream on another card ]): ``stream`` itself
    where no size changes; None where a reduction has no staging buffer on it (its stream has fewer
    allocations)."""
    kernels = list(stream.kernels) if stream.kernels is not None else None
    sized: dict[int, int] = {}  # allocation -> its size on the card, where that differs
    for i, t in enumerate(stream.tokens):
        if t[0] != "+" or (WORKSPACE not in t[5] and (kernels is None or kernels[i] is None)):
            continue  # (few allocations are sized by the card: test those only)
        size = workspace_bytes(t[5], device)
        if size is None and kernels is not None and kernels[i] is not None:
            kernels[i] = kernels[i]._replace(sm_count=device.sm_count, threads_per_sm=threads_per_sm(device))
            size = reduce.sized(kernels[i])[t[5] == reduce.SEMAPHORES]
        if size is not None and size != t[1]:
            if not size:
                return None
            sized[i] = size
    if not sized:
        return stream
    tokens = list(stream.tokens)
    for i, t in enumerate(tokens):
        j = i if t[0] == "+" else stream.frees[i] if t[0] == "-" else None
        if j in sized:  # (an allocation, or the free of one, resized)
            tokens[i] = (t[0], sized[j], *t[2:])
    return Stream(tokens, list(stream.frees), list(stream.phases), stream.blocks, kernels)


# NOTE [ Allocations at another batch ]
# The step at ``x`` samples makes the same allocations and frees as at ``x_a`` and ``x_b``, in the
# same order, each of a size on the line through its two sizes: a batch's activations, inputs and
# logits are ``x`` times a sample's, the weights, gradients, states and workspaces do not grow.
# ``widen`` builds that stream from ``b``'s events, each of ``b``'s allocations paired with ``a``'s by
# a diff of the two streams without their sizes (each run of frees sorted by what it frees but its
# size, which orders the runs of ``from_tracker`` otherwise at each batch). Before the step (the model's build), the trace's
# own history may add or drop an allocation (a cache made on first use in the process): those of
# ``b`` that ``a`` lacks keep their size, as ``deepen`` keeps them. Where the two streams differ in
# the step (a kernel chosen by size, a run of frees sorted otherwise) or a size is off the line of
# whole bytes, there is none (None). One kind of allocation is sized by a kernel's launch and not on
# a line: a reduction's staging buffer and semaphores grow in steps as its inputs outgrow the card's
# blocks (memfit.memory.cuda.reduce; an RMSNorm weight gradient's, 128 MiB at two samples and 192 MiB
# at 48 on an H100). The trace keeps what sizes them (``Stream.kernels``: the input's shape and strides,
# the SM count), and ``widen`` sizes them at ``x`` from the input drawn on the line; where a kernel has
# no staging at ``x``, there is no stream. A line drawn from two batches is not trusted on its word: the
# trace book checks it against a third batch traced (memfit.planner.at_batch).
class Paired(NamedTuple):
    """Two streams of the same step at two batches, each run of frees sorted by what it frees (but its
    size), and each event of ``b`` paired with the same event of ``a`` (NOTE [ Allocations at another batch ])."""

    a: Stream
    b: Stream
    pairs: dict[int, int]


@without_collections
def pair_up(a: Stream, b: Stream, *, setups_may_differ: bool = True) -> Paired | None:
    """The events of ``b`` paired with ``a``'s, as :func:`widen` draws them (the same at any ``x``: a plan's
    book pairs two batches' streams once); None where they are not the same events. ``setups_may_differ``
    False: None also where the model's builds differ (the streams must be the same events throughout)."""
    a, b = sorted_free_runs(a, by_size=False), sorted_free_runs(b, by_size=False)

    def shapes(s: Stream) -> list:
        return [t if t[0] == MARK else (t[0], *t[2:]) for t in s.tokens]

    pairs: dict[int, int] = {}  # event of ``b`` -> the same event of ``a``
    shapes_a, shapes_b = shapes(a), shapes(b)
    if shapes_a == shapes_b:  # (the diff's one run, without its quadratic search: most pairs are so)
        pairs = dict(zip(range(len(shapes_b)), range(len(shapes_a))))
    elif not setups_may_differ:
        return None
    else:
        matcher = difflib.SequenceMatcher(None, shapes_a, shapes_b, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                pairs.update(zip(range(j1, j2), range(i1, i2)))
            elif any(a.phases[i] != SETUP for i in range(i1, i2)) or any(b.phases[j] != SETUP for j in range(j1, j2)):
                return None
    for j, i in pairs.items():
        if b.tokens[j][0] == "-" and pairs.get(b.frees[j], -1) != a.frees[i]:
            return None  # (a free of another allocation)
    return Paired(a, b, pairs)


@without_collections
def widen(a: Stream, b: Stream, x_a: int, x_b: int, x: int, paired: Paired | None = None) -> Stream | None:
    """The stream at ``x`` samples from those at ``x_a`` and ``x_b`` (NOTE [ Allocations at another
    batch ]); None where they are not the same events with sizes on a line of whole bytes. ``paired``:
    :func:`pair_up` of the two, where the caller keeps it."""
    if x_a == x_b:
        return None
    paired = paired or pair_up(a, b)
    if paired is None:
        return None
    a, b, pairs = paired
    tokens = list(b.tokens)
    kernels = list(b.kernels) if b.kernels is not None else None
    for j, i in pairs.items():
        tb, ta = b.tokens[j], a.tokens[i]
        if tb[0] == MARK:
            continue
        if kernels is not None and kernels[j if tb[0] == "+" else b.frees[j]] is not None:
            if tb[0] == "-":  # (a staging buffer's free: its allocation's size, drawn before it)
                tokens[j] = ("-", *tokens[b.frees[j]][1:])
                continue
            g = _geometry_at(a.kernels[i] if a.kernels is not None else None, kernels[j], x_a, x_b, x)
            size = reduce.sized(g)[tb[5] == reduce.SEMAPHORES] if g is not None else 0
            if not size:
                return None  # (no staging at ``x``: another kernel configuration)
            tokens[j], kernels[j] = (tb[0], size, *tb[2:]), g
            continue
        rise, run = (tb[1] - ta[1]) * (x - x_a), x_b - x_a
        if rise % run or ta[1] + rise // run <= 0:
            return None
        tokens[j] = (tb[0], ta[1] + rise // run, *tb[2:])
    return sorted_free_runs(Stream(tokens, list(b.frees), list(b.phases), b.blocks, kernels))


def _geometry_at(ga, gb, x_a: int, x_b: int, x: int):
    """A reduction's geometry at ``x`` samples on the line through those at ``x_a`` and ``x_b``: its
    input's sizes and strides drawn on it, the rest the same (None where they differ, or a size is off
    the line of whole elements)."""
    if ga is None or ga[2:] != gb[2:] or len(ga.shape) != len(gb.shape):
        return None
    drawn = []
    for u, v in ((ga.shape, gb.shape), (ga.strides, gb.strides)):
        out = []
        for p, q in zip(u, v):
            rise, run = (q - p) * (x - x_a), x_b - x_a
            if rise % run or p + rise // run < 0:
                return None
            out.append(p + rise // run)
        drawn.append(tuple(out))
    if 0 in drawn[0]:
        return None
    return gb._replace(shape=drawn[0], strides=drawn[1])
