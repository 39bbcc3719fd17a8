"""MemoryReport: the peak of a step with its breakdown, built complete from a tracker's timeline.

:func:`report_for` is the one way to make a report: from the tracker of a run of a target, the
method (fake trace, real run, real-run fallback) and, for a measured run, the measurement. For a
GPU target the tracked storages are replayed through the caching-allocator model (allocated and
reserved bytes) and the CUDA context and workspaces are added; whether the step fits the device is
decided by :class:`~memfit.memory.budget.Budget`. A report is frozen: nothing patches it later.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

from memfit.devices import Device
from memfit.memory import allocator, managed
from memfit.memory.budget import Budget
from memfit.memory.categories import CATEGORIES, STEADY_STEP
from memfit.memory.expandable import new_model
from memfit.memory.leaks import find_leaks
from memfit.memory.managed import managed_notes
from memfit.memory.tracker import MANAGED, POINTS, MemoryTracker
from memfit.sdpa_backends import torch_release


@dataclass(frozen=True)
class MemoryReport:
    workload: str
    device: str
    batch_size: int
    plan: dict
    method: str
    """'fake' (traced on fake tensors), 'real' (measured) or 'real-fallback' (fake tracing failed)."""
    peak_bytes: int
    """Peak of allocated bytes during the steady-state step (the second); for a measured report,
    the measurement's."""
    breakdown: dict[str, int]
    """Bytes per category at the tracked peak; sums to peak_bytes (for a prediction)."""
    peak_phase: str = ""
    precision: str = ""
    """The precision the step ran in (``auto`` resolved for the device)."""
    by_module: dict[str, int] = field(default_factory=dict)
    """Bytes at the peak by the module whose forward/backward created them (largest first)."""
    activations_by_module: dict[str, int] = field(default_factory=dict)
    host_peak_bytes: int = 0
    """Peak bytes in host memory (offloaded optimizer states / activations, EMA on the host)."""
    process_peak_bytes: int = 0
    """On a CPU device: the peak of device + host bytes together (the same physical memory)."""
    reserved_bytes: int | None = None
    """GPU: the caching allocator's reserved (cudaMalloc'd) bytes at the peak."""
    expandable_reserved_bytes: int | None = None
    """GPU, predicted: the reserved bytes of the same step with expandable segments (NOTE [ Reserved
    bytes with expandable segments, from the same trace ]); ``reserved_bytes`` where the plan has them."""
    device_total_bytes: int | None = None
    cuda_context_bytes: int | None = None
    cuda_workspace_bytes: int | None = None
    fits: bool | None = None
    """GPU: whether reserved bytes plus the CUDA context fit the card (memfit.memory.budget)."""
    timeline: list[tuple[int, str, int]] = field(default_factory=list)
    """(event index, phase, live bytes), down-sampled."""
    approximations: list[str] = field(default_factory=list)
    leaks: list[dict] = field(default_factory=list)
    """Memory created by the step and still held after it (see memfit.memory.leaks)."""
    trace_seconds: float = 0.0
    load_peak_bytes: int = 0
    """Peak of allocated bytes while the model was built or loaded, before the first step (a model
    loaded as a checkpoint holds, beyond itself, one weight in full precision at a time)."""
    load_reserved_bytes: int | None = None
    """GPU: the caching allocator's reserved bytes when the load ended."""
    weights_load_peak_bytes: int | None = None
    """A model loaded as a checkpoint: the load peak until its weights had all arrived, before the plan
    prepared it (``from_pretrained``'s own peak; a QLoRA recipe's fp32 upcast comes after it)."""
    weights_load_reserved_bytes: int | None = None
    """GPU: the caching allocator's reserved bytes when the weights had all arrived."""
    facts: list[str] = field(default_factory=list)
    """What the trace learnt about the model, shown beside the breakdown (a mixture of experts'
    total and active parameters, and what routing does to the peak)."""
    worst_routing_peak_bytes: int | None = None
    """A mixture of experts whose routing changes tensor sizes: the peak under the worst routing
    (NOTE [ Routing on fake tensors ]); ``peak_bytes`` is the balanced routing's."""
    managed_bytes: int = 0
    """GPU: CUDA managed (unified) memory at the peak: a paged optimizer's states (memfit.memory.managed).
    Outside the caching allocator: in neither ``peak_bytes`` nor ``reserved_bytes``, counted against
    the card by :class:`~memfit.memory.budget.Budget`."""

    @property
    def measurable_peak_bytes(self) -> int:
        """The peak a measurement of the real run sees: on a CPU device, device and host memory are
        one process heap, so both together; on a GPU, the device's allocated bytes."""
        return self.process_peak_bytes if self.device == "cpu" and self.process_peak_bytes else self.peak_bytes

    @property
    def paged_out_bytes(self) -> int:
        """GPU: the managed bytes with no room on the card beside the allocator's side (reserved + CUDA
        context): on the host, migrating in and out each step (memfit.memory.managed)."""
        if not self.managed_bytes or self.reserved_bytes is None:
            return 0
        room = self.device_total_bytes - self.reserved_bytes - (self.cuda_context_bytes or 0)
        return managed.paged_out_bytes(self.managed_bytes, room)

    @property
    def host_held_bytes(self) -> int:
        """What the step holds in the training machine's memory at its peak: offloaded and swapped copies
        and the paged-out states (what ``--host-memory`` is held against)."""
        return self.host_peak_bytes + self.paged_out_bytes

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("timeline")
        d["by_module"] = dict(list(self.by_module.items())[:20])
        d["activations_by_module"] = dict(list(self.activations_by_module.items())[:20])
        return d


@dataclass(frozen=True)
class Measurement:
    """What an independent measurement of the steady-state step gave (profiler or CUDA allocator)."""

    peak_bytes: int
    reserved_bytes: int | None = None


@dataclass
class Window:
    """Where in the timeline the steady-state step starts and ends (event indices)."""

    start: int
    end: int


def step_window(tracker: MemoryTracker, step: int) -> Window:
    marks = [(name, s, idx) for name, s, idx in tracker.state.marks if name in ("step", "end")]
    start = next(idx for name, s, idx in marks if name == "step" and s == step)
    later = [idx for name, s, idx in marks if idx >= start and (name == "end" or s > step)]
    end = later[0] if later else len(tracker.state.events)
    return Window(start, end)


def peak_of(tracker: MemoryTracker, device: str | tuple[str, ...], window: Window, sizes=None) -> tuple[int, int]:
    """(peak bytes, event index of the peak) on ``device`` within ``window``.

    ``sizes`` maps a serial to the bytes the allocator really hands out (e.g. CUDA's 512-byte
    rounding); default: the storage's own bytes.
    """
    recs, events = tracker.state.records, tracker.state.events
    devices = (device,) if isinstance(device, str) else device
    live = 0
    peak, peak_at = -1, window.start - 1
    for i, (serial, sign) in enumerate(events[:window.end]):
        rec = recs[serial]
        if rec.device not in devices:
            continue
        live += sign * (sizes(rec.nbytes) if sizes is not None else rec.nbytes)
        if i >= window.start and live > peak:
            peak, peak_at = live, i
    if peak < 0:  # nothing happened in the window on this device
        peak, peak_at = live, window.end - 1
    return peak, peak_at


def live_at(tracker: MemoryTracker, device: str, index: int) -> dict[int, int]:
    """serial -> live bytes, just after event ``index``."""
    recs = tracker.state.records
    live: dict[int, int] = defaultdict(int)
    for serial, sign in tracker.state.events[:index + 1]:
        if recs[serial].device == device:
            live[serial] += sign * recs[serial].nbytes
            if live[serial] == 0:
                del live[serial]
    return live


def phase_at(tracker: MemoryTracker, index: int) -> str:
    phase = "setup"
    for name, _, idx in tracker.state.marks:
        if idx > index:
            break
        if name not in POINTS:
            phase = name
    return phase


@dataclass
class TrackerView:
    """What the tracker saw on one device in the steady-state step."""

    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    by_module: dict[str, int]
    activations_by_module: dict[str, int]
    host_peak_bytes: int
    process_peak_bytes: int
    timeline: list
    approximations: list[str]
    leaks: list[dict]


def tracker_view(tracker: MemoryTracker, device: str, *, step: int = STEADY_STEP, sizes=None,
                 timeline_points: int = 1500) -> TrackerView:
    """The peak of ``step`` on ``device`` with its breakdown by category and module. ``sizes`` maps
    a storage's bytes to what the allocator hands out (CUDA's 512-byte rounding)."""
    window = step_window(tracker, step)
    peak, at = peak_of(tracker, device, window, sizes)
    live = live_at(tracker, device, at)
    recs = tracker.state.records
    breakdown = dict.fromkeys(CATEGORIES, 0)
    by_module: dict[str, int] = defaultdict(int)
    act_by_module: dict[str, int] = defaultdict(int)
    for serial, nbytes in live.items():
        rec = recs[serial]
        b = sizes(nbytes) if sizes else nbytes
        cat = tracker.category_of(rec)
        breakdown[cat] += b
        by_module[rec.module] += b
        if cat == "activations":
            act_by_module[rec.module] += b
    approximations = [f"{a.what} at {a.where} (x{a.count})" for a in tracker.approximations.values()]
    gap = peak - sum(breakdown.values())
    if gap:
        # NOTE [ Breakdown sums to the peak ]: every live storage at the peak is in exactly one
        # category, so this cannot happen unless the timeline is inconsistent (a bug in memfit).
        # The user still gets the estimate: the difference is booked under "other" and reported.
        breakdown["other"] += gap
        msg = (f"memfit internal check: the breakdown differed from the peak by {gap:+,} bytes (booked under "
               "'other'); please report this with the workload")
        approximations.append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    if tracker.unprobed:
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(tracker.unprobed.items(), key=lambda kv: -kv[1])[:6])
        approximations.append(f"internal scratch of {sum(tracker.unprobed.values())} kernel calls too large to "
                              f"probe is not counted ({calls})")
    host_peak, _ = peak_of(tracker, "host", window)
    process_peak = peak_of(tracker, (device, "host"), window)[0] if device == "cpu" else peak
    return TrackerView(peak_bytes=peak, breakdown=breakdown, peak_phase=phase_at(tracker, at),
                       by_module=_sorted(by_module), activations_by_module=_sorted(act_by_module),
                       host_peak_bytes=host_peak, process_peak_bytes=process_peak,
                       timeline=_timeline(tracker, device, window, timeline_points), approximations=approximations,
                       leaks=[vars(x) for x in find_leaks(tracker, step)])


def traced_device(device: Device, method: str, tensor_device: str) -> str:
    """The tracker's name of the device a run's storages were on."""
    return "cuda:0" if (device.is_gpu and method != "real-fallback" and tensor_device == "cuda") else "cpu"


def load_window(tracker: MemoryTracker) -> Window:
    """From the first event to the model's build or load's end (the batch is the step's: the profiler
    measures the build alone), or to the first step in a tracker that did not note it."""
    if tracker.state.built is not None:
        return Window(0, tracker.state.built)
    return Window(0, next((idx for name, _, idx in tracker.state.marks if name == "step"), len(tracker.state.events)))


def _load_figures(tracker: MemoryTracker, target, where: str, gpu: bool) -> tuple[int, int | None, list[str]]:
    """(load peak, reserved when it ended, a note): the note, on a GPU, where a model built on the
    device in full precision and converted afterwards left segments reserved that a load in the
    final form would not (NOTE in memfit.techniques.loading: Load as users load)."""
    window = load_window(tracker)
    if not gpu:
        return peak_of(tracker, where, window)[0], None, []
    peak, reserved, allocated = _replayed(tracker, target, where, window)
    left = reserved - allocated
    notes = []
    if not target.workload.from_checkpoint and left >= LEFT_BY_BUILD_BYTES and left > allocated // 4:
        notes.append(f"building the model on the device left {left / 2**30:.2f} GiB reserved beyond the "
                     f"{allocated / 2**30:.2f} GiB it kept (a full-precision model converted afterwards); "
                     "build it on the meta device and load each weight in its final form (from_pretrained(..., "
                     "dtype=torch.bfloat16, quantization_config=...)) to leave none")
    return peak, reserved, notes


def _weights_load_figures(tracker: MemoryTracker, target, where: str, gpu: bool) -> tuple[int | None, int | None]:
    """(peak, reserved at its end) of a checkpoint's load until the ``loaded`` mark; Nones without one."""
    end = next((idx for name, _, idx in tracker.state.marks if name == "loaded"), None)
    if end is None:
        return None, None
    window = Window(0, end)
    return _replayed(tracker, target, where, window)[:2] if gpu else (peak_of(tracker, where, window)[0], None)


def _replayed(tracker: MemoryTracker, target, where: str, window: Window) -> tuple[int, int, int]:
    """(allocated peak, reserved and allocated at the end) of ``window``, the caching allocator replayed over it."""
    model = new_model(expandable=target.plan.config("allocator").expands)
    peak, reserved, _ = allocator.replay(tracker, where, window, model=model)
    return peak, reserved, model.allocated


LEFT_BY_BUILD_BYTES = 512 << 20
"""Reserved bytes a build may leave unused before the report says how to avoid them."""


def report_for(tracker: MemoryTracker, target, method: str, *, measurement: Measurement | None = None,
               notes: list[str] | tuple = (), trace_seconds: float = 0.0, view: TrackerView | None = None,
               facts: list[str] | tuple = (), worst_routing_peak_bytes: int | None = None) -> MemoryReport:
    """The report of a run of ``target`` (a memfit.target.Target) that ``tracker`` watched.

    ``measurement``: the independent measurement of a real run (its peak and reserved bytes are
    the report's); ``notes``: approximations to list first; ``view``: the tracker view, when the
    caller has it already (see :func:`tracker_view`); ``facts``, ``worst_routing_peak_bytes``: see
    :class:`MemoryReport`."""
    dev = target.device
    where = traced_device(dev, method, target.tensor_device)
    gpu = dev.is_gpu
    view = view or tracker_view(tracker, where, sizes=allocator.round_size if gpu else None)
    breakdown = dict(view.breakdown)
    peak, reserved, workspace, expandable = view.peak_bytes, None, None, None
    load_peak, load_reserved, load_notes = _load_figures(tracker, target, where, gpu)
    weights_peak, weights_reserved = _weights_load_figures(tracker, target, where, gpu)
    approximations = [*notes, *view.approximations, *load_notes]
    managed = 0
    if gpu:
        window = step_window(tracker, STEADY_STEP)
        managed = peak_of(tracker, MANAGED, window)[0]
        def replay(expandable: bool) -> tuple[int, int]:
            return allocator.replay(tracker, where, window, getattr(tracker, "side_streams", None),
                                    model=new_model(expandable=expandable))[:2]
        expands = target.plan.config("allocator").expands
        peak, reserved = replay(expands)
        expandable = reserved if expands else replay(True)[1]
        # The breakdown uses 512-byte rounded storages; the replay also counts unsplit block
        # remainders. Their difference is allocator overhead, booked under "other".
        breakdown["other"] += peak - view.peak_bytes
        if method == "fake":
            # cuBLAS/cuBLASLt workspaces are in the trace (memfit.memory.cuda.blas), one per thread
            workspace = sum(r.nbytes for r in tracker.state.records
                            if r.op.startswith(("cublas workspace", "cublaslt workspace")))
            approximations.append(
                f"CUDA kernels modelled for {dev.name} (sm{dev.compute_capability[0]}{dev.compute_capability[1]}, "
                f"CUDA {dev.cuda_version[0]}.{dev.cuda_version[1]}, cuDNN {dev.cudnn_version}) as this torch "
                f"({torch_release()}) chooses them: attention backend, "
                "autocast lists, foreach optimizers, cuBLAS/cuDNN workspaces, reduction buffers (memfit.memory.cuda); "
                "cuDNN convolution and RNN workspaces are calibrated estimates")
        else:
            workspace = dev.workspace_bytes
            breakdown["other"] += workspace
            peak += workspace
            reserved = reserved + allocator.segment_size(workspace) if workspace else reserved
            expandable = expandable + allocator.segment_size(workspace) if workspace else expandable
        if where == "cpu" and method == "fake":
            approximations.append("traced on fake CPU tensors (no GPU here), with CUDA's kernel choices modelled")
        elif where == "cpu":
            approximations.append("measured on this CPU: CPU kernel choices stand in for CUDA's")
        approximations.append(f"CUDA context ({dev.context_bytes >> 20} MiB) is a typical value for this card, "
                              "not measured")
    if measurement is not None:
        peak = measurement.peak_bytes
        reserved = measurement.reserved_bytes if measurement.reserved_bytes is not None else reserved
        expandable = None  # (measured: one allocator ran)
    if managed:
        approximations[:0] = managed_notes(reserved, dev.context_bytes, managed, dev)
    report = dict(
        workload=target.workload.name, device=dev.name, batch_size=target.batch_size, plan=target.plan.to_dict(),
        method=method, peak_bytes=peak, breakdown=breakdown, peak_phase=view.peak_phase, precision=target.precision,
        by_module=view.by_module, activations_by_module=view.activations_by_module,
        host_peak_bytes=view.host_peak_bytes, process_peak_bytes=view.process_peak_bytes, reserved_bytes=reserved,
        expandable_reserved_bytes=expandable,
        device_total_bytes=dev.total_bytes if gpu else None, cuda_context_bytes=dev.context_bytes if gpu else None,
        cuda_workspace_bytes=workspace, timeline=view.timeline, approximations=approximations, leaks=view.leaks,
        trace_seconds=trace_seconds, load_peak_bytes=load_peak, load_reserved_bytes=load_reserved,
        weights_load_peak_bytes=weights_peak, weights_load_reserved_bytes=weights_reserved,
        facts=list(facts), worst_routing_peak_bytes=worst_routing_peak_bytes, managed_bytes=managed)
    fits = Budget.of_device(dev).fits(SimpleNamespace(**report)) if gpu else None
    return MemoryReport(**report, fits=fits)


def _sorted(d: dict[str, int]) -> dict[str, int]:
    return dict(sorted(d.items(), key=lambda kv: -kv[1]))


def _timeline(tracker: MemoryTracker, device: str, window: Window, points: int) -> list[tuple[int, str, int]]:
    recs, events = tracker.state.records, tracker.state.events
    marks = [(idx, name) for name, _, idx in tracker.state.marks if name not in POINTS]
    stride = max(1, (window.end - window.start) // points)
    out, live, phase, m = [], 0, "setup", 0
    for i, (serial, sign) in enumerate(events[:window.end]):
        while m < len(marks) and marks[m][0] <= i:
            phase = marks[m][1]
            m += 1
        if recs[serial].device == device:
            live += sign * recs[serial].nbytes
        if i >= window.start and (i - window.start) % stride == 0:
            out.append((i - window.start, phase, live))
    return out
