"""Prefetches and the ops that wait for them, kept right in the op list a shallow pair extrapolates.

A compute op that reads what a copy on the side stream wrote waits for that copy (a ``SIDE_STREAM``
H2D op: swapped blocks' weights, offloaded activations and optimizer states coming back): the
recorder gives both the storage's address as ``key``, and memfit.planner.timing.simulate makes the
first op reading a prefetched key wait for it. memfit.planner.shallow.extrapolate_ops builds the
full-depth step by repeating the stretch of ops that the deeper shallow trace has more; this module
gives each prefetch of the result a serial of its own and each op waiting for one its serial.
(Collectives and their ``WAIT`` ops carry serial numbers already, and keep them.)

NOTE [ Ops that wait for others, in the extrapolated ops ]
Repeating the stretch repeats its keys, and an address is handed out again once freed. Block swap
showed what that does: the prefetch of block k + 1 is issued as block k starts and read by block
k + 1, in the next copy of the stretch. Under one key for every copy, each block of Gemma-2-9B's LoRA
swapping all 42 waited for the next block's prefetch: 4.72 s from its shallow pair against 4.14 s from
its full trace. Where the old keys gave the full trace's time, they did so by luck: block 0's
weights, copied before it, had the addresses of block 2's prefetch.

So the waits are found in the deeper trace ``b`` and carried over as they were:
- an op in the stretch waiting for a prefetch in the stretch: that copy's prefetch;
- an op in the stretch waiting for a prefetch before it in the same run of ops (a phase of a
  micro-batch): in the first copy that prefetch, in copy c the prefetch one stretch later in ``b`` (as
  many prefetches later as the stretch makes; in the stretch, and the same copy: a block's prefetch of
  the same weight), of copy c - 1;
- otherwise the prefetch's one place (the last copy's, for a stretch's prefetch read after it).
Where the stretch starts is not unique (views and a block's first ops line up with the next block's
either way). memfit.planner.shallow._insertion takes the first place, by fewest unequal ops, that is a
block of the steady state (:func:`consistent`): each op of the stretch waiting for an earlier prefetch
finds it in the run, one stretch later; no op after the stretch waits for a prefetch before it (the
copies but the last would make what nothing waits for); and the stretch's ops wait for as many
prefetches as it makes. Block swap's stretch then starts with a block's prefetch, not with block 0's
compute, whose weights were copied before it or fetched by the last micro-batch's backward. A run
with no such place does not line up (the time is then the line through the pair's times).

NOTE [ Keys, not addresses ]
The recorder (memfit.planner.opcost) gave a copy and the op reading what it wrote the storage's
address as their key. The host's allocator hands an address out again once freed: in the optimizer
phase every op carried its first input's address, so one reading a new storage at a freed prefetch's
address waited for that copy, by chance, in one process and not in another (this module's test
failed in one CI run of several). :class:`Prefetched` gives each copy a serial number of its own,
kept for its storage while the storage lives.
"""

from __future__ import annotations

import bisect
import weakref

from memfit.planner.ops import (
    BACKGROUND,
    COMM,
    COMM_STREAM,
    HOST,
    OUT_STREAM,
    SCALAR,
    SIDE_STREAM,
    SYNC,
    VIEW,
    WAIT,
    WORKER,
)


def prefetches(op) -> bool:
    """``op`` is a copy to the device on the side stream, which the first op reading it waits for."""
    return bool(op.key) and bool(op.flags & SIDE_STREAM) and op.kind != COMM and not op.flags & COMM_STREAM


def waits_for_prefetch(op) -> bool:
    """An op that simulate runs on the compute stream after the prefetch of its key."""
    return op.kind not in (VIEW, SCALAR, SYNC, HOST, WAIT, COMM) and \
        not op.flags & (BACKGROUND | WORKER | COMM_STREAM | OUT_STREAM | SIDE_STREAM)


class Links:
    """Which prefetch each op of a recorded list waits for, and where extrapolation put its stretches."""

    def __init__(self, ops: list) -> None:
        prefetched: dict[int, int] = {}  # key -> its prefetch not waited for yet
        self.producer: dict[int, int] = {}
        """Consumer index -> the index of the prefetch it waits for."""
        self.made: list[int] = []
        """The indices of the prefetches."""
        first = next((i for i, op in enumerate(ops) if op.flags & SIDE_STREAM), None)  # (most steps: none)
        for i, op in enumerate(ops[first:] if first is not None else (), first or 0):
            if prefetches(op):
                prefetched[op.key] = i
                self.made.append(i)
            elif op.key in prefetched and waits_for_prefetch(op):
                self.producer[i] = prefetched.pop(op.key)
        self.consumers = sorted(self.producer)
        self.runs: list[tuple[int, int, int, int]] = []
        """(run start, stretch start, stretch end, run end) of each run, in order."""

    def between(self, lo: int, hi: int) -> list[int]:
        """The consumers with an index in [lo, hi)."""
        return self.consumers[bisect.bisect_left(self.consumers, lo):bisect.bisect_left(self.consumers, hi)]

    def made_in(self, lo: int, hi: int) -> int:
        return bisect.bisect_left(self.made, hi) - bisect.bisect_left(self.made, lo)

    def later(self, b: list, q: int, lo: int, hi: int) -> int | None:
        """The prefetch a stretch ``b[lo:hi]`` later than the prefetch ``b[q]``: as many prefetches later
        as the stretch makes; None unless it is in the stretch and the same op."""
        n, k = self.made_in(lo, hi), bisect.bisect_left(self.made, q) + self.made_in(lo, hi)
        r = self.made[k] if n and k < len(self.made) else None
        return r if r is not None and lo <= r < hi and b[r]._replace(key=0) == b[q]._replace(key=0) else None

    def run_of(self, i: int) -> tuple[int, int, int, int]:
        return self.runs[bisect.bisect_right([r[0] for r in self.runs], i) - 1]


def consistent(links: Links, b: list, start: int, lo: int, hi: int, end: int) -> bool:
    """The stretch ``b[lo:hi]`` of the run ``b[start:end]``, repeated, keeps every wait (NOTE [ Ops that wait
    for others, in the extrapolated ops ])."""
    if lo == hi:
        return True
    waited = set()  # the prefetches the stretch's ops wait for
    for o in links.between(start, end):
        q = links.producer[o]
        if lo <= o < hi and q < start:
            return False  # (each copy would need a prefetch of its own from an earlier run)
        if o >= hi and start <= q < lo:
            return False  # (the copies but the last would make what no op waits for)
        if lo <= o < hi and q < lo and links.later(b, q, lo, hi) is None:
            return False
        if lo <= o < hi:
            waited.add(q)
    return len(waited) == links.made_in(lo, hi)  # as many waited for as made: a block of the steady state


def relinked(out: list, images: list[list[int]], links: Links, b: list) -> list | None:
    """``out`` (made from ``b``: ``images[i]``, the indices in ``out`` of ``b[i]``) with a serial key for
    each prefetch and each op waiting for one its prefetch's; other compute ops' keys cleared, those of
    collectives kept (NOTE [ Ops that wait for others, in the extrapolated ops ]). None where an op's
    prefetch cannot be found so."""
    if not links.made:
        return out
    result = [op._replace(key=-i - 1) if prefetches(op) else op._replace(key=0) if op.key and waits_for_prefetch(op)
              else op for i, op in enumerate(out)]
    for o, q in links.producer.items():
        _, lo, hi, _ = links.run_of(o)
        for c, i in enumerate(images[o]):
            if lo <= o < hi and q >= lo:
                j = images[q][c]
            elif lo <= o < hi and c and q < lo:
                j = images[links.later(b, q, lo, hi)][c - 1]
            else:
                j = images[q][0 if lo <= o < hi else -1]
            if not prefetches(out[j]):
                return None
            result[i] = result[i]._replace(key=-j - 1)
    return result


class Prefetched:
    """The recorder's side-stream copies to the device, by the storage each wrote while it lives
    (NOTE [ Keys, not addresses ])."""

    def __init__(self) -> None:
        self._keys: dict[int, tuple[int, weakref.ref]] = {}
        """Storage address -> (the key of the copy that wrote it, the storage by weak reference)."""
        self._unread: dict[int, tuple[int, weakref.ref]] = {}
        """The same, for weights copied ahead in forward or backward and not read yet."""

    def copied(self, t, key: int, in_optimizer: bool) -> int:
        """A copy with serial ``key`` wrote ``t``: returns ``key``."""
        while_alive(self._keys, t.untyped_storage(), key)
        if not in_optimizer:
            while_alive(self._unread, t.untyped_storage(), key)
        return key

    def key_of(self, t) -> int:
        """The key of the copy that wrote ``t``'s storage (an optimizer state coming back), else 0."""
        hit = self._keys.get(t.untyped_storage()._cdata)
        return hit[0] if hit is not None and hit[1]() is not None else 0

    def first_read(self, ins) -> int:
        """The key of the copy of a weight fetched ahead that an op reading ``ins`` is the first to
        read (it waits for that copy), else 0."""
        if not self._unread:
            return 0
        for t in ins:
            hit = self._unread.pop(t.untyped_storage()._cdata, None)
            if hit is not None and hit[1]() is not None:
                return hit[0]
        return 0


def while_alive(table: dict, st, value=None) -> None:
    """``table[st._cdata] = (value, a weak reference to st)`` until ``st`` is freed: tables are keyed by a
    storage's address, which a later storage takes (its entry then replaces this one)."""
    key = st._cdata

    def freed(ref):
        if table.get(key, (None, None))[1] is ref:
            del table[key]
    table[key] = (value, weakref.ref(st, freed))
