"""The CUDA caching allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp."""

from memfit.memory.allocator import (
    LARGE_BUFFER,
    SMALL_BUFFER,
    CachingAllocatorModel,
    round_size,
    segment_size,
)

MiB = 2**20


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert segment_size(100) == SMALL_BUFFER
    assert segment_size(MiB + 1) == LARGE_BUFFER
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_small_blocks_share_a_segment():
    a = CachingAllocatorModel()
    blocks = [a.malloc(1000) for _ in range(4)]
    assert a.allocated == 4 * 1024 and a.reserved == SMALL_BUFFER
    for b in blocks:
        a.free(b)
    assert a.allocated == 0 and a.reserved == SMALL_BUFFER  # cached, not returned


def test_freed_blocks_are_reused_and_merged():
    a = CachingAllocatorModel()
    x, y = a.malloc(4 * MiB), a.malloc(4 * MiB)  # both carved from one 20 MiB segment
    assert a.reserved == LARGE_BUFFER
    a.free(x)
    a.free(y)  # merges back into one 20 MiB free block
    z = a.malloc(16 * MiB)
    assert a.reserved == LARGE_BUFFER and z.size == 16 * MiB


def test_large_remainder_not_split_below_threshold():
    a = CachingAllocatorModel()
    b = a.malloc(12 * MiB)          # a 12 MiB segment
    a.free(b)
    c = a.malloc(11 * MiB + 512)    # remainder < 1 MiB: the whole block is handed out
    assert c.size == 12 * MiB and a.allocated == 12 * MiB


def test_fragmentation_grows_reserved():
    a = CachingAllocatorModel()
    blocks = [a.malloc(8 * MiB) for _ in range(4)]  # 2 per 20 MiB segment, 4 MiB left each
    assert a.reserved == 2 * LARGE_BUFFER
    a.free(blocks[0])
    a.free(blocks[2])
    a.malloc(14 * MiB)  # 12 MiB free in each segment, none fits: a new segment
    assert a.reserved == 2 * LARGE_BUFFER + 14 * MiB  # >= 10 MiB: a segment of its own size
    assert a.peak_allocated == 32 * MiB


def test_zero_byte_requests_take_no_block():
    a = CachingAllocatorModel()
    assert round_size(0) == 0
    b = a.malloc(0)
    assert a.allocated == 0 and b.size == 0


def test_each_stream_reuses_only_its_own_blocks():
    """A block freed by a side stream (e.g. prefetched optimizer states) stays in that stream's
    pool: the default stream cannot reuse it and needs a segment of its own."""
    a = CachingAllocatorModel()
    side = a.malloc(12 * MiB, stream=1)
    a.free(side)
    a.malloc(12 * MiB, stream=0)
    assert a.reserved == 24 * MiB
    a.malloc(12 * MiB, stream=1)  # the side stream gets its cached block back
    assert a.reserved == 24 * MiB


def test_empty_cache_releases_only_segments_with_nothing_allocated():
    a = CachingAllocatorModel()
    whole = a.malloc(100 * MiB)            # a segment of its own, freed whole
    _kept, neighbour = a.malloc(12 * MiB), a.malloc(20 * MiB)
    a.free(whole)
    a.free(neighbour)
    assert a.reserved == 132 * MiB
    a.empty_cache()
    assert a.reserved == 12 * MiB and a.allocated == 12 * MiB  # the segment still in use stays
    again = a.malloc(100 * MiB)
    assert a.reserved == 112 * MiB and again.size == 100 * MiB
