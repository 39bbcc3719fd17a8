"""The CPU measurement puts back the frees the profiler does not see (NOTE [ Frees the profiler does
not see ] in memfit.memory.profiler_events).

gloo's reduce-scatter clones its input on the calling thread and all-reduces the clone on its
worker thread; when the caller has already dropped its work handle, the worker drops the last
reference, outside the profiled range, and no free is recorded. A one-rank gloo group in this
process shows it without other processes."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from memfit.memory.profiler_events import allocator_events, profiler_peak

NUMEL = 1 << 26  # 256 MiB of fp32: gloo's worker copies it for long enough that the caller has let go first
# (at 4 MiB a loaded CI run once lost that race in all 40 rounds, and at 64 MiB a fresh clone's suite on a
# 2-core machine did: a worker woken on a busy core can run the whole copy before the caller's next line;
# a copy longer than the scheduler's time slice gives the caller the core back first)
ROUNDS = 4


@pytest.fixture
def one_rank_gloo():
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rounds_of_async_reduce_scatter(x):
    for _ in range(ROUNDS):
        out = torch.empty(NUMEL)
        work = dist.reduce_scatter_tensor(out, x, async_op=True)
        del out, work  # the worker thread now holds the last references
        time.sleep(0.5)  # it has finished before the next round (a 64 MiB copy: milliseconds)


def _profiled_rounds(x):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("round"):
            _rounds_of_async_reduce_scatter(x)
    raw = [e.nbytes() for e in prof.profiler.kineto_results.events()
           if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    return prof, sum(raw) // (NUMEL * 4)


def test_frees_made_on_gloos_worker_thread_are_put_back(one_rank_gloo):
    x = torch.ones(NUMEL)
    nbytes = NUMEL * 4
    for _ in range(10):  # (which thread drops the last reference is up to the scheduler: almost always gloo's;
        # under a loaded CI run three tries once all lost the race)
        prof, lost = _profiled_rounds(x)
        if lost:
            break
    assert lost > 0, "every free was recorded: the case this corrects no longer happens (check the note)"
    # Each round holds at most the output and gloo's clone of the input: 2 blocks, whatever was lost.
    assert sum(n for _, n in allocator_events(prof)) == 0
    assert profiler_peak(prof, "round") == 2 * nbytes


def test_a_single_threaded_step_is_the_plain_running_sum():
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("step"):
            a = torch.ones(1000)
            b = a * 2
            del a
            c = b + 1
            del b, c
    raw = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                 if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    assert [n for _, n in allocator_events(prof)] == [n for _, n in raw]
    live, peak = 0, 0
    for _, n in raw:
        live += n
        peak = max(peak, live)
    assert peak >= 8000  # a and b together
    assert profiler_peak(prof, "step") == peak
