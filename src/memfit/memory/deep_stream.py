"""A plan's allocations at full depth, built from its two shallow traces, for the reserved bytes.

The shallow traces (memfit.planner.shallow) give a plan's allocated peak on a line, which is
exact, but not what the budget counts on a GPU: the caching allocator's *reserved* bytes depend
on the order and sizes of every allocation and free (fragmentation), and a line through two
shallow points misses them by 1-2.5 GiB on Llama-2-7B. Tracing the full depth to learn them costs
6-12 s per plan there.
"""

from __future__ import annotations

import itertools
import re

from memfit.memory.allocator import replay_events
from memfit.memory.expandable import new_model
from memfit.memory.heap import without_collections
from memfit.memory.stream_events import MARK, SETUP, Stream, fields_but_op, second_kind
from memfit.memory.stretches import (
    at_seam,
    blocks_a_copy,
    container,
    first_uses_once,
    inserted,
    joined,
    slides,
    unsized,
    unstraddled,
    until_end,
    with_sizes,
    without_sizes,
)
from memfit.memory.tracker import POINTS

__all__ = ["MARK", "SETUP", "Stream", "deepen", "from_tracker", "replay", "sorted_free_runs", "step_events"]

def from_tracker(tracker, device: str, side_streams: dict | None = None, containers: tuple[str, ...] = (),
                 swapped_from: dict[str, int] | None = None) -> Stream:
    """The stream of ``device`` in a :class:`~memfit.memory.tracker.MemoryTracker`'s timeline
    (as memfit.memory.allocator.replay sees it: storages of 0 bytes allocate nothing).
    ``containers``: the model's repeated-block containers (memfit.techniques.checkpointing.find_blocks);
    ``swapped_from``: a container's first swapped block, where some of its blocks are swapped (NOTE
    [ Two kinds of block, as two containers ])."""
    recs = tracker.state.records
    reductions = getattr(tracker, "reductions", None) or {}
    # (each container by its path and by its path's tails: the tracker names modules from the
    # first one whose forward ran, the inner model when a chunked loss calls it directly)
    tails = {".".join(c.split(".")[k:]) for c in containers for k in range(len(c.split(".")))}
    names = "|".join(map(re.escape, sorted(tails, key=len, reverse=True)))
    pattern = re.compile(r"\.(?:" + names + r")\.(\d+)(?:\.|$)") if containers else None
    kinds = second_kind(containers, swapped_from)
    blocks: list[int] = []
    kernels: list = []
    marks = sorted(((idx, k, name, step) for k, (name, step, idx) in enumerate(tracker.state.marks)))
    tokens, frees, phases, at, numbers = [], [], [], {}, {}
    m, phase = 0, SETUP

    def take_marks(upto: int) -> None:
        nonlocal m, phase
        while m < len(marks) and marks[m][0] <= upto:
            _, _, name, step = marks[m]
            if name not in POINTS:
                phase = name
            tokens.append((MARK, name, step))
            frees.append(-1)
            phases.append(phase)
            blocks.append(-1)
            kernels.append(None)
            m += 1

    for i, (serial, sign) in enumerate(tracker.state.events):
        take_marks(i)
        rec = recs[serial]
        if rec.device != device or rec.nbytes == 0:
            continue
        stream = side_streams.get(serial, 0) if side_streams else 0
        if stream:  # (numbered in order of first use: the process numbers streams on, trace after trace)
            stream = numbers.setdefault(stream, len(numbers) + 1)
        if sign > 0:
            at[serial] = len(tokens)
            # (the forward's module only: after a recomputation that stopped early, the tracker's
            # module stack can hold a module of another block into the backward)
            found = pattern.search(rec.module) if pattern and rec.phase == "forward" else None
            module = "" if rec.phase != "forward" else rec.module if found is None else \
                rec.module[:found.start(1)] + "#" + rec.module[found.end(1):]
            block = int(found.group(1)) if found else -1
            if found and kinds:
                module, block = kinds(module, block)
            tokens.append(("+", rec.nbytes, stream, rec.phase, rec.step, rec.op, module))
            frees.append(-1)
            blocks.append(block)
            kernels.append(reductions.get(serial))
        elif serial in at:
            tokens.append(("-",) + tokens[at[serial]][1:])
            frees.append(at.pop(serial))
            blocks.append(-1)
            kernels.append(None)
        else:
            continue
        phases.append(phase)
    take_marks(len(tracker.state.events))
    return sorted_free_runs(Stream(tokens, frees, phases, blocks, kernels if any(kernels) else None))


def step_events(stream: Stream) -> list:
    """The stream's events after the model's build (the build's may differ with the trace's history)."""
    return [t for t, phase in zip(stream.tokens, stream.phases) if phase != SETUP]


def sorted_free_runs(stream: Stream, by_size: bool = True) -> Stream:
    """Each run of frees in the forward with no allocation between them, sorted by the block
    and the kind of what they free. The allocator's state after a run does not depend on its
    order (freed blocks merge with their free neighbours either way), and autocast drops its
    cache of cast weights at the end of the forward in the order of a hash map, which no depth
    repeats (elsewhere the trace's order is the same at every depth). ``by_size=False``: sorted by
    what they free but its size first (the order at any batch, NOTE [ Allocations at another batch ] in
    memfit.memory.stream_sizes)."""
    tokens, frees, phases = list(stream.tokens), list(stream.frees), list(stream.phases)
    blocks = list(stream.blocks) if stream.blocks is not None else [-1] * len(tokens)
    i = 0
    while i < len(tokens):
        if tokens[i][0] != "-":
            i += 1
            continue
        k = i
        while k < len(tokens) and tokens[k][0] == "-":
            k += 1
        if phases[i] != "forward":  # (elsewhere the trace's order is already the same at every depth)
            i = k
            continue
        run = sorted(range(i, k), key=lambda j: (blocks[frees[j]], tokens[j] if by_size else (*tokens[j][2:], tokens[j][1])))
        tokens[i:k], frees[i:k], phases[i:k] = [tokens[j] for j in run], [frees[j] for j in run], [phases[j] for j in run]
        i = k
    return Stream(tokens, frees, phases, blocks, stream.kernels)  # (``kernels``: None at every free)


# NOTE [ Allocations at full depth ]
# The allocation stream of the step at depth ``e = d + p`` is the stream at depth ``d`` with one
# period's events inserted in a few stretches (a block's forward, its backward, its parameters,
# its optimizer states): a diff of the two streams finds them. An allocation's token is its size,
# stream, phase, step, op and, in the forward, its module with the block's index replaced by
# ``#`` (so that a stretch cannot slide onto a module outside the blocks, the final norm). The
# stream at full depth ``L`` has each stretch ``n = (L - d) / p`` times in a row. Who frees what
# is carried over from the shallow stream ``e``:
#
# - an allocation made in a block's forward (its module's index gives the block) and freed in the
#   forward or backward: by the free of the same block. The copies of a stretch run up the blocks
#   (down in the backward); an event made once is beyond the copies by all but one of them when it
#   is past the stretch in its run. The allocation freed is the one of the same kind, at the same
#   place among those of its block, in the block the free belongs to at full depth. This holds
#   however the diff placed the stretches (the forward of one block and the backward of another;
#   a stretch that starts mid-block);
# - otherwise, a free and its allocation in the same stretch: the same copy; in two different
#   stretches: the same copy, or the mirror copy (``n - 1 - c``) when exactly one of the two
#   happens in the backward pass; a chain through the copies (a gradient made by a block's
#   backward and freed by the next one's): the allocation made once is freed by the first copy,
#   copy ``c``'s allocation by copy ``c + 1``, the last copy's by the free made once.
#
# Where the depth counts units of two stacks (FLUX.1's one double- and two single-stream blocks), a
# copy moves a block's events by its own stack's blocks in a unit, and a stretch of the other stack's
# events does not move them (memfit.memory.stretches.blocks_a_copy, :func:`_far_side`; and NOTE
# [ Stretches at the seam of two stacks ] there). On FLUX.1-dev at 1024 px (RTX 4090 preset) three
# plans' allocated peaks and reserved bytes are their full traces' to the byte.
#
# NOTE [ A block's first fetches two ]
# With every block swapped (memfit.techniques.swap_blocks), a block's forward pre-hook copies the next
# block's weights to the device, freed when that block's forward ends; and the first block copies its
# own weights too. So the first block makes twice the copies of any other, and the copies another block
# frees are, in the first block, after its own: the same place counted from the block's last of their
# kind, not from its first. Where the place from the first is past what a block at full depth makes,
# the place from the last is taken. On FLUX.1-dev at 1024 px (bf16 and fp8 base weights, every block
# swapped) the replay then gives the full trace's allocated peak and reserved bytes to the byte.
#
# NOTE [ A fetch held across the copies ]
# With the last blocks swapped, the first resident block's forward pre-hook already fetches the first
# swapped block's weights, and they stay on the device through every resident block until that block's
# forward frees them: an allocation of the first resident block freed past the resident blocks' stretch.
# No block of the full depth's moved by the stretch's copies made it, so where the block's own allocation
# is not found there, an allocation made once and freed once is freed where it was made (where both
# moved, by the same block's, as before). Llama-2-7B, Gemma-2-9B and FLUX.1-dev plans with some blocks
# swapped replay to their full traces to the byte (NOTE [ Two kinds of block, as two containers ] in
# memfit.memory.stream_events).
#
# Replayed through memfit.memory.allocator's caching-allocator model, the stream gives the full
# step's allocated peak and reserved bytes without a full trace. Where the two streams do not
# differ by insertions alone (outside the model's build, where the trace's own history may add or
# drop an allocation), or a free cannot be carried over, there is no stream (None), and the planner
# traces the full depth: a free whose place moves with depth (the autograd engine reaches a small
# cast gradient later in a deeper model, with a chunked loss and fp32 master weights), a cuBLAS
# workspace first made in a different block.
#
# ``tests/unit/test_deep_stream.py`` holds it against full traces: the allocated peak and reserved
# bytes equal to the byte, and the step's events and who frees what equal, but in one plan where the
# optimizer's foreach steps order a few frees differently (the bytes equal). On Llama-2-7B the
# reserved bytes of six plans were the full traces' to the byte. The model's build differs (a
# shallow model is materialised from meta, the full one initialised), and no proof covers every
# model, so the planner only *rules out* plans on it, over the budget by more than the deep rung's
# margin (memfit.planner.candidate.Fidelity.DEEP), confirms its choice by a full trace, and checks the two against each other (memfit.planner.ladder's
# ``DeepRung``: a miss sends the plans it ruled out to full traces).
@without_collections
def deepen(a: Stream, b: Stream, d: int, e: int, full: int) -> Stream | None:
    """The stream at ``full`` blocks from those at ``d`` and ``e`` blocks (NOTE [ Allocations at full depth ], NOTE
    [ An allocation sized by the depth ]); None where they do not differ by inserted stretches."""
    if e <= d or (full - d) % (e - d) or full < e:
        return None
    (a, sized_a), (b, sized_b), n = without_sizes(a), without_sizes(b), (full - d) // (e - d)
    deep = _deepened(a, b, e - d, n)
    if deep is None and (until_end(a) is not a or until_end(b) is not b):  # (NOTE [ What the trace frees after its end ])
        a, b = until_end(a), until_end(b)
        deep, sized_a, sized_b = _deepened(a, b, e - d, n), sized_a[:unsized(a)], sized_b[:unsized(b)]
    return None if deep is None else with_sizes(deep, sized_a, sized_b, n)


def _deepened(a: Stream, b: Stream, period: int, n: int) -> Stream | None:
    spans, grown = inserted(a, b), blocks_a_copy(a, b)
    if spans is None or grown is None:
        return None
    if sum(g > 0 for g in grown.values()) > 1:  # (NOTE [ Stretches at the seam of two stacks ], NOTE [ A block split by the diff ])
        spans = joined(b, [part for span in spans for part in at_seam(b, *span)])
    moved = unstraddled(b, spans)  # (NOTE [ A stretch that ends on an allocation freed after it ])
    for once_by_place in (False, True):  # (NOTE [ Which copy is inserted ])
        for slid in itertools.chain(slides(b, spans), slides(b, moved) if moved != spans else ()):
            deep = _deepen(b, slid, period, n, once_by_place, grown)
            if deep is not None:
                return deep
    return None


def _deepen(b: Stream, spans: list[tuple[int, int]], period: int, n: int, once_by_place: bool,
            grown: dict[str, int]) -> Stream | None:
    stretch = [-1] * len(b.tokens)  # the inserted stretch each event of ``b`` is in (-1: once)
    for s, (j1, j2) in enumerate(spans):
        for j in range(j1, j2):
            stretch[j] = s

    # positions in the deep stream: event j of ``b`` in copy c of its stretch
    first, length, pos_once = {}, {}, {}
    out_len = 0
    j = 0
    while j < len(b.tokens):
        s = stretch[j]
        if s < 0:
            pos_once[j] = out_len
            out_len += 1
            j += 1
            continue
        k = j
        while k < len(b.tokens) and stretch[k] == s:
            k += 1
        first[s], length[s] = out_len, k - j
        out_len += n * (k - j)
        j = k
    def pos(j: int, c: int = 0) -> int:
        s = stretch[j]
        return pos_once[j] if s < 0 else first[s] + c * length[s] + (j - spans[s][0])

    # the event of ``b`` at each place, and its copy (two lists of ints, not a list of pairs: a deep
    # stream has ~10^5 places, and as many tuples would wake the garbage collector again and again)
    source: list[int] = []
    copy: list[int] = []
    j = 0
    while j < len(b.tokens):
        s = stretch[j]
        if s < 0:
            source.append(j)
            copy.append(0)
            j += 1
            continue
        for c in range(n):
            source.extend(range(j, j + length[s]))
            copy.extend(itertools.repeat(c, length[s]))
        j += length[s]
    tokens = list(map(b.tokens.__getitem__, source))
    phases = list(map(b.phases.__getitem__, source))
    frees = [-1] * out_len
    shifted = _far_side(b, spans, stretch)
    per_copy = [grown.get(container(t), period) for t in b.tokens]  # blocks a copy of each event spans

    def block_shift(j: int, c: int) -> int:
        """How many blocks further event j of ``b`` in copy c is at full depth: the copies of a
        stretch run up the blocks (down in the backward), and an event made once lies beyond
        all copies but one when it is past the stretch in its run."""
        blocks = per_copy[j]
        if stretch[j] < 0:
            return blocks * (n - 1) * shifted[j]
        return blocks * (n - 1 - c if b.phases[j] == "backward" else c)

    # a block's allocations at full depth by (token, run of one phase, block), in order; and the
    # place of each of ``b``'s among those of its block
    run = list(itertools.accumulate(int(t[0] == MARK) for t in b.tokens))
    made: dict[tuple, list[int]] = {}
    rank: dict[int, int] = {}
    seen: dict[tuple, int] = {}  # (the last place of each kind in its block)
    if b.blocks is not None:
        for j, tok in enumerate(b.tokens):
            if tok[0] == "+" and b.blocks[j] >= 0:
                key = (tok, run[j], b.blocks[j])
                rank[j] = seen[key] = seen.get(key, -1) + 1
        for i, (j, c) in enumerate(zip(source, copy)):
            if b.tokens[j][0] == "+" and b.blocks[j] >= 0:
                made.setdefault((b.tokens[j], run[j], b.blocks[j] + block_shift(j, c)), []).append(i)

    chain_in: dict[tuple, list[tuple[int, int]]] = {}   # token -> (allocation made once, its free in a stretch)
    chain_out: dict[tuple, list[tuple[int, int]]] = {}  # token -> (allocation in a stretch, its free made once)
    for jf, ja in enumerate(b.frees):
        if ja < 0:
            continue
        sf, sa = stretch[jf], stretch[ja]
        if ja in rank and b.phases[jf] in ("forward", "backward") and not (once_by_place and sf < 0 and sa < 0):
            # a block's allocation freed in the forward or backward: by the same block's free
            for c in range(n if sf >= 0 else 1):
                found = made.get((b.tokens[ja], run[ja], b.blocks[ja] + block_shift(jf, c)), ())
                from_last = seen[(b.tokens[ja], run[ja], b.blocks[ja])] - rank[ja]  # (NOTE [ A block's first fetches two ])
                if rank[ja] < len(found):
                    frees[pos(jf, c)] = found[rank[ja]]
                elif from_last < len(found):
                    frees[pos(jf, c)] = found[len(found) - 1 - from_last]
                elif sf < 0 and sa < 0:  # (NOTE [ A fetch held across the copies ])
                    frees[pos(jf)] = pos(ja)
                else:
                    return None
        elif sf < 0 and sa < 0:
            frees[pos(jf)] = pos(ja)
        elif sf == sa:
            for c in range(n):
                frees[pos(jf, c)] = pos(ja, c)
        elif sf >= 0 and sa >= 0:
            mirror = (b.phases[jf] == "backward") != (b.phases[ja] == "backward")
            for c in range(n):
                frees[pos(jf, c)] = pos(ja, n - 1 - c if mirror else c)
        elif sa < 0:
            chain_in.setdefault(b.tokens[ja], []).append((ja, jf))
        else:
            chain_out.setdefault(b.tokens[ja], []).append((ja, jf))
    links = _chains(chain_in, chain_out)
    if links is None:
        return None
    for (ja_once, jf), (ja, jf_once) in links:  # a chain through the copies (see the NOTE)
        mirror = (b.phases[jf] == "backward") != (b.phases[ja] == "backward")
        shift = -1 if ja_once < spans[stretch[ja]][0] else 1  # the allocation made once: before the copies, or after
        hit = set()
        for c in range(n):
            k = (n - 1 - c if mirror else c) + shift
            frees[pos(jf, c)] = pos(ja, k) if 0 <= k < n else pos(ja_once)
            hit.add(k)
        left = [k for k in range(n) if k not in hit]
        if len(left) != 1:
            return None
        frees[pos(jf_once)] = pos(ja, left[0])
    for i, ja in enumerate(frees):  # (a chain's free names the link it frees: NOTE [ A chain's last link ])
        if ja >= 0 and tokens[i][0] == "-" and tokens[i] != ("-",) + tokens[ja][1:] and \
                fields_but_op(tokens[i]) == fields_but_op(tokens[ja]):
            tokens[i] = ("-",) + tokens[ja][1:]
    if not _consistent(tokens, frees):
        return None
    blocks = [b.blocks[j] + block_shift(j, c) if b.blocks is not None and b.blocks[j] >= 0 else -1
              for j, c in zip(source, copy)]
    kernels = list(map(b.kernels.__getitem__, source)) if b.kernels is not None else None
    once = first_uses_once(Stream(tokens, frees, phases, blocks, kernels))
    return sorted_free_runs(once) if once is not None else None


def _chains(chain_in: dict, chain_out: dict) -> list | None:
    """Each chain's first link (an allocation made once, freed in a stretch) with its last (made in a stretch,
    freed once), paired by their fields, in order; then those left, by their fields but the op that made them
    (NOTE [ A chain's last link ]); None where some are left unpaired."""
    pairs, left_in, left_out = [], {}, {}
    for key in chain_in.keys() | chain_out.keys():
        ins, outs = chain_in.get(key, []), chain_out.get(key, [])
        if len(ins) == len(outs):
            pairs += zip(sorted(ins), sorted(outs))
        else:
            link = fields_but_op(key)
            left_in.setdefault(link, []).extend(ins)
            left_out.setdefault(link, []).extend(outs)
    for link in left_in.keys() | left_out.keys():
        ins, outs = left_in.get(link, []), left_out.get(link, [])
        if len(ins) != len(outs):
            return None
        pairs += zip(sorted(ins), sorted(outs))
    return pairs


def _far_side(b: Stream, spans: list[tuple[int, int]], stretch: list[int]) -> list[int]:
    """1 for an event of ``b`` made once that lies past an inserted stretch of its run of one
    phase (after it; before it in the backward, which runs down the blocks), else 0. A free in a
    sorted run of frees (:func:`sorted_free_runs`) is past the stretches inside that run only:
    the run is in block order of its own, whatever stretch came before it. A stretch of another
    block container's events does not count: FLUX.1's single-stream blocks follow the double-stream
    blocks' stretch, and are not moved by its copies (NOTE [ Stacks of two depths ])."""
    holds = [{container(t) for t in b.tokens[j1:j2]} - {None} for j1, j2 in spans]

    def moves(i: int, s: int) -> bool:
        own = container(b.tokens[i])
        return own is None or not holds[s] or own in holds[s]

    out = [0] * len(b.tokens)
    start = 0
    for j in range(len(b.tokens) + 1):
        if j == len(b.tokens) or b.tokens[j][0] == MARK:
            inside = [(s, j1, j2) for s, (j1, j2) in enumerate(spans) if start <= j1 < j]
            for i in range(start, j):
                if stretch[i] < 0 and inside:
                    down = b.phases[i] == "backward"
                    out[i] = int(any((j1 > i if down else j2 <= i) and moves(i, s) for s, j1, j2 in inside))
            start = j + 1
    i = 0
    while i < len(b.tokens):  # the sorted runs of frees in the forward
        k = i
        while k < len(b.tokens) and b.tokens[k][0] == "-" and b.phases[k] == "forward":
            k += 1
        inside = [(s, j1, j2) for s, (j1, j2) in enumerate(spans) if i <= j1 < k]
        if k - i > 1 and inside:  # (a run with no stretch of its own is where its neighbours put it)
            for x in range(i, k):
                if stretch[x] < 0:
                    out[x] = int(any(j2 <= x and moves(x, s) for s, j1, j2 in inside))
        i = max(k, i + 1)
    return out


def _consistent(tokens: list, frees: list) -> bool:
    """Every free frees an earlier allocation of its size, and no allocation is freed twice."""
    seen = set()
    for i, ja in enumerate(frees):
        if tokens[i][0] == "-":
            if not 0 <= ja < i or ja in seen or tokens[ja][0] != "+" or tokens[ja][1:] != tokens[i][1:]:
                return False
            seen.add(ja)
    return True


@without_collections
def replay(stream: Stream, step: int, *, expandable: bool = False) -> tuple[int, int]:
    """(allocated peak within step ``step``, reserved bytes at its end) of the stream through the
    caching-allocator model (with ``expandable`` segments or not), as
    memfit.memory.allocator.replay gives them for a trace."""
    marks = [(i, tok[1], tok[2]) for i, tok in enumerate(stream.tokens) if tok[0] == MARK]
    start = next(i for i, name, s in marks if name == "step" and s == step)
    end = next((i for i, name, _ in marks if i > start and name in ("step", "end")), len(stream.tokens))

    def events():
        for i, tok in enumerate(stream.tokens[:end]):
            if tok[0] == MARK:
                if tok[1] == "empty_cache":
                    yield i, None, 0, 0, 0
            elif tok[0] == "+":
                yield i, i, 1, tok[1], tok[2]
            else:
                yield i, stream.frees[i], -1, tok[1], tok[2]
    return replay_events(events(), start, model=new_model(expandable))[:2]
