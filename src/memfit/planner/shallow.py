"""Shallow traces: a plan's memory and step time from the same model with fewer repeated blocks.

A fake trace costs time per op, not per byte: tracing GPT-2 at batch 1 is no faster than at batch 8,
but tracing 2 of its 12 blocks is 5x faster. What the planner compares grows linearly with the
number of repeated blocks ``L`` (a decoder's layers): the blocks' parameters, gradients and
optimizer states, their saved activations, their kernels and the time they take. So each plan is
traced twice at shallow depths ``d`` and ``e = d + p`` (``p``: the plan's period, 2 for
``checkpointing: blocks:every=2``, else 1; ``d``: 2, or ``p`` when larger: 2 and 3 blocks, or 2 and
4; where blocks come in several kinds, 1 and 2 units of a few blocks: memfit.planner.stacks), and
every figure is extrapolated along the line through both::

    f(L) = f(d) + (f(e) - f(d)) * (L - d) / p

The shallow model is the workload's own ``model()``, built on the meta device, with each repeated
block container (memfit.techniques.checkpointing.find_blocks) cut to its first blocks (how many at
each depth: memfit.planner.stacks.Stacks), then
given storage where ``build_step`` builds it (``to_empty``): the same classes, the same step, fewer
layers, and nothing of the full model ever allocated (the caching-allocator model would keep its
segments). Values are not initialised: fake tensors have none.

What does not extrapolate: a peak that moves between phases with depth (the line through two
shallow points is the line of the phase that peaks there), caching-allocator rounding (segments of
2 MiB and 20 MiB), and models that index their blocks by a configured count. The planner therefore
confirms the plan it chooses with one full trace (memfit.planner.search), and a workload whose
shallow build or trace fails is traced at full depth.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import itertools
import math
from collections.abc import Sequence

import torch

from memfit.planner.op_links import Links, consistent, relinked
from memfit.planner.stacks import MIN_DEPTH_FOR_SHALLOW, stacks_of
from memfit.techniques.checkpointing import find_blocks
from memfit.techniques.host_tensors import BuildRecord, plain_tensors
from memfit.techniques.loading import on_meta
from memfit.workload import Workload, call_workload


def shallow_workload(workload: Workload, depth: int, meta: torch.nn.Module | None = None) -> Workload:
    """``workload`` whose model keeps the first ``depth`` blocks of each repeated-block container.

    ``meta``: the workload's model already built on the meta device (the planner's look at its
    structure, under the default dtype of now): the shallow model is cut from a copy of it at once
    (a copy costs a few ms, a build tens of ms in every worker process), else built on the first
    call. The meta model is kept per default dtype: a plan's build context may change it
    (``precision: bf16-pure`` builds in bf16), and a model copied from the fp32 one would put an
    fp32 build into the trace (the reserved bytes at full depth counted a 25 GiB fp32 Llama-2-7B)."""
    built: dict[torch.dtype, torch.nn.Module] = {}
    records: dict[torch.dtype, BuildRecord] = {}
    if meta is not None and not plain_tensors(meta):  # (else built here: NOTE [ Plain tensors of a meta build ])
        try:
            built[torch.get_default_dtype()] = _cut(copy.deepcopy(meta), depth)
        except Exception:  # noqa: BLE001 - built again at the trace, whose failure sends it to full depth
            pass

    def model() -> torch.nn.Module:
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        if dtype not in built:  # the meta model is built once per default dtype, and copied for each trace
            with on_meta() as records[dtype]:
                built[dtype] = _cut(call_workload("model()", workload.model), depth)
        return _materialize(built[dtype], device, records.get(dtype))
    return dataclasses.replace(workload, model=model, name=f"{workload.name}[{depth} blocks]")


def _cut(model: torch.nn.Module, depth: int) -> torch.nn.Module:
    """``model`` with each repeated-block container cut to its first ``depth`` blocks, or ``depth`` units
    of them (NOTE [ Stacks of two depths ]), in place."""
    stacks = stacks_of(model)
    for (name, children), keep in zip(find_blocks(model), stacks.at(depth)):
        container = model.get_submodule(name)
        for child in [n for n, c in container.named_children() if any(c is x for x in children)][keep:]:
            delattr(container, child)
    return model


def _materialize(model: torch.nn.Module, device: torch.device, record: BuildRecord | None = None) -> torch.nn.Module:
    """A copy of a meta model with uninitialised storage on ``device`` (``to_empty`` on a copy,
    keeping tied parameters tied; the meta model itself is left as it is, for the next copy). Its plain
    tensor attributes are made on the host from ``record``, the meta build's (NOTE [ Plain tensors of a
    meta build ]); one it cannot make stays the meta model's own."""
    memo: dict[int, torch.Tensor] = {id(t): t for t in plain_tensors(model)}
    if record is not None:  # (a model loaded as a checkpoint is copied onto meta, and its plain tensors are the host's)
        memo.update(record.host_values(model, torch.device("cpu") if device.type == "meta" else device))
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) not in memo:
            empty = torch.empty_like(t, device=device)
            memo[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def period(plan, full: int | None = None, unit: tuple[int, ...] = (1,)) -> int:
    """The depth unit of a plan: ``checkpointing: blocks:every=N`` repeats every N blocks (of each stack's
    ``unit`` blocks a depth: every ``N / gcd(N, unit)`` depths),
    ``offload: activations:blocks=K`` of ``full`` blocks every ``full / gcd(full, K)`` (NOTE [ A
    shallow pair of a plan that offloads the first K blocks ]), ``swap_blocks: N`` every
    ``full / gcd(full, N)`` (NOTE [ A shallow pair of a plan that swaps the last N blocks ])."""
    every = max(1, int(getattr(plan.config("checkpointing"), "every", 1) or 1))
    p = math.lcm(*(every // math.gcd(every, u) for u in unit if u))
    for k in (offloaded_blocks(plan), int(plan.swap_blocks or 0)):
        if k and full:
            p = math.lcm(p, full // math.gcd(full, k))
    return p


# NOTE [ A shallow pair of a plan that offloads the first K blocks ]
# ``offload: activations:blocks=K`` offloads what the first K of the model's L blocks save: two kinds of
# block, K offloaded ones, then L - K kept ones. A shallow model of d blocks cannot offload K of
# them (K is half the blocks when the planner asks), and one kind of block inserted between two
# depths cannot make the other kind grow. So the pair keeps the full model's share: at d blocks,
# the first d * K / L are offloaded, at depths where that is whole (a period of L / gcd(L, K) blocks:
# 2 for half of them). The deeper trace then has one block of each kind more for each period, and
# what grows with both kinds grows along the line through the pair, the peak of the step and the
# count and size of its ops. What the pair's difference cannot give is the order at full depth: it
# is one offloaded and one kept block inserted side by side, while the full model has all offloaded
# blocks first. So a plan of two kinds keeps no stream (memfit.memory.deep_stream), and what asks
# for its exact allocations (the reserved bytes, another batch's line) traces it at full depth. (Named
# apart, as swapped blocks are: NOTE [ Two kinds of block, as two containers ], the kept blocks' order
# holds at 4 and 6 blocks where no block is checkpointed, but not at 2 and 4, and the deeper pairs cost
# more planning time than the streams saved: docs/planner.md.) Its
# ops do not line up either (backward fetches the offloaded blocks' tensors ahead, inside the kept
# blocks' backward), so its step time is the one on the line through the pair's times
# (memfit.planner.gpu_time). Before the pair, such a plan cost a full trace to be compared at all
# (6 s of a 7B model's 68 s plan).
def offloaded_blocks(plan) -> int:
    """K of a plan that offloads the first K blocks' activations (0: none, or every block's)."""
    k = plan.config("offload").activations
    return int(k) if 0 < k < float("inf") else 0


def at_depth(plan, depth: int, full: int):
    """``plan`` as the model cut to ``depth`` of its ``full`` blocks runs it: the same share of offloaded
    blocks (NOTE [ A shallow pair of a plan that offloads the first K blocks ]) and of swapped blocks
    (every block swapped: all ``depth`` of them); the plan itself where it has one kind of block."""
    k, n = offloaded_blocks(plan), int(plan.swap_blocks or 0)
    if depth == full or not (k or n):
        return plan
    if n:  # (of all the stacks' blocks: an encoder-decoder's 2 * full)
        plan = plan.replace(swap_blocks=n * depth // full)
    if not k:
        return plan
    offload = plan.config("offload")
    items = tuple(x if not x.startswith("activations:blocks=") else f"activations:blocks={k * depth // full}"
                  for x in offload.items)
    return plan.with_config(type(offload)(items))


# NOTE [ A shallow pair of a plan that swaps the last N blocks ]
# ``swap_blocks: N`` keeps the frozen weights of the last N repeated blocks on the host, and at most
# two of them on the device at once (the one running, the one being fetched). As for the first K
# blocks offloaded, the pair keeps the full model's share: with L blocks a stack, at d blocks a stack
# the last d * N / L are swapped (a period of L / gcd(L, N) blocks; every block swapped: all of them,
# of every stack), and the shallower depth swaps at least two, so that both hold two swapped blocks'
# weights: the device's weights are then the resident blocks' and two swapped ones', on the line
# through the pair. Where every block is swapped the ops line up, and each block waits for its own
# prefetch (NOTE [ Ops that wait for others, in the extrapolated ops ] in memfit.planner.op_links:
# Gemma-2-9B's LoRA priced as its full trace, 4.14 s); where some are, the step time is on the line
# through the pair's (two kinds of block, as for offloaded activations; 4.10 s against its full
# trace's 4.10 s for 21 of its 42 blocks). The pair keeps its streams, and their allocations at full
# depth (memfit.memory.deep_stream; NOTE [ A block's first fetches two ] there; some blocks swapped:
# NOTE [ Two kinds of block, as two containers ] in memfit.memory.stream_events) are the full trace's to
# the byte on FLUX.1-dev at 1024 px, in bf16 and fp8, and on Llama-2-7B and Gemma-2-9B with a quarter,
# half and three quarters of their blocks swapped (before, some blocks swapped kept no stream, and the
# reserved bytes came from the full trace that confirms a plan). Before, each swapped
# plan cost a full-depth trace (21 s apiece for Gemma-2-9B's LoRA, 18 of them in a 286 s plan). A count whose period does not fit within the model
# (10 of 42 blocks: a period of 21) is traced at full depth; the planner searches counts with short
# periods (memfit.techniques.swap_blocks.search).


def depths(plan, full: int, least: int = 2, unit: tuple[int, ...] = (1,)) -> tuple[int, int] | None:
    """The two shallow depths ``(d, d + p)`` a plan is traced at (``p``: its period), or None when it
    should be traced at full depth (a shallow model, or a depth the period does not divide).
    ``least`` and ``unit``: the shallowest depth, and each stack's blocks a depth (memfit.planner.stacks)."""
    p = period(plan, full, unit)
    d = p * -(-least // p)  # at least 2 blocks: one block is no repeated block (find_blocks)
    n = int(plan.swap_blocks or 0)
    if n and full:  # two swapped blocks at the shallower depth (NOTE [ A shallow pair of a plan that swaps the last N blocks ])
        d = max(d, p * math.ceil(math.ceil(2 * full / min(n, full)) / p))
    if (full < MIN_DEPTH_FOR_SHALLOW and (least > 1 or n)) or d + p >= full or (full - d) % p:
        return None
    return d, d + p


# NOTE [ Blocks of several kinds, some swapped ]
# Where a stack is cut in units of its blocks' kinds (Gemma 2's sliding and global layers, two blocks a
# unit: NOTE [ Blocks of several kinds ] in memfit.planner.stacks), a share of its blocks swapped mixes
# the kinds unevenly between depths unless the swapped blocks are whole units at every depth: 21 of
# Gemma-2-9B's 42 blocks swaps one global layer more than sliding ones, and at 3 units 1 of 6 blocks,
# of one kind. Such plans are traced at full depth. But 14 or 28 of 42 are 7 or 14 whole units, and
# the pair at 3 and 6 units swaps 2 and 4, or 4 and 8, blocks: whole units too, each kind swapped as in
# the full model, one unit of each container (resident, swapped) inserted between the depths. Those
# keep their pair, as a stack of one kind does (NOTE [ A shallow pair of a plan that swaps the last N
# blocks ]). One stack only: stacks of unrelated depths keep no pair for a share of their blocks.
def swapped_in_units(plan, pair: tuple[int, ...], stacks) -> bool:
    """A plan swapping a share of one stack's blocks swaps whole units of its kinds in the full model and
    at both depths of its ``pair`` (NOTE [ Blocks of several kinds, some swapped ]); nothing else offloaded."""
    n = int(plan.swap_blocks or 0)
    if not pair or len(stacks.unit) != 1 or offloaded_blocks(plan) or not n:
        return False
    unit, full = stacks.unit[0], stacks.full
    return n % unit == 0 and all(n * d % full == 0 and (n * d // full) % unit == 0 for d in pair)


def extrapolate(at_d: float, at_e: float, d: int, e: int, full: int) -> float:
    """The figure at ``full`` blocks on the line through (d, at_d) and (e, at_e)."""
    return at_d + (at_e - at_d) * (full - d) / (e - d)


# -- the ops of the full-depth step -----------------------------------------------------------------
def extrapolate_ops(a: list, b: list, d: int, e: int, full: int) -> list | None:
    """The op list of the full-depth step from those of the shallow steps at ``d`` and ``e`` blocks
    (memfit.planner.opcost.Op tuples), or None when they do not line up.

    Step times are not linear in depth when the step changes regime (a shallow step waits on the
    CPU issuing kernels, the full one on the GPU), so the ops are extrapolated, not the time. Both
    lists are cut into runs of one phase (forward, backward, optimizer, per micro-batch); the runs
    must pair up one to one. The deeper run is the shallow run with the extra blocks' ops inserted
    at one place, and the other ops of the same kinds, some of them bigger (a ``_foreach`` op over
    more tensors). The insertion point is the one where the most ops are equal before and after
    it. The full run repeats the inserted stretch once per further ``e - d`` blocks, and puts each
    other op on the line through its two sizes."""
    runs_a, runs_b = _runs(a), _runs(b)
    if len(runs_a) != len(runs_b) or e <= d or (full - d) % (e - d):
        return None
    copies = (full - d) // (e - d)  # inserted stretches at full depth (one of them already in ``b``)
    links = Links(b)  # (prefetches: NOTE [ Ops that wait for others, in the extrapolated ops ])
    out: list = []
    images: list[list[int]] = []  # the indices in ``out`` of each op of ``b`` (``copies`` of a stretch's)
    start = 0
    for ra, rb in zip(runs_a, runs_b):
        extra = len(rb) - len(ra)
        p = _insertion(ra, rb, functools.partial(_keeps_links, links, b, start, extra, len(rb)))
        if p is None and not links.made:  # (NOTE [ Stacks of unrelated depths ]: a stretch a stack)
            run = _with_stretches(ra, rb, copies)
            if run is None:
                return None
            out += run
            start += len(rb)
            continue
        if p is None:
            return None
        if links.made:
            images += [[len(out) + i] for i in range(p)] + \
                [[len(out) + p + c * extra + i for c in range(copies)] for i in range(extra)] + \
                [[len(out) + p + copies * extra + i] for i in range(len(ra) - p)]
            links.runs.append((start, start + p, start + p + extra, start + len(rb)))
        out += [_scaled(x, y, copies) for x, y in zip(ra[:p], rb[:p])] + rb[p:p + extra] * copies + \
            [_scaled(x, y, copies) for x, y in zip(ra[p:], rb[p + extra:])]
        start += len(rb)
    return relinked(out, images, links, b)


def _with_stretches(ra: list, rb: list, copies: int) -> list | None:
    """The run at full depth where ``rb`` is ``ra`` with stretches inserted at several places (one a stack
    of blocks, each stack's grown by a block or more: a vision tower's and its language model's), or
    None: a diff of the two runs' ops (without the storage they touch) that finds only insertions, and ops of
    one kind grown in place (a ``_foreach`` op over more tensors)."""
    ids: dict = {}  # (each op's key as a small int: the diff hashes and compares ints, not tuples of fields)
    ka, kb = [ids.setdefault(_key(op), len(ids)) for op in ra], [ids.setdefault(_key(op), len(ids)) for op in rb]
    head = next((i for i, (x, y) in enumerate(zip(ka, kb)) if x != y), min(len(ka), len(kb)))
    tail, most = 0, min(len(ka), len(kb)) - head
    while tail < most and ka[-1 - tail] == kb[-1 - tail]:
        tail += 1
    # (the diff's time grows with the product of the lengths it compares: the ops before the first
    # insertion and after the last are paired without it)
    matcher = difflib.SequenceMatcher(None, ka[head:len(ka) - tail], kb[head:len(kb) - tail], autojunk=False)
    out: list = [_scaled(x, y, copies) for x, y in zip(ra[:head], rb[:head])]
    for tag, i1, i2, j1, j2 in ((t, i1 + head, i2 + head, j1 + head, j2 + head) for t, i1, i2, j1, j2 in matcher.get_opcodes()):
        grown = j2 - j1 - (i2 - i1)  # (a replacement: ops grown in place, beside a stretch inserted before or after them)
        if tag == "insert":
            out += rb[j1:j2] * copies
        elif tag == "equal":
            out += [_scaled(x, y, copies) for x, y in zip(ra[i1:i2], rb[j1:j2])]
        elif tag == "replace" and grown >= 0 and all(map(_same_kind, ra[i1:i2], rb[j2 - (i2 - i1):j2])):
            out += rb[j1:j1 + grown] * copies + [_scaled(x, y, copies) for x, y in zip(ra[i1:i2], rb[j1 + grown:j2])]
        elif tag == "replace" and grown >= 0 and all(map(_same_kind, ra[i1:i2], rb[j1:j1 + i2 - i1])):
            out += [_scaled(x, y, copies) for x, y in zip(ra[i1:i2], rb[j1:j1 + i2 - i1])] + rb[j2 - grown:j2] * copies
        else:
            return None
    return out + [_scaled(x, y, copies) for x, y in zip(ra[len(ra) - tail:], rb[len(rb) - tail:])]


def _keeps_links(links: Links, b: list, start: int, extra: int, length: int, p: int) -> bool:
    """The stretch inserted at ``p`` of the run ``b[start:start + length]`` keeps its waits."""
    return consistent(links, b, start, start + p, start + p + extra, start + length)


def _insertion(ra: list, rb: list, keeps_links=lambda p: True) -> int | None:
    """Where in ``ra`` the ops ``rb`` has more were inserted: the ops before and after it pair up by
    kind, with the fewest unequal pairs, and the stretch repeats the ops that wait for others with
    what they wait for (``keeps_links(p)``: NOTE [ Ops that wait for others, in the extrapolated ops ]
    in memfit.planner.op_links); None if there is no such place."""
    n, extra = len(ra), len(rb) - len(ra)
    if extra < 0:
        return None
    kind_before, unequal_before = [True] * (n + 1), [0] * (n + 1)
    for i in range(n):
        kind_before[i + 1] = kind_before[i] and _same_kind(ra[i], rb[i])
        unequal_before[i + 1] = unequal_before[i] + (_key(ra[i]) != _key(rb[i]))
    kind_after, unequal_after = [True] * (n + 1), [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        kind_after[i] = kind_after[i + 1] and _same_kind(ra[i], rb[i + extra])
        unequal_after[i] = unequal_after[i + 1] + (_key(ra[i]) != _key(rb[i + extra]))
    places = sorted((p for p in range(n + 1) if kind_before[p] and kind_after[p]),
                    key=lambda p: unequal_before[p] + unequal_after[p])
    return next((p for p in places if keeps_links(p)), None)


def _runs(ops: list) -> list[list]:
    runs: list[list] = []
    for op in ops:
        if runs and runs[-1][0].phase == op.phase:
            runs[-1].append(op)
        else:
            runs.append([op])
    return runs


def _key(op) -> tuple:
    """An op without the storage it touches (that differs between traces)."""
    return op._replace(key=0)


def _same_kind(x, y) -> bool:
    return x.kind == y.kind and x.phase == y.phase and x.dtype == y.dtype and x.flags == y.flags


def _scaled(x, y, copies: float):
    """The op on the line through ``x`` (depth d) and ``y`` (d + p), at ``copies`` periods past d (or
    through two batches, ``copies`` times their distance past the first)."""
    def line(u, v):
        return type(u)(max(0, u + (v - u) * copies))
    return y._replace(flops=line(x.flops, y.flops), nbytes=line(x.nbytes, y.nbytes),
                      tensors=line(x.tensors, y.tensors), host_bytes=line(x.host_bytes, y.host_bytes),
                      elements=line(x.elements, y.elements))


def ops_line_up(a: list, b: list) -> bool:
    """``a`` and ``b`` are the same ops at two batches, so the step at another batch has each on the line
    through its two sizes (:class:`OpsOnLine`; memfit.memory.deep_stream's NOTE [ Allocations at another
    batch ])."""
    return len(a) == len(b) and all(_same_kind(u, v) and u.tensors == v.tensors for u, v in zip(a, b))


class OpsOnLine(Sequence):
    """The op list of the step at ``x`` samples from those at ``x_a`` and ``x_b`` (lists that
    :func:`ops_line_up` has checked), each op on the line through its two sizes; made when first read:
    ``memfit fit`` asks most batches it draws for their bytes only, and a Llama's step has some 13,000
    ops to put on the line."""

    __slots__ = ("_line", "_ops")

    def __init__(self, a: list, b: list, x_a: int, x_b: int, x: int) -> None:
        self._line, self._ops = (a, b, x_a, x_b, x), None

    def _list(self) -> list:
        if self._ops is None:
            a, b, x_a, x_b, x = self._line
            self._ops, self._line = [_scaled(u, v, (x - x_a) / (x_b - x_a)) for u, v in zip(a, b)], None
        return self._ops

    def __len__(self) -> int:
        return len(self._ops) if self._ops is not None else len(self._line[0])

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())

    def __eq__(self, other) -> bool:
        return self._list() == (other._list() if isinstance(other, OpsOnLine) else other)

    __hash__ = None

    def __reduce__(self):  # (sent to another process as the list it is)
        return list, (self._list(),)
