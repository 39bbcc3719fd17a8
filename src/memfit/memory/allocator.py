"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), default settings.

Why it matters: ``torch.cuda.memory_allocated`` counts blocks, not tensors, and
``memory_reserved`` counts the segments obtained with cudaMalloc, which the allocator keeps and
reuses but never returns unless asked (``empty_cache``). What decides an OOM is reserved memory
plus the CUDA context, so a prediction must replay the allocation sequence through the same rules:

- every request is rounded up to a multiple of 512 bytes;
- requests <= 1 MiB come from the small pool, carved from 2 MiB segments; larger ones from the
  large pool: a new segment is 20 MiB for requests < 10 MiB, else the request rounded up to 2 MiB;
- a request takes the best-fitting (smallest sufficient) cached block of its pool, split when
  the remainder is >= 512 B (small pool) or > 1 MiB (large pool); an unsplit block is counted
  whole in ``memory_allocated``;
- freed blocks merge with free neighbours of the same segment.

- each stream has its own pools: a block allocated on a side stream (e.g. the prefetch stream of
  offloaded optimizer states) returns to that stream's pool and is reused only by that stream.

``expandable_segments:True`` is modelled by memfit.memory.expandable (the ``allocator`` plan key).
Not modelled: ``max_split_size_mb``, ``roundup_power2_divisions``, and
the retry that frees cached blocks when cudaMalloc fails.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    """Bytes of the block a request of ``size`` gets; 0 for 0 (the allocator returns a null
    pointer for an empty tensor and allocates nothing)."""
    if size <= 0:
        return 0
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


@dataclass(slots=True)
class _Block:
    segment: int
    offset: int
    size: int
    free: bool
    small: bool
    prev: _Block | None = None
    next: _Block | None = None
    stream: int = 0


class CachingAllocatorModel:
    """``on_segment(action, head)``: told of each new segment (``"segment_alloc"``, before its first
    block is split) and each segment ``empty_cache`` releases (``"segment_free"``); ``head`` is the
    segment's first block, which lives as long as the segment (merges keep the lower block)."""

    def __init__(self, on_segment=None) -> None:
        self.on_segment = on_segment
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        # (stream, small?) -> free blocks sorted by (size, segment, offset)
        self._free: dict[tuple[int, bool], list[tuple[int, int, int, _Block]]] = {}
        self._segments = 0

    def malloc(self, size: int, stream: int = 0) -> _Block:
        # (round_size inlined: the replays of ``memfit fit`` make millions of calls)
        size = 0 if size <= 0 else MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)
        small = size <= SMALL_SIZE
        key = (stream, small)
        pool = self._free.get(key)
        if pool is None:
            pool = self._free[key] = []
        i = bisect.bisect_left(pool, (size,))  # (the first block of at least ``size``: ties by segment, offset)
        if i < len(pool):
            block = pool.pop(i)[3]
        else:
            seg = segment_size(size)
            self.reserved += seg
            if self.reserved > self.peak_reserved:
                self.peak_reserved = self.reserved
            block = _Block(self._segments, 0, seg, True, small, None, None, stream)
            self._segments += 1
            if self.on_segment is not None:
                self.on_segment("segment_alloc", block)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            nxt = block.next
            rest = _Block(block.segment, block.offset + size, remaining, True, small, block, nxt, block.stream)
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = size
            bisect.insort(pool, (remaining, rest.segment, rest.offset, rest))
        block.free = False
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: _Block) -> None:
        self.allocated -= block.size
        block.free = True
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            self._remove(prev)
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            self._remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        self._insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: segments with nothing allocated in them are released."""
        for key, pool in self._free.items():
            whole = [entry for entry in pool if entry[3].prev is None and entry[3].next is None]
            for entry in whole:
                self.reserved -= entry[3].size
                if self.on_segment is not None:
                    self.on_segment("segment_free", entry[3])
            self._free[key] = [entry for entry in pool if not (entry[3].prev is None and entry[3].next is None)]

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._free.setdefault((block.stream, block.small), []),
                      (block.size, block.segment, block.offset, block))

    def _remove(self, block: _Block) -> None:
        pool = self._free[(block.stream, block.small)]
        i = bisect.bisect_left(pool, (block.size, block.segment, block.offset))
        while pool[i][3] is not block:
            i += 1
        pool.pop(i)


def replay(tracker, device: str, window, streams: dict[int, int] | None = None, *, model=None,
           on_block=None) -> tuple[int, int, int]:
    """Replay a tracked timeline through the allocator model; ``streams`` maps the serial of a
    storage allocated on a side stream to that stream's number (default: stream 0).

    ``model``: the :class:`CachingAllocatorModel` to replay into (default: a new one);
    ``on_block(index, serial, sign, block)``: told of each block just after it is allocated
    (``sign`` +1) and just before it is freed (-1), as memfit.memory.snapshot records them.

    Returns (peak allocated bytes in the window, reserved bytes at the end of the window, event
    index of the allocated peak). Reserved memory only grows, but where the step empties the cache
    (an ``empty_cache`` mark: after FSDP2 sharded a model built whole), so its value at the end of
    the window is its peak.
    """
    recs = tracker.state.records
    emptied = {at for name, _, at in tracker.state.marks if name == "empty_cache"}

    def events():
        for i, (serial, sign) in enumerate(tracker.state.events[:window.end]):
            if i in emptied:
                yield i, None, 0, 0, 0
            rec = recs[serial]
            if rec.device == device and rec.nbytes != 0:
                yield i, serial, sign, rec.nbytes, streams.get(serial, 0) if streams and sign > 0 else 0
    return replay_events(events(), window.start, model=model, on_block=on_block)


def replay_events(events, start: int, *, model=None, on_block=None) -> tuple[int, int, int]:
    """The replay behind :func:`replay` (and memfit.memory.deep_stream's): ``events`` are
    ``(index, key, sign, nbytes, stream)`` in order, up to the window's end (``sign`` +1 allocates
    ``nbytes`` on ``stream`` for ``key``, -1 frees ``key``'s block, 0 empties the cache); the peak
    counts from ``index`` ``start`` on. Returns (peak allocated bytes, reserved bytes at the end,
    index of the peak)."""
    model = CachingAllocatorModel() if model is None else model
    blocks: dict = {}
    peak, peak_at = -1, start
    for i, key, sign, nbytes, stream in events:
        if sign == 0:
            model.empty_cache()
            continue
        if sign > 0:
            blocks[key] = model.malloc(nbytes, stream)
            if on_block is not None:
                on_block(i, key, 1, blocks[key])
        elif key in blocks:
            if on_block is not None:
                on_block(i, key, -1, blocks[key])
            model.free(blocks.pop(key))
        if i >= start and model.allocated > peak:
            peak, peak_at = model.allocated, i
    if peak < 0:
        peak = model.allocated
    return peak, model.reserved, peak_at
