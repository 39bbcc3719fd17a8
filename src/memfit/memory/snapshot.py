"""Snapshots in the format of ``torch.cuda.memory._snapshot()``, to open in PyTorch's memory_viz.

People who debug CUDA memory know https://pytorch.org/memory_viz: drop a snapshot pickle on it and
see every allocation over time ("Active Memory Timeline"), the allocator's segments and blocks at
any event ("Allocator State History"), and where each block came from. memfit writes the same file
for a *prediction*, so a plan can be looked at with that tool before any GPU runs it:

- ``estimate --snapshot``: the fake trace, from the model's build to the end of the steady-state
  step. On a GPU preset the addresses, segments and block splits are those of memfit's
  caching-allocator model (memfit.memory.allocator): the segments at the end sum to the predicted
  reserved bytes. On ``cpu`` there is no cache to show: each allocation is its own segment.
- ``profile --snapshot``: the real run. On a CPU from the same tracker on real tensors (the
  profiler gives the measured peak but keeps no owners); on a CUDA GPU the caching allocator's own
  ``_snapshot()``, recorded over the steady-state step and written as it is.

A trace has no Python stacks: each allocation gets three frames, innermost first: the op
(``op:0:addmm``), the module with the allocation's memory category
(``GPT2LMHeadModel.transformer.h.0.mlp:0:activations``), and the step with its phase
(``step:2:backward``). Parameters, their gradients and optimizer states are made outside any
module's forward: they are named by the parameter (``GPT2LMHeadModel.lm_head.weight.exp_avg``).
Trace entries carry the category too: the timeline is coloured by category.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.errors import UserError
from memfit.memory import allocator
from memfit.memory.categories import STEADY_STEP
from memfit.memory.report import step_window, traced_device
from memfit.memory.tracker import POINTS, MemoryTracker
from memfit.outputs import check_output_file

PROTOCOL = 4
SUFFIXES = (".pickle", ".pkl")
BASE_ADDRESS = 0x7F00_0000_0000
"""The first segment's address: CUDA-like, and below 2**53 (the viewer reads addresses as JavaScript numbers)."""
SEGMENT_ALIGNMENT = 2 << 20
CPU_ALIGNMENT = 64


# NOTE [ Snapshot sizes are block sizes ]
# A CUDA trace's ``alloc`` entry carries the requested bytes; memfit's carry the block's bytes (the
# request rounded up, plus an unsplit remainder): what ``memory_allocated`` counts and
# ``MemoryReport.peak_bytes`` predicts, so the timeline's top is the predicted peak. The requested
# bytes are each live block's ``requested_size``. Only the device's memory is in the snapshot, as in
# ``peak_bytes``: offloaded (host) tensors are not.
def check_snapshot_path(path: str | Path) -> Path:
    """Fail before the work if ``path`` cannot be written (the one-line error names the fix)."""
    return check_output_file(path, "--snapshot", example="snapshot.pickle", suffixes=SUFFIXES)


def save_snapshot(run, path: str | Path, *, target, report, kind: str = "prediction") -> Path:
    """Write the snapshot of ``run`` (a memfit.memory.faketrace.TrackedRun of ``target``, a
    memfit.target.Target) whose report is ``report``."""
    tracker = run.tracker
    device = traced_device(target.device, report.method, target.tensor_device)
    gpu = target.device.is_gpu
    streams = getattr(tracker, "side_streams", None) if gpu else None
    snap = tracker_snapshot(tracker, device, cached=gpu, streams=streams, names=tensor_names(run),
                            info=_info(target, report, kind))
    return write_snapshot(snap, path)


def save_allocator_snapshot(snapshot: dict[str, Any], path: str | Path, *, target, report) -> Path:
    """Write a CUDA run's own ``torch.cuda.memory._snapshot()`` (memfit.memory.cuda_history records
    it over the steady-state step) as it is, with the ``memfit`` entry added."""
    return write_snapshot({**snapshot, "memfit": _info(target, report, "measurement")}, path)


def _info(target, report, kind: str) -> dict[str, Any]:
    return {"kind": kind, "workload": target.workload.name, "device": target.device.name,
            "batch_size": target.batch_size, "method": report.method, "report_peak_bytes": report.peak_bytes,
            "reserved_bytes": report.reserved_bytes}


def tensor_names(run) -> dict[int, str]:
    """Tracker serial -> name, for the step's parameters, their ``.grad`` and optimizer states
    (``.exp_avg``, ...) and the model's buffers, as they are at the end of the run."""
    step, token = run.step, run.tracker.storages.token
    root = type(step.model).__name__
    names: dict[int, str] = {}

    def put(t, name: str) -> None:
        serial = token(t) if isinstance(t, torch.Tensor) else None
        if serial is not None:
            names.setdefault(serial, name)

    states = getattr(step.optimizer, "state", {})
    for name, p in step.model.named_parameters():
        full = f"{root}.{name}"
        put(p, full)
        put(p.grad, f"{full}.grad")
        state = states.get(p)
        for key, value in (state.items() if isinstance(state, dict) else ()):
            put(value, f"{full}.{key}")
    for name, b in step.model.named_buffers():
        put(b, f"{root}.{name}")
    return names


# NOTE [ memory_viz's loader ]
# The viewer (torch/utils/viz/MemoryViz.js) unpickles with its own reader, which knows protocols 2-4
# and the opcodes of dicts, lists, tuples, str, int, float, bool and None: the snapshot holds nothing
# else and is written with protocol 4. It puts a block at its segment's address plus the sizes of the
# blocks before it, so a segment's blocks tile it in address order, free ones included. A trace with
# categories must also name the category ``unknown`` (else the viewer fails on a misspelt name); the
# closing ``snapshot`` entry does.
def write_snapshot(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Pickle ``snapshot`` to ``path`` the way memory_viz reads it (see NOTE [ memory_viz's loader ])."""
    path = Path(path)
    try:
        with open(path, "wb") as f:
            pickle.dump(snapshot, f, protocol=PROTOCOL)
    except OSError as e:
        raise UserError(f"cannot write --snapshot {str(path)!r} ({e.strerror or type(e).__name__}); "
                        "choose a writable file, e.g. --snapshot snapshot.pickle") from None
    return path


def tracker_snapshot(tracker: MemoryTracker, device: str, *, cached: bool, streams: dict[int, int] | None = None,
                     step: int = STEADY_STEP, names: dict[int, str] | None = None,
                     info: dict[str, Any] | None = None) -> dict[str, Any]:
    """The snapshot of what ``tracker`` saw on ``device``, from its first event to the end of ``step``.

    ``cached``: replay through the caching-allocator model, as the report of a GPU target does
    (``streams`` as in :func:`memfit.memory.allocator.replay`); else each allocation is its own
    segment. ``names`` (serial -> name) stand in for the module of storages made outside any
    module's forward (see :func:`tensor_names`). ``info`` goes in as the snapshot's ``memfit``
    entry, which the viewer ignores, with where the step starts in the trace
    (``steady_step_first_entry``) and the peak the trace shows."""
    b = _Builder(tracker, step, names or {})
    segments = b.replay_cached(device, streams) if cached else b.replay_uncached(device)
    b.entry("snapshot", 0, 0, 0, [], "unknown")  # NOTE [ memory_viz's loader ]
    sizes = ("block bytes (what memory_allocated counts); requested bytes in each live block's requested_size"
             if cached else "storage bytes; each allocation is its own segment")
    meta = dict(info or {}, steady_step=step, steady_step_first_entry=b.first_in_step, trace_peak_bytes=b.peak,
                sizes=sizes)
    return {"segments": sorted(segments, key=lambda s: s["address"]), "device_traces": [b.trace], "memfit": meta}


@dataclass
class _Segment:
    address: int
    size: int
    head: Any  # the allocator model's first block of the segment
    frames: list = field(default_factory=list)


class _Builder:
    """Trace entries in the order the allocations happened; the allocated bytes and their peak in the step."""

    def __init__(self, tracker: MemoryTracker, step: int, names: dict[int, str]):
        self.tracker, self.recs, self.names = tracker, tracker.state.records, names
        self.window = step_window(tracker, step)
        self.trace: list[dict[str, Any]] = []
        self.first_in_step: int | None = None
        self.allocated, self._peak = 0, None
        self._marks = [(idx, name) for name, _, idx in tracker.state.marks
                       if name not in POINTS]
        self._m, self._phase = 0, "setup"
        self._live: dict[int, tuple[list, str]] = {}  # serial -> (frames, category)
        self._frames: dict[tuple, list] = {}
        self._next = BASE_ADDRESS

    def entry(self, action: str, addr: int, size: int, stream: int, frames: list, category: str | None = None):
        e = {"action": action, "addr": addr, "size": size, "stream": stream, "frames": frames}
        if category is not None:
            e["category"] = category
        self.trace.append(e)
        return e

    def _at(self, i: int) -> None:
        while self._m < len(self._marks) and self._marks[self._m][0] <= i:
            self._phase = self._marks[self._m][1]
            self._m += 1
        if self.first_in_step is None and i >= self.window.start:
            self.first_in_step = len(self.trace)

    @property
    def peak(self) -> int:
        """Allocated bytes at their highest after an event of the step (as the report counts)."""
        return self.allocated if self._peak is None else self._peak

    def _count(self, size: int) -> None:
        self.allocated += size
        if self.first_in_step is not None:
            self._peak = self.allocated if self._peak is None else max(self._peak, self.allocated)

    def _address(self, size: int, alignment: int) -> int:
        addr = self._next
        self._next += -(-size // alignment) * alignment
        return addr

    def _alloc(self, serial: int, addr: int, size: int, stream: int) -> list:
        rec = self.recs[serial]
        category = self.tracker.category_of(rec)
        key = (rec.op, self.names.get(serial, rec.module), category, rec.step, self._phase)
        frames = self._frames.get(key)
        if frames is None:  # one list for all alike: the pickle stores it once
            frames = self._frames[key] = [{"filename": "op", "line": 0, "name": rec.op},
                                          {"filename": key[1], "line": 0, "name": category},
                                          {"filename": "step", "line": rec.step, "name": self._phase}]
        self._live[serial] = (frames, category)
        self.entry("alloc", addr, size, stream, frames, category)
        self._count(size)
        return frames

    def _free(self, serial: int, addr: int, size: int, stream: int) -> None:
        frames, category = self._live.pop(serial)
        self.entry("free_requested", addr, size, stream, frames, category)
        self.entry("free_completed", addr, size, stream, frames, category)
        self._count(-size)

    def replay_cached(self, device: str, streams: dict[int, int] | None) -> list[dict[str, Any]]:
        """Through the caching-allocator model, exactly as the report's replay."""
        segments: dict[int, _Segment] = {}
        owner: dict[int, int] = {}  # id(live block) -> serial
        new: list[dict[str, Any]] = []

        def on_segment(action: str, head) -> None:
            if action == "segment_alloc":
                seg = segments[head.segment] = _Segment(self._address(head.size, SEGMENT_ALIGNMENT), head.size, head)
                new.append(self.entry("segment_alloc", seg.address, seg.size, head.stream, seg.frames))
            else:
                seg = segments.pop(head.segment)
                self.entry("segment_free", seg.address, seg.size, head.stream, seg.frames)

        def on_block(i: int, serial: int, sign: int, block) -> None:
            self._at(i)
            addr = segments[block.segment].address + block.offset
            if sign > 0:
                frames = self._alloc(serial, addr, block.size, block.stream)
                owner[id(block)] = serial
                if new:  # the segment this allocation made shows the allocation's frames
                    new.pop()["frames"] = frames
                    segments[block.segment].frames = frames
            else:
                del owner[id(block)]
                self._free(serial, addr, block.size, block.stream)

        model = allocator.CachingAllocatorModel(on_segment)
        allocator.replay(self.tracker, device, self.window, streams, model=model, on_block=on_block)
        return [self._cached_segment(seg, owner) for seg in segments.values()]

    def _cached_segment(self, seg: _Segment, owner: dict[int, int]) -> dict[str, Any]:
        blocks, offset, block = [], 0, seg.head
        while block is not None:
            assert block.offset == offset, "allocator model: a segment's blocks do not tile it"
            serial = None if block.free else owner[id(block)]
            blocks.append(self._block(seg.address + offset, block.size, serial))
            offset += block.size
            block = block.next
        assert offset == seg.size, "allocator model: a segment's blocks do not add up to it"
        return self._segment(seg.address, seg.size, seg.head.stream, seg.head.small, seg.frames, blocks)

    def replay_uncached(self, device: str) -> list[dict[str, Any]]:
        """One segment an allocation (a CPU has no cache to show), in the tracker's own bytes."""
        addr_of: dict[int, int] = {}
        for i, (serial, sign) in enumerate(self.tracker.state.events[:self.window.end]):
            rec = self.recs[serial]
            if rec.device != device or rec.nbytes == 0:
                continue
            self._at(i)
            if sign > 0:
                addr = addr_of[serial] = self._address(rec.nbytes, CPU_ALIGNMENT)
                seg = self.entry("segment_alloc", addr, rec.nbytes, 0, [])
                seg["frames"] = self._alloc(serial, addr, rec.nbytes, 0)
            elif serial in addr_of:
                addr = addr_of.pop(serial)
                frames = self._live[serial][0]
                self._free(serial, addr, rec.nbytes, 0)
                self.entry("segment_free", addr, rec.nbytes, 0, frames)
        return [self._segment(addr, self.recs[s].nbytes, 0, self.recs[s].nbytes <= allocator.SMALL_SIZE,
                              self._live[s][0], [self._block(addr, self.recs[s].nbytes, s)])
                for s, addr in addr_of.items()]

    def _block(self, address: int, size: int, serial: int | None) -> dict[str, Any]:
        if serial is None:
            return {"address": address, "size": size, "requested_size": 0, "state": "inactive", "frames": []}
        return {"address": address, "size": size, "requested_size": self.recs[serial].nbytes,
                "state": "active_allocated", "frames": self._live[serial][0]}

    @staticmethod
    def _segment(address: int, size: int, stream: int, small: bool, frames: list, blocks: list) -> dict[str, Any]:
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        return {"device": 0, "address": address, "total_size": size, "allocated_size": allocated,
                "active_size": allocated, "requested_size": sum(b["requested_size"] for b in blocks),
                "stream": stream, "segment_type": "small" if small else "large", "segment_pool_id": (0, 0),
                "is_expandable": False, "frames": frames, "blocks": blocks}
