"""A model of the CUDA caching allocator with ``expandable_segments:True``.

With PyTorch's default settings every cudaMalloc is a segment of its own (a 20 MiB one for
requests under 10 MiB, else the request rounded to 2 MiB): a block freed in one segment can only
serve requests that fit inside that segment, so a step whose tensors change size from phase to
phase (per-parameter gradients, then optimizer states, then activations) keeps segments it can no
longer fill. ``memory_reserved`` then stands well above ``memory_allocated``: the fragmentation
that turns a 14 GiB step into a 26 GiB one (memfit.memory.allocator).

``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (c10/cuda/CUDACachingAllocator.cpp,
NOTE [Expandable Segments]) reserves one large virtual address range per stream and pool and
maps physical pages into it on demand (20 MiB pages for the large pool, 2 MiB for the small one):

- a request first takes the best-fitting free block already mapped, as by default;
- failing that, the allocator takes the lowest unmapped stretch (with the free block just before
  it, when there is one) and maps only the pages the request still lacks; the new pages merge
  with that free block, so the end of the segment grows by the shortfall, not by a new segment;
- a block is split whenever at least 512 bytes remain (by default only large-pool blocks with
  more than 1 MiB left are), so ``memory_allocated`` counts the requests' rounded sizes;
- ``empty_cache`` unmaps the pages that lie wholly inside free blocks.

Reserved bytes are the mapped pages. What it costs: a driver call per mapping (the first steps
only, as the segment grows to its steady size); nothing per step after that.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from memfit.memory.allocator import MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, CachingAllocatorModel, round_size

LARGE_PAGE = 20 << 20
"""Pages of the large pool's expandable segments (kLargeBuffer)."""
SMALL_PAGE = SMALL_BUFFER
"""Pages of the small pool's expandable segments (kSmallBuffer)."""
_ADDRESS_SPACE = 1 << 60
"""Virtual bytes of one segment: PyTorch reserves 1 1/8 of the GPU's memory; more than any trace."""


@dataclass(eq=False)
class _Block:
    offset: int
    size: int
    state: str  # "used" | "free" (mapped) | "unmapped"
    key: tuple[int, bool]
    prev: _Block | None = None
    next: _Block | None = None


class ExpandableSegmentsModel:
    """Same interface as memfit.memory.allocator.CachingAllocatorModel: ``malloc``, ``free``,
    ``empty_cache``, and the ``allocated`` / ``reserved`` bytes and their peaks."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self._free: dict[tuple[int, bool], list[tuple[int, int, _Block]]] = {}
        self._unmapped: dict[tuple[int, bool], list[tuple[int, _Block]]] = {}

    # -- requests ----------------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0) -> _Block:
        size = round_size(size)
        key = (stream, size <= SMALL_SIZE)
        pool = self._free.get(key)
        if pool is None:
            pool = self._free[key] = []
        i = bisect.bisect_left(pool, (size,))
        block = pool.pop(i)[2] if i < len(pool) else self._expand(key, size)
        remaining = block.size - size
        if remaining >= MIN_BLOCK:
            nxt = block.next
            rest = _Block(block.offset + size, remaining, "free", key, block, nxt)
            if nxt is not None:
                nxt.prev = rest
            block.next, block.size = rest, size
            bisect.insort(self._free[key], (remaining, rest.offset, rest))
        block.state = "used"
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: _Block) -> None:
        self.allocated -= block.size
        block.state = "free"
        block = self._merge(block)
        self._insert_free(block)

    def empty_cache(self) -> None:
        """Unmap the pages wholly inside free blocks (what ``torch.cuda.empty_cache()`` releases)."""
        for key, pool in self._free.items():
            page = SMALL_PAGE if key[1] else LARGE_PAGE
            for _, _, block in list(pool):
                begin = -(-block.offset // page) * page
                end = (block.offset + block.size) // page * page
                if end <= begin:
                    continue
                self._remove_free(block)
                if end < block.offset + block.size:
                    after = self._split(block, end - block.offset)
                    self._insert_free(after)
                if begin > block.offset:
                    block = self._split(block, begin - block.offset)
                    self._insert_free(block.prev)
                block.state = "unmapped"
                self.reserved -= block.size
                self._add_unmapped(self._merge(block))

    # -- growing the segment -----------------------------------------------------------------
    def _expand(self, key: tuple[int, bool], size: int) -> _Block:
        """Map pages for a request no free block fits (find_expandable_block and
        try_allocate_expandable_block); returns a free mapped block of at least ``size``."""
        holes = self._unmapped.get(key)
        if not holes:
            self._add_unmapped(_Block(0, _ADDRESS_SPACE, "unmapped", key))
            holes = self._unmapped[key]
        for _, hole in holes:
            start = hole.prev if hole.prev is not None and hole.prev.state == "free" else hole
            room, b = 0, start
            while room < size and b is not None and b.state != "used":
                room, b = room + b.size, b.next
            if room >= size:
                break
        candidate = start if start.state == "free" else self._map(start, min(start.size, size))
        while candidate.size < size:
            candidate = self._map(candidate.next, min(size - candidate.size, candidate.next.size))
        self._remove_free(candidate)
        return candidate

    def _map(self, hole: _Block, nbytes: int) -> _Block:
        """Map the pages covering the first ``nbytes`` of unmapped ``hole``; returns the free block
        they become, merged with free neighbours."""
        page = SMALL_PAGE if hole.key[1] else LARGE_PAGE
        mapped = min(hole.size, -(-nbytes // page) * page)
        self._remove_unmapped(hole)
        if mapped < hole.size:
            self._add_unmapped(self._split(hole, mapped))
        hole.state = "free"
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        block = self._merge(hole)
        self._insert_free(block)
        return block

    # -- the block list ----------------------------------------------------------------------
    def _split(self, block: _Block, at: int) -> _Block:
        """Cut ``block`` at ``at`` bytes; returns the second part (same state)."""
        rest = _Block(block.offset + at, block.size - at, block.state, block.key, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, at
        return rest

    def _merge(self, block: _Block) -> _Block:
        """Merge ``block`` (in no list) with its neighbours of the same state (taken out of theirs)."""
        for nb in (block.prev, block.next):
            if nb is None or nb.state != block.state:
                continue
            if nb.state == "free":
                self._remove_free(nb)
            elif nb.state == "unmapped":
                self._remove_unmapped(nb)
            first, second = (nb, block) if nb is block.prev else (block, nb)
            first.size += second.size
            first.next = second.next
            if second.next is not None:
                second.next.prev = first
            block = first
        return block

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free.setdefault(block.key, []), (block.size, block.offset, block))

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.key]
        i = bisect.bisect_left(pool, (block.size, block.offset))
        assert pool[i][2] is block, "block not in its free list"
        pool.pop(i)

    def _add_unmapped(self, block: _Block) -> None:
        bisect.insort(self._unmapped.setdefault(block.key, []), (block.offset, block))

    def _remove_unmapped(self, block: _Block) -> None:
        holes = self._unmapped[block.key]
        holes.pop(bisect.bisect_left(holes, (block.offset,)))


def new_model(expandable: bool = False) -> CachingAllocatorModel | ExpandableSegmentsModel:
    """A fresh model of the allocator: PyTorch's default settings, or ``expandable_segments``."""
    return ExpandableSegmentsModel() if expandable else CachingAllocatorModel()
