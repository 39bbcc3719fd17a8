"""A plan's allocations at full depth, built from its two shallow traces, for the reserved bytes.

The shallow traces (memfit.planner.shallow) give a plan's allocated peak on a line, which is
exact, but not what the budget counts on a GPU: the caching allocator's *reserved* bytes depend
on the order and sizes of every allocation and free (fragmentation), and a line through two
shallow points misses them by 1-2.5 GiB on Llama-2-7B. Tracing the full depth to learn them costs
6-12 s per plan there.

NOTE [ Allocations at full depth ]
The allocation stream of the step at depth ``e = d + p`` is the stream at depth ``d`` with one
period's events inserted in a few stretches (a block's forward, its backward, its parameters,
its optimizer states): a diff of the two streams finds them. The stream at full depth ``L`` has
each stretch ``n = (L - d) / p`` times in a row. Who frees what is carried over from the
shallow stream ``e``, copy by copy:

- a free and its allocation in the same stretch: the same copy;
- in two different stretches: the same copy, or the mirror copy (``n - 1 - c``) when exactly
  one of the two happens in the backward pass (blocks run backward in the reverse order:
  the activations the last block's forward saved are freed first);
- a chain through the blocks (a gradient made by a block's backward and freed by the next
  one's): the matched allocation outside the stretch is freed by its first copy, copy ``c``'s
  allocation by copy ``c + 1``, and the last copy's by the matched free outside the stretch.

Replayed through memfit.memory.allocator's caching-allocator model, the stream gives the full
step's allocated peak and reserved bytes without a full trace. Where the two streams do not
differ by insertions alone (outside the model's build, where the trace's own history may add or
drop an allocation), or a free cannot be carried over, there is no stream (None), and the planner
traces the full depth. ``tests/unit/test_deep_stream.py`` holds it against the real deeper traces.

What is exact and what is not: the step's allocations, in order and size, are the full trace's,
and so is the allocated peak. Who frees what is not always: the diff may call the forward of one
block and the backward of another the inserted ones, and then some copies free a neighbouring
block's activations of the same size (found by review: 98 of a 6-block GPT-2's frees). That moves
blocks between free lists, not bytes; the reserved bytes came out within 0.5% of the full trace
on every plan measured (equal on most). The model's build also differs (a shallow model is
materialised from meta, the full one initialised). So the planner only *rules out* plans on it,
over the budget by more than ``DEEP_MARGIN``, confirms its choice by a full trace, and checks the
two against each other (memfit.planner.search: a miss sends the plans it ruled out to full
traces).
"""

from __future__ import annotations

import difflib
from typing import NamedTuple

from memfit.memory.allocator import CachingAllocatorModel

MARK = "mark"
SETUP = "setup"


class Stream(NamedTuple):
    """One device's allocations and frees, with the step's marks, in order.

    ``tokens[i]``: ``("+", nbytes, stream, phase, step, op)`` for an allocation (``phase``:
    the one it was made in), ``("-", ...)`` with its allocation's fields for a free, or
    ``("mark", name, step)``. ``frees[i]``: the index of the allocation the free at ``i`` frees
    (-1 elsewhere). ``phases[i]``: the step phase the event happened in."""

    tokens: list
    frees: list
    phases: list


def from_tracker(tracker, device: str, side_streams: dict | None = None) -> Stream:
    """The stream of ``device`` in a :class:`~memfit.memory.tracker.MemoryTracker`'s timeline
    (as memfit.memory.allocator.replay sees it: storages of 0 bytes allocate nothing)."""
    recs = tracker.state.records
    marks = sorted(((idx, k, name, step) for k, (name, step, idx) in enumerate(tracker.state.marks)))
    tokens, frees, phases, at = [], [], [], {}
    m, phase = 0, SETUP

    def take_marks(upto: int) -> None:
        nonlocal m, phase
        while m < len(marks) and marks[m][0] <= upto:
            _, _, name, step = marks[m]
            if name not in ("step", "end", "empty_cache"):
                phase = name
            tokens.append((MARK, name, step))
            frees.append(-1)
            phases.append(phase)
            m += 1

    for i, (serial, sign) in enumerate(tracker.state.events):
        take_marks(i)
        rec = recs[serial]
        if rec.device != device or rec.nbytes == 0:
            continue
        stream = side_streams.get(serial, 0) if side_streams else 0
        if sign > 0:
            at[serial] = len(tokens)
            tokens.append(("+", rec.nbytes, stream, rec.phase, rec.step, rec.op))
            frees.append(-1)
        elif serial in at:
            tokens.append(("-", rec.nbytes, stream, rec.phase, rec.step, rec.op))
            frees.append(at.pop(serial))
        else:
            continue
        phases.append(phase)
    take_marks(len(tracker.state.events))
    return _sorted_free_runs(Stream(tokens, frees, phases))


def _sorted_free_runs(stream: Stream) -> Stream:
    """Each run of frees with no allocation between them, sorted by what they free. The
    allocator's state after a run does not depend on its order (freed blocks merge with their
    free neighbours either way), and some runs have none the trace can repeat: autocast drops
    its cache of cast weights at the end of the forward in the order of a hash map."""
    tokens, frees, phases = list(stream.tokens), list(stream.frees), list(stream.phases)
    i = 0
    while i < len(tokens):
        if tokens[i][0] != "-":
            i += 1
            continue
        k = i
        while k < len(tokens) and tokens[k][0] == "-":
            k += 1
        run = sorted(range(i, k), key=lambda j: tokens[j])
        tokens[i:k], frees[i:k], phases[i:k] = [tokens[j] for j in run], [frees[j] for j in run], [phases[j] for j in run]
        i = k
    return Stream(tokens, frees, phases)


def deepen(a: Stream, b: Stream, d: int, e: int, full: int) -> Stream | None:
    """The stream at ``full`` blocks from those at ``d`` and ``e`` blocks (see NOTE [ Allocations
    at full depth ]); None where they do not differ by inserted stretches."""
    if e <= d or (full - d) % (e - d) or full < e:
        return None
    n = (full - d) // (e - d)
    spans = _inserted(a, b)
    if spans is None:
        return None
    stretch = [-1] * len(b.tokens)  # the inserted stretch each event of ``b`` is in (-1: once)
    for s, (j1, j2) in enumerate(spans):
        for j in range(j1, j2):
            stretch[j] = s
    starts = [j1 for j1, _ in spans]

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
    start_of = {s: starts[s] for s in range(len(starts))}

    def pos(j: int, c: int = 0) -> int:
        s = stretch[j]
        return pos_once[j] if s < 0 else first[s] + c * length[s] + (j - start_of[s])

    tokens: list = [None] * out_len
    phases: list = [None] * out_len
    frees = [-1] * out_len
    for j, tok in enumerate(b.tokens):
        for c in range(n if stretch[j] >= 0 else 1):
            tokens[pos(j, c)], phases[pos(j, c)] = tok, b.phases[j]
    chain_in: dict[tuple, list[tuple[int, int]]] = {}   # token -> (allocation made once, its free in a stretch)
    chain_out: dict[tuple, list[tuple[int, int]]] = {}  # token -> (allocation in a stretch, its free made once)
    for jf, ja in enumerate(b.frees):
        if ja < 0:
            continue
        sf, sa = stretch[jf], stretch[ja]
        if sf < 0 and sa < 0:
            frees[pos(jf)] = pos(ja)
        elif sf == sa:
            for c in range(n):
                frees[pos(jf, c)] = pos(ja, c)
        elif sf >= 0 and sa >= 0:
            mirror = (b.phases[jf] == "backward") != (b.phases[ja] == "backward")
            for c in range(n):
                frees[pos(jf, c)] = pos(ja, n - 1 - c if mirror else c)
        elif sa < 0:
            chain_in.setdefault(b.tokens[ja][1:], []).append((ja, jf))
        else:
            chain_out.setdefault(b.tokens[ja][1:], []).append((ja, jf))
    for key, ins in chain_in.items():  # a chain through the copies (see the NOTE)
        outs = chain_out.pop(key, [])
        if len(outs) != len(ins):
            return None
        for (ja_once, jf), (ja, jf_once) in zip(sorted(ins), sorted(outs)):
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
    if chain_out or not _consistent(tokens, frees):
        return None
    return _sorted_free_runs(Stream(tokens, frees, phases))


def _consistent(tokens: list, frees: list) -> bool:
    """Every free frees an earlier allocation of its size, and no allocation is freed twice."""
    seen = set()
    for i, ja in enumerate(frees):
        if tokens[i][0] == "-":
            if not 0 <= ja < i or ja in seen or tokens[ja][0] != "+" or tokens[ja][1:] != tokens[i][1:]:
                return False
            seen.add(ja)
    return True


def _inserted(a: Stream, b: Stream) -> list[tuple[int, int]] | None:
    """The stretches of ``b`` (start, end) that ``a`` lacks; None where the streams differ
    otherwise (but in the model's build, where the trace's history may add or drop an
    allocation: a cache made on first use)."""
    spans = []
    matcher = difflib.SequenceMatcher(None, a.tokens, b.tokens, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "insert":
            if any(b.tokens[j][0] == MARK for j in range(j1, j2)):
                return None  # a step or phase mark in a stretch: not a repeated block
            spans.append((j1, j2))
        elif tag != "equal" and (any(a.phases[i] != SETUP for i in range(i1, i2))
                                 or any(b.phases[j] != SETUP for j in range(j1, j2))):
            return None
    return spans


def replay(stream: Stream, step: int) -> tuple[int, int]:
    """(allocated peak within step ``step``, reserved bytes at its end) of the stream through the
    caching-allocator model, as memfit.memory.allocator.replay gives them for a trace."""
    model = CachingAllocatorModel()
    blocks: dict[int, object] = {}
    peak, inside = -1, False
    for i, tok in enumerate(stream.tokens):
        if tok[0] == MARK:
            name, s = tok[1], tok[2]
            if name == "empty_cache":
                model.empty_cache()
            elif name == "step" and s == step:
                inside = True
            elif inside and (name == "end" or name == "step"):
                break
            continue
        if tok[0] == "+":
            blocks[i] = model.malloc(tok[1], tok[2])
        else:
            model.free(blocks.pop(stream.frees[i]))
        if inside and model.allocated > peak:
            peak = model.allocated
    return max(peak, model.allocated if peak < 0 else peak), model.reserved
