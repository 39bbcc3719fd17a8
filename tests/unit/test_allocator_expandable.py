"""The expandable-segments allocator model against the rules of c10/cuda/CUDACachingAllocator.cpp
(``expandable_segments:True``), next to the default model on the same requests."""

import random

from memfit.memory.allocator import CachingAllocatorModel, round_size
from memfit.memory.expandable import LARGE_PAGE, SMALL_PAGE, ExpandableSegmentsModel

MiB = 2**20


def test_the_segment_grows_by_the_pages_a_request_lacks():
    a, d = ExpandableSegmentsModel(), CachingAllocatorModel()
    for m in (a, d):
        first = m.malloc(30 * MiB)
        m.free(first)
        m.malloc(50 * MiB)
    # default: the freed 30 MiB segment cannot hold 50 MiB, so a second segment opens (80 MiB);
    # expandable: the free 40 MiB at the end of the segment (30 MiB rounded to 20 MiB pages) takes
    # one more page (60 MiB)
    assert d.reserved == 80 * MiB and a.reserved == 3 * LARGE_PAGE


def test_blocks_split_whenever_512_bytes_remain():
    a, d = ExpandableSegmentsModel(), CachingAllocatorModel()
    for m in (a, d):
        m.malloc(15 * MiB + 512 * 1024)
    assert d.allocated == 16 * MiB  # the default leaves a 512 KiB remainder in the block
    assert a.allocated == 15 * MiB + 512 * 1024 and a.reserved == LARGE_PAGE


def test_small_requests_map_2_mib_pages_of_their_own_segment():
    a = ExpandableSegmentsModel()
    a.malloc(1000)
    a.malloc(3 * MiB)
    assert a.reserved == SMALL_PAGE + LARGE_PAGE


def test_streams_do_not_share_a_segment():
    a = ExpandableSegmentsModel()
    x = a.malloc(10 * MiB, stream=1)
    a.free(x)
    a.malloc(10 * MiB, stream=0)
    assert a.reserved == 2 * LARGE_PAGE


def test_empty_cache_unmaps_the_pages_inside_free_blocks():
    a = ExpandableSegmentsModel()
    x, y = a.malloc(50 * MiB), a.malloc(10 * MiB)  # 60 MiB mapped: x in pages 0-2, y in page 2
    a.free(x)
    a.empty_cache()
    assert a.reserved == LARGE_PAGE  # pages 0 and 1 lay wholly in the free block; page 2 holds y
    a.malloc(40 * MiB)  # the unmapped hole at the start is mapped again
    assert a.reserved == 3 * LARGE_PAGE
    a.free(y)


def test_random_requests_keep_the_books():
    """Any sequence: allocated is the rounded live requests, reserved the mapped pages, and the
    blocks of a segment tile it with no two free (or unmapped) neighbours left unmerged."""
    rng = random.Random(0)
    for _ in range(40):
        a, live = ExpandableSegmentsModel(), []
        for _ in range(200):
            if live and rng.random() < 0.45:
                block, _ = live.pop(rng.randrange(len(live)))
                a.free(block)
            else:
                size = int(rng.choice([100, 4000, 600_000, 3 * MiB, 15 * MiB, 90 * MiB]) * rng.uniform(0.5, 1.5))
                live.append((a.malloc(size, stream=rng.choice([0, 0, 1])), size))
            if rng.random() < 0.02:
                a.empty_cache()
            assert a.allocated == sum(round_size(s) for _, s in live) <= a.reserved
        mapped = 0
        for holes in a._unmapped.values():
            block = holes[0][1]
            while block.prev is not None:
                block = block.prev
            while block is not None:
                mapped += block.size if block.state != "unmapped" else 0
                assert block.next is None or block.state == "used" or block.next.state != block.state
                block = block.next
        assert mapped == a.reserved
