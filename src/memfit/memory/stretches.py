"""The stretches a deeper shallow trace's allocations insert into a shallower one's: what
memfit.memory.deep_stream repeats to build a plan's allocations at full depth (NOTE [ Allocations at
full depth ] there)."""

from __future__ import annotations

import difflib

from memfit.memory.stream_events import MARK, SETUP, Stream, fields_but_op


# NOTE [ Stretches at the seam of two stacks ]
# Where a unit of the depth is blocks of two containers (FLUX.1's double- and single-stream blocks), a
# step that runs over the parameters in their order (the optimizer's foreach ops, zero_grad) has each
# stack's in a row: the unit's extra double block is inserted at the end of the double blocks', just
# before the single blocks', and the diff puts the extra single blocks' right after it, in one stretch
# (``D2 S0 S1`` of ``D0 D1 D2 S0 ... S5``). Repeated as one, it would alternate the stacks' tensors, as
# no depth does. So a stretch that does not repeat its neighbours but is two parts that do, the first
# the events before it and the second those after it, is two stretches, each repeated in place.
def at_seam(b: Stream, j1: int, j2: int) -> list[tuple[int, int]]:
    """The stretch, or its two parts where it lies at the seam of two stacks (the NOTE above)."""
    toks = b.tokens
    if _repeats(toks, j1, j2):
        return [(j1, j2)]
    for k in range(j1 + 1, j2):
        if toks[j1:k] == toks[2 * j1 - k:j1] and toks[k:j2] == toks[j2:2 * j2 - k]:
            return [(j1, k), (k, j2)]
    return [(j1, j2)]


# NOTE [ A block split by the diff ]
# With some blocks swapped, the backward's first swapped block fetches its own weights and the next one's,
# each middle one fetches the next one's (14 copies for a FLUX.1 single-stream block), and the last
# fetches none: ``C C B  C B  B`` at three swapped blocks (C: a block's copies, B: its backward), ``C C B  B``
# at two. The deeper trace inserts a middle block, ``C B``, but its B is the last block's too, and the diff
# can insert the middle block's C and the last block's B: ``C C B  [C] B  [B]``, where the last B, beside
# the resident blocks' stretch, makes one insertion with it (FLUX.1-dev with 19 of its 57 blocks swapped).
# Copied, the Cs would run in a row, then the Bs. A stretch that does not repeat its neighbours is joined
# with the next stretch of its run where that one, slid back over copies of itself (an equal insertion),
# starts where it ends: ``C C B  [C B]  B``, a middle block.
def joined(b: Stream, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The stretches, with a part of a block joined to the rest of it (the NOTE above)."""
    toks, out = b.tokens, list(spans)
    i = 0
    while i + 1 < len(out):
        (x1, x2), (y1, y2) = out[i], out[i + 1]
        n = y2 - y1
        while y1 - n >= x2 and toks[y1 - n:y1] == toks[y1:y2]:
            y1, y2 = y1 - n, y2 - n
        if y1 == x2 and not _repeats(toks, x1, x2) and not any(t[0] == MARK for t in toks[x2:out[i + 1][0]]):
            out[i:i + 2] = [(x1, y2)]
        i += 1
    return out


def _repeats(toks: list, j1: int, j2: int) -> bool:
    """The stretch has the events just before or just after it."""
    n = j2 - j1
    return (j1 >= n and toks[j1 - n:j1] == toks[j1:j2]) or toks[j2:j2 + n] == toks[j1:j2]


# NOTE [ Which copy is inserted ]
# The diff of the shallow streams places each inserted stretch at one of the places where ``b`` repeats
# it, and difflib takes the first: a LoRA's first block, say. But the first block is not always one of
# the rest: its input needs no gradient (the embeddings are frozen), so the cast LoRA weights it makes
# are not saved for the backward and are freed at the end of the forward. Copies of the first block are
# then the wrong ones, and the frees carried over free an allocation twice (a fp16 LoRA of Llama-2-7B
# at one sample, where that cast and the LoRA product's fp32 cast are the same size). So where the
# stretches where the diff put them do not carry every free over, they are tried one and two of their
# lengths further on, where ``b`` has the same events: a middle block's. And there the first block's
# free at the end of the forward, made once, is past the forward's stretch, so it would free the last
# copy's cast: where the stretches do not carry every free over however they are slid, a block's
# allocation made once and freed once is freed where it was made (``once_by_place``), as an allocation
# outside the blocks is. ``tests/unit/test_deep_stream.py`` holds it on such a step; on the fp16 LoRA and
# QLoRA of Llama-2-7B at one sample (T4 preset) the replay then gives the full trace's reserved bytes to
# the byte, and its allocated peak (the LoRA's 1 KiB over the full trace's 47.3 GiB).
def slides(b: Stream, spans: list[tuple[int, int]], most: int = 2):
    """The inserted stretches where the diff put them, then each slid by one and two of its own lengths
    where ``b`` repeats it there (see NOTE [ Which copy is inserted ])."""
    yield spans
    for k in range(1, most + 1):
        slid, moved = [], False
        for j1, j2 in spans:
            length, far = j2 - j1, 0
            while far < k and j2 + (far + 1) * length <= len(b.tokens) and \
                    b.tokens[j1 + (far + 1) * length:j2 + (far + 1) * length] == b.tokens[j1:j2]:
                far += 1
            slid.append((j1 + far * length, j2 + far * length))
            moved |= far == k
        if not moved:
            return
        yield slid


# NOTE [ A stretch that ends on an allocation freed after it ]
# AdamW's first step makes each parameter's states in turn (its step count, then two moments), and a step
# count made last is freed at once. The diff may place the inserted parameters' states one event late,
# moments first: the stretch then ends on the step count that is freed just after it, an allocation of
# every copy freed once. The same stretch one event earlier (the event before it equals its last) holds no such pair
# (Qwen2.5-VL-7B's QLoRA pair: its allocations at full depth did not line up).
def unstraddled(b: Stream, spans: list[tuple[int, int]], most: int = 3) -> list[tuple[int, int]]:
    """Each stretch moved back by up to ``most`` events while it ends on an allocation freed right after it
    and the event before it is the same as its last (the NOTE above)."""
    out = []
    for j1, j2 in spans:
        k = 0
        while k < most and j1 - k > 0 and j2 - k < len(b.frees) and b.frees[j2 - k] == j2 - k - 1 and \
                b.tokens[j1 - k - 1] == b.tokens[j2 - k - 1]:
            k += 1
        out.append((j1 - k, j2 - k))
    return out


def blocks_a_copy(a: Stream, b: Stream) -> dict[str, int] | None:
    """The blocks each block container grew by from ``a`` to ``b`` (what a copy of the pair's stretches
    inserts), by the prefix of its modules (before the ``#``): the period where the depth counts its
    blocks; the period and twice it for FLUX.1, whose depth counts units of one double- and two
    single-stream blocks (NOTE [ Stacks of two depths ] in memfit.planner.shallow); a share of it for each
    kind of a container whose last blocks are swapped (NOTE [ Two kinds of block, as two containers ] in
    memfit.memory.deep_stream); 0 for a container kept whole at both depths (a text encoder's: NOTE [ Stacks of
    unequal blocks ] in memfit.planner.stacks), whose events a copy does not move. None where a container
    shrank, or none grew."""
    def counts(s: Stream) -> dict[str, int]:
        out: dict[str, int] = {}
        for tok, block in zip(s.tokens, s.blocks or ()):
            if tok[0] == "+" and block >= 0:
                key = container(tok)
                out[key] = max(out.get(key, 0), block + 1)
        return out
    ca, cb = counts(a), counts(b)
    if set(ca) != set(cb):
        return None
    grown = {k: cb[k] - ca[k] for k in cb}
    return None if any(g < 0 for g in grown.values()) or grown and not any(grown.values()) else grown


def container(token: tuple) -> str | None:
    """The block container an allocation (or its free) was made in, in the forward: its module's path
    before the block's ``#``."""
    module = token[6] if token[0] != MARK and len(token) > 6 else ""
    return module.split("#")[0] if "#" in module else None


def inserted(a: Stream, b: Stream) -> list[tuple[int, int]] | None:
    """The stretches of ``b`` (start, end) that ``a`` lacks; None where the streams differ
    otherwise (but in the model's build, where the trace's history may add or drop an
    allocation: a cache made on first use)."""
    spans = []
    matcher = difflib.SequenceMatcher(None, a.tokens, b.tokens, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag in ("delete", "insert") and all(first_use(t) for t in [*a.tokens[i1:i2], *b.tokens[j1:j2]]):
            if _first_uses(a) != _first_uses(b):  # (made at one depth only: a difference)
                return None
            continue  # (NOTE [ A workspace made on first use ])
        if tag == "insert":
            if any(b.tokens[j][0] == MARK for j in range(j1, j2)):
                return None  # a step or phase mark in a stretch: not a repeated block
            spans += _at_run_ends(b, j1, j2)
        elif tag == "replace" and _frees_of_a_chain(a.tokens[i1:i2], b.tokens[j1:j2]):
            continue  # (NOTE [ A chain's last link ])
        elif tag != "equal" and (any(a.phases[i] != SETUP for i in range(i1, i2))
                                 or any(b.phases[j] != SETUP for j in range(j1, j2))):
            return None
        elif tag == "replace" and not set(a.tokens[i1:i2]) & set(b.tokens[j1:j2]):
            # (in the build: the shallower trace ran first in its process, and its caches made on first
            # use, absent in ``b``, sit beside the block's build ``b`` inserts, which the diff then
            # calls a replacement; the block's build is still a stretch to repeat)
            spans.append((j1, j2))
    return spans


# NOTE [ A workspace made on first use ]
# A thread's cuBLAS (and cuBLASLt) workspace is allocated by its first matmul, and never freed
# (memfit.memory.cuda.blas). Where that matmul is in a block, it is in the first block the thread runs:
# in the backward, the top one, which the deeper trace inserts. With every second block checkpointed
# (Qwen2.5-7B's LoRA at 2 and 4 blocks), the top block is plain and its backward's first matmul makes the
# autograd thread's cuBLASLt workspace: in the shallower trace it is in the block both traces share, in the
# deeper one in the block inserted before it. So the diff finds the workspace deleted there and inserted
# with the stretch, and a stretch copied n times would make it n times. A first-use allocation deleted or
# inserted alone is no difference of the streams; in a stretch, it is made by the first copy only
# (:func:`first_uses_once`), where the deeper trace has it: the first block the thread runs.
WORKSPACE_OF_A_THREAD = " workspace ("


def first_use(token: tuple) -> bool:
    """An allocation a thread makes on its first use of a library and never frees (NOTE [ A workspace made on
    first use ]; booked as ``"<library> workspace (<thread> thread)"`` by memfit.memory.cuda.model)."""
    return token[0] == "+" and WORKSPACE_OF_A_THREAD in token[5]


def _first_uses(s: Stream) -> list:
    return sorted(t for t in s.tokens if first_use(t))


def first_uses_once(s: Stream) -> Stream | None:
    """``s`` with each first-use allocation after the first of its kind left out (NOTE [ A workspace made on
    first use ]); None where a free names one left out (the trace's teardown frees the workspaces: such a
    stream was paired wrongly)."""
    seen, keep = set(), []
    for i, t in enumerate(s.tokens):
        if first_use(t):
            if t in seen:
                continue
            seen.add(t)
        keep.append(i)
    if len(keep) == len(s.tokens):
        return s
    new = {old: k for k, old in enumerate(keep)}
    if any(s.frees[i] >= 0 and s.frees[i] not in new for i in keep):
        return None
    return Stream([s.tokens[i] for i in keep], [new[s.frees[i]] if s.frees[i] >= 0 else -1 for i in keep],
                  [s.phases[i] for i in keep], [s.blocks[i] for i in keep] if s.blocks is not None else None,
                  [s.kernels[i] for i in keep] if s.kernels is not None else None)


def _at_run_ends(b: Stream, j1: int, j2: int) -> list[tuple[int, int]]:
    """An inserted stretch, or two where it is the end of a run of allocations and the end of the run of
    their frees that follows (of one allocation; or of one op's, in the optimizer's step): a foreach op over
    each block's tensors allocates all its outputs, then frees them all, and the diff can place the extra block's allocations and frees side by side, at the seam
    of the two runs. Copied as one stretch, they would alternate at full depth (the fp16 optimizer step's
    ``_foreach_sqrt`` on Llama-2-7B: 2 MiB less reserved than the full trace); as two, each run grows."""
    k = j1
    while k < j2 and b.tokens[k][0] == "+":
        k += 1
    if j1 == 0 or j2 >= len(b.tokens) or k in (j1, j2) or b.tokens[j2][0] != "-" or \
            any(t[0] != "-" for t in b.tokens[k:j2]):
        return [(j1, j2)]
    one_op = b.tokens[j1 - 1] == b.tokens[j1] and all(t == b.tokens[j1] for t in b.tokens[j1:k]) and \
        all(t == b.tokens[j2] for t in b.tokens[k:j2])
    # (or a foreach op over tensors of several sizes, in the optimizer's step: Phi-3-mini's QLoRA, 8 sizes a
    # layer, was 44 MiB short of the full trace's reserved bytes)
    several = b.phases[j1] == "optimizer" and b.tokens[j1 - 1][0] == "+" and \
        len({t[5] for t in b.tokens[j1 - 1:j2 + 1]}) == 1
    return [(j1, k), (k, j2)] if one_op or several else [(j1, j2)]


# NOTE [ A chain's last link ]
# A free's event names what its allocation was made by. In a chain through the blocks' backward (a
# gradient one block makes and the next frees), the first block of the backward makes its link otherwise
# than the others (Gemma 2's last layer casts the gradient it gets from the final norm, ``_to_copy``; the
# others add to theirs, ``add``). Where the first block's backward frees a link, the shallower trace's
# free is the cast's, and the deeper one's an add's: the same free, at the same place, of another
# allocation. The diff calls it a replacement; it is not an inserted stretch but where the chain ends, so
# frees that differ only in what made their allocations are taken as equal here, and who frees what is
# the deeper trace's own (memfit.memory.deep_stream carries it over through the copies).
def _frees_of_a_chain(x: list, y: list) -> bool:
    """Runs of frees, one for one, that differ only in the op that made what they free."""
    return len(x) == len(y) and all(
        u[0] == v[0] == "-" and fields_but_op(u) == fields_but_op(v) for u, v in zip(x, y))


# NOTE [ An allocation sized by the depth ]
# Clipping by the global norm stacks one norm per gradient (``torch.stack`` in ``clip_grad_norm_``): one
# allocation made once, whose bytes grow with the blocks (4 bytes a gradient), beside the norms each block's
# gradients insert. The diff of two depths' streams then paired the norms and the stack as a replacement, not
# an inserted stretch, and no stream was made: every plan that clips (the Trainer's default, and
# LLaMA-Factory's, axolotl's, kohya's) was confirmed by its full trace (12.8 s for Qwen2.5-7B's LoRA at 2 x
# 2,048, and 65 s at 8 such micro-batches, against 2.5 s at a third depth). So the optimizer's stacks and
# concatenations are diffed without their bytes (:func:`without_sizes`), and memfit.memory.deep_stream sizes
# each at full depth on the line through its two (:func:`with_sizes`). The trace at a third depth checks that
# line as it checks the rest of the deepening: where it misses, the full trace decides.
SIZED_BY_DEPTH = ("stack", "cat")
"""Ops of the optimizer's phase whose one output holds something of each parameter."""


def without_sizes(s: Stream) -> tuple[Stream, list[int]]:
    """``s`` with the bytes of its allocations sized by the depth (and of their frees) as -1 (the NOTE above), and
    those bytes, in order."""
    sizes, tokens = [], list(s.tokens)
    for i, t in enumerate(tokens):
        if t[0] in ("+", "-") and t[3] == "optimizer" and t[5] in SIZED_BY_DEPTH:
            sizes.append(t[1])
            tokens[i] = (t[0], -1) + t[2:]
    return (s._replace(tokens=tokens), sizes) if sizes else (s, sizes)


def unsized(s: Stream) -> int:
    """How many events :func:`without_sizes` took the bytes of ``s`` holds (``s`` cut at its end: fewer)."""
    return sum(t[0] in ("+", "-") and t[1] == -1 for t in s.tokens)


def with_sizes(deep: Stream, a: list[int], b: list[int], n: int) -> Stream | None:
    """``deep`` (deepened by ``n`` periods past ``a``'s depth) with each event :func:`without_sizes` took the bytes
    of at the bytes on the line through ``a``'s and ``b``'s; None where the streams do not hold them one for one."""
    if not a:
        return deep
    places = [i for i, t in enumerate(deep.tokens) if t[0] in ("+", "-") and t[1] == -1]
    if not len(places) == len(a) == len(b):  # (made once each: a stack per step, not per block)
        return None
    tokens = list(deep.tokens)
    for i, x, y in zip(places, a, b):
        tokens[i] = (tokens[i][0], max(x + n * (y - x), 0)) + tokens[i][2:]
    return deep._replace(tokens=tokens)


# NOTE [ What the trace frees after its end ]
# When the traced steps end, the trace lets go of the model: its parameters and optimizer states are
# freed in the order Python drops them. Those frees follow no block, and the diff of two streams pairs
# them by size alone. Where the deeper model grew two stacks apart (a vision tower's and a language
# model's blocks: NOTE [ Stacks of unrelated depths ] in memfit.planner.shallow), a parameter inserted
# for one stack had its free paired with another's, and no stream was made. What the pair's stream is
# asked for is the replay of a step (:func:`replay`), which ends at the step's end. So where the streams do not
# line up whole, they are cut at their last ``end`` mark and tried again (whole first: a swapped block's
# optimizer frees are placed by its teardown stretch, tests/unit/test_planner_gpu.py). A tiny Qwen2.5-VL's
# checkpointed LoRA then replays to its full trace's allocated peak and reserved bytes to the byte (before: no stream, and a full trace for its reserved bytes).
def until_end(s: Stream) -> Stream:
    """``s`` up to its last ``end`` mark (the NOTE above)."""
    end = next((i + 1 for i in range(len(s.tokens) - 1, -1, -1) if s.tokens[i][:2] == (MARK, "end")), len(s.tokens))
    if end == len(s.tokens):
        return s
    return Stream(*(None if x is None else x[:end] for x in s))
