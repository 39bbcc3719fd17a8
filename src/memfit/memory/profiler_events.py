"""The CPU measurement: the peak of live allocator bytes, from the PyTorch profiler's events.

The profiler (``profile_memory=True``) records every allocation and free of PyTorch's CPU
allocator made on a thread that carries the profiler's thread-local state: the Python thread,
autograd's threads, and a collective backend's worker thread *while it runs a collective* (gloo
hands the caller's thread-local state to the work it runs). The running sum of those events, from
before the model was built, is the live bytes of everything memfit created.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

COLLECTIVE = "c10d::"
"""A collective called on the calling thread (``c10d::_allgather_base_``, ...)."""
WORK = "gloo:"
"""A collective's work on the backend's worker thread (``gloo:all_gather``, ...)."""
_BUFFER_ARGUMENT = {"c10d::_allgather_base_": 0, "c10d::_reduce_scatter_base_": 1}
"""The argument of a collective that is a buffer made for it (FSDP2's flat all-gather output, its
flat reduce-scatter input): freed once the collective is done with it. (The others are views of
what lives on: the sharded parameters gathered from, the sharded gradients reduced into.)"""
COPY_OUT = "FSDP::all_gather_copy_out"
"""Where FSDP2 reads a gathered flat buffer after the all-gather (then lets go of it)."""


@dataclass
class _Block:
    time: int
    nbytes: int
    held_until: int | None = None
    """When the collective that held it (allocated inside it, or passed to it) was done with it."""


@dataclass
class _Profile:
    allocs: list = field(default_factory=list)  # (time, ptr, bytes, inside a collective's call: its start)
    calls: list = field(default_factory=list)  # (start, name, storage pointers of its tensor arguments)
    work: list = field(default_factory=list)  # (start, end) of a backend worker's collectives
    copy_outs: list = field(default_factory=list)  # (start, end)
    done: dict = field(default_factory=dict)  # a call's start -> when it was done with its buffers (pair)

    def pair(self) -> None:
        """Sort what was read, and pair each collective call with its work on the worker thread
        and each all-gather with FSDP2's copy out of its result. gloo runs its queue first in,
        first out, so the k-th call's work is the k-th work, when every call's work was recorded;
        otherwise each call takes the first work that starts after it."""
        self.allocs.sort(key=lambda a: (a[0], a[2]))  # (a free before an allocation at the same time)
        self.calls.sort(key=lambda c: c[0])
        self.work.sort()
        self.copy_outs.sort()
        in_order = len(self.work) == len(self.calls)
        gathers = {c[0]: k for k, c in enumerate(c for c in self.calls if "allgather" in c[1])}
        copies_in_order = len(self.copy_outs) == len(gathers)
        for k, (start, name, _) in enumerate(self.calls):
            if in_order:
                work = self.work[k]
            else:
                i = bisect_left(self.work, (start,))
                if i == len(self.work):
                    continue
                work = self.work[i]
            done = work[1]
            if "allgather" in name:
                if copies_in_order:
                    done = max(done, self.copy_outs[gathers[start]][1])
                else:
                    j = bisect_left(self.copy_outs, (done,))
                    if j < len(self.copy_outs):
                        done = max(done, self.copy_outs[j][1])
            self.done[start] = done


def _walk_trees(roots, into: _Profile) -> None:
    """Read the event trees into ``into``, each depth first, in the profiler's order (a loop, not a
    recursion nor a call per tree: a measured step's trees hold millions of events, most of them roots
    of their own on the CPU, and a call per event was most of the reading)."""
    from torch._C._profiler import _EventType

    allocation, torch_op = _EventType.Allocation, _EventType.TorchOp
    allocs, work, copy_outs, calls = into.allocs, into.work, into.copy_outs, into.calls
    stack = [(root, None) for root in reversed(roots)]
    while stack:
        node, call = stack.pop()
        tag = node.tag
        if tag == allocation:
            ex = node.extra_fields
            if ex.device.type == "cpu":
                allocs.append((node.start_time_ns, ex.ptr, ex.alloc_size, call))
            continue
        name = node.name
        if name.startswith(WORK):
            work.append((node.start_time_ns, node.end_time_ns))
        elif name.startswith(COPY_OUT):
            copy_outs.append((node.start_time_ns, node.end_time_ns))
        elif name.startswith(COLLECTIVE) and call is None and tag == torch_op:
            ptrs = {getattr(x, "storage_data_ptr", None) for i, x in enumerate(node.extra_fields.inputs)
                    if i == _BUFFER_ARGUMENT.get(name.split(".")[0])} - {None}
            call = (node.start_time_ns, name)
            calls.append((*call, ptrs))
        children = node.children
        if children:
            stack.extend((child, call) for child in reversed(children))


# NOTE [ Frees the profiler does not see ]
# One kind of free escapes it: a block whose last reference a backend worker thread drops, after
# the collective's profiled range has closed. gloo's ``_reduce_scatter_base_`` clones its input on the
# calling thread and all-reduces the clone on its worker thread, which drops the clone when it
# releases the work object; a buffer the caller passed in (FSDP2's flat all-gather buffer) goes the
# same way whenever the caller has let go of it first, which depends on how the threads are
# scheduled. No free event is recorded, and the block's address is simply allocated again later. A
# running sum counts such a block until the end of the profile, so the measured peak of a 2-rank
# FSDP2 step on gloo came out 2-19% above the bytes that were live, varying from run to run.
#
# The measurement therefore pairs allocations with frees by address, and puts back the free of a
# block a collective held: one allocated inside a collective's call, or made for one and passed to it
# (``_BUFFER_ARGUMENT``: the profile records the collectives' arguments in a process group of several
# ranks). Such a block whose free
# was not recorded (its address came back, or it was never freed) is taken as freed when the
# collective was done with it: when its work on the worker thread ended (the first that started after
# the call), and for an all-gather when FSDP2's copy out of the gathered buffer that follows ended,
# which is when the calling thread lets go of it when the threads run in the other order. Any other
# block whose address came back without a free is taken as freed just before; any other block never
# freed may still be live and counts as live. One process's steps, with no collective, are measured
# exactly as by the running sum (test).
def allocator_events(prof) -> list[tuple[int, int]]:
    """(time in ns, +bytes | -bytes) of every CPU allocation and free, sorted by time, with the frees
    the profiler missed put back (NOTE [ Frees the profiler does not see ]). Needs a profile taken
    with ``record_shapes=True`` (a collective's arguments) to put back the frees of buffers passed
    to collectives."""
    run = _Profile()
    _walk_trees(prof.profiler.kineto_results.experimental_event_tree(), run)
    run.pair()
    events: list[tuple[int, int]] = []
    live: dict[int, _Block] = {}
    passed: dict[int, list] = {}  # storage pointer -> the starts of the calls it was passed to, in order
    for start, _, ptrs in run.calls:
        for ptr in ptrs:
            passed.setdefault(ptr, []).append(start)
    for t, ptr, nbytes, call in run.allocs:
        if nbytes > 0:
            lost = live.pop(ptr, None)
            if lost is not None:  # allocated again: its free was not recorded
                events.append((_lost_free_time(lost, run, passed.get(ptr, ()), t), -lost.nbytes))
            held = run.done.get(call[0]) if call is not None else None
            live[ptr] = _Block(t, nbytes, held)
        else:
            live.pop(ptr, None)
        events.append((t, nbytes))
    for ptr, block in live.items():  # never freed, never allocated again
        freed = _lost_free_time(block, run, passed.get(ptr, ()), None)
        if freed is not None:
            events.append((freed, -block.nbytes))
    events.sort(key=lambda e: (e[0], e[1]))  # (at the same time, frees first)
    return events


def _lost_free_time(block: _Block, run: _Profile, calls, reallocated_at: int | None) -> int | None:
    """When a block whose free was not recorded was freed. Held by a collective (made inside one, or
    passed to the last one that took it before its address came back): when that collective was done
    with it. Otherwise: just before its address came back, or, never allocated again, not at all (it
    may simply still be live)."""
    held = block.held_until
    for start in calls:
        if start >= block.time and (reallocated_at is None or start < reallocated_at):
            held = run.done.get(start)
    if held is not None and (reallocated_at is None or held < reallocated_at):
        return held
    return None if reallocated_at is None else reallocated_at - 1


def memory_profiler():
    """A profiler of the CPU allocator's events; in a process group of several ranks it records the
    collectives' arguments too (``record_shapes``), so the frees of what they held can be put back."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    dist = torch.distributed
    ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=ranks)


def profiler_peak(prof, range_name: str) -> int:
    """Peak live CPU-allocator bytes inside ``range_name``, from the profiler's allocator events."""
    kineto = prof.profiler.kineto_results.events()
    ranges = [(e.start_ns(), e.end_ns()) for e in kineto if e.name() == range_name]
    if not ranges:
        raise RuntimeError(f"profiler: range {range_name!r} not found; the profiler API may have changed")
    start, end = ranges[0]
    mem = allocator_events(prof)
    if not mem:
        raise RuntimeError("profiler: no allocator events recorded; the profiler API may have changed")
    live, peak, at_start = 0, None, None
    for t, nbytes in mem:
        if t >= start and at_start is None:
            at_start = live
        if t > end:
            break
        live += nbytes
        if t >= start:
            peak = live if peak is None else max(peak, live)
    return peak if peak is not None else (at_start if at_start is not None else live)


MARK_BYTES = 12_345_677
"""An allocation of this many bytes, made and freed at once (:func:`mark`): where a step starts in the profiler's
stream."""


def mark() -> None:
    """A mark in the profiler's stream (before the step whose peak :func:`peak_after_mark` reads)."""
    import torch
    torch.empty(MARK_BYTES, dtype=torch.uint8)


def peak_after_mark(prof) -> int:
    """The most bytes live on the CPU allocator after the :func:`mark`, counted from the profile's first allocation
    (a user's loop measured as memfit predicts it: what it built and loaded, and the step's own)."""
    live, peak, marked = 0, 0, False
    for _, nbytes in allocator_events(prof):
        if abs(nbytes) == MARK_BYTES:
            marked = True
            continue
        live += nbytes
        if marked:
            peak = max(peak, live)
    if not marked:
        raise RuntimeError("profiler: no mark in the profile")
    return peak
