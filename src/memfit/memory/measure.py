"""profile: run the same TrainStep for real and measure its memory independently of the tracker."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch

from memfit.devices import Device, available_host_bytes
from memfit.errors import UserError
from memfit.memory import allocator
from memfit.memory.categories import STEADY_STEP
from memfit.memory.cuda_history import CudaStepMeter, save_cuda_timeline_png
from memfit.memory.estimate import estimate_target
from memfit.memory.faketrace import run_tracked
from memfit.memory.profiler_events import memory_profiler, profiler_peak
from memfit.memory.report import Measurement, MemoryReport, report_for, traced_device, tracker_view
from memfit.memory.snapshot import check_snapshot_path, save_allocator_snapshot, save_snapshot
from memfit.memory.timeline import save_timeline_png
from memfit.plans import Plan
from memfit.quiet import QuietProfiler, silenced_warnings
from memfit.step import make_batch
from memfit.target import Target
from memfit.workload import Workload

STEP_RANGE = "memfit::steady_step"
LOAD_RANGE = "memfit::load"


@dataclass
class ProfileResult:
    measured: MemoryReport
    """Breakdown from the tracker on real tensors; ``peak_bytes`` replaced by the measured peak (the profiler's
    on a CPU, ``max_memory_allocated`` on a GPU; there ``reserved_bytes`` is ``max_memory_reserved``)."""
    predicted: MemoryReport
    """What ``estimate`` predicted for the same workload, plan and batch."""
    tracker_peak_bytes: int
    """The tracker's own peak on the real run (should equal the profiler's)."""
    step_seconds: float
    """Median wall time of a step (no profiler, no tracker)."""
    step_seconds_all: list[float] = field(default_factory=list)
    measured_by: str = "profiler"
    """'profiler' (PyTorch profiler allocator events, CPU) or 'cuda-allocator' (caching-allocator statistics)."""
    device_used_bytes: int | None = None
    """GPU: ``total - free`` after the steady-state step (CUDA context and library handles included)."""
    load_peak_bytes: int | None = None
    """The measured peak while the model was built or loaded (the profiler's, or ``max_memory_allocated``)."""
    load_reserved_bytes: int | None = None
    """GPU: ``max_memory_reserved`` when the load ended."""

    @property
    def peak_bytes(self) -> int:
        return self.measured.peak_bytes

    @property
    def reserved_bytes(self) -> int | None:
        """GPU: measured ``max_memory_reserved`` over the steady-state step."""
        return self.measured.reserved_bytes if self.measured_by == "cuda-allocator" else None

    @property
    def predicted_reserved_bytes(self) -> int | None:
        return self.predicted.reserved_bytes

    @property
    def reserved_error_percent(self) -> float | None:
        if self.reserved_bytes is None or self.predicted_reserved_bytes is None:
            return None
        return 100.0 * (self.predicted_reserved_bytes - self.reserved_bytes) / max(self.reserved_bytes, 1)

    @property
    def predicted_peak_bytes(self) -> int:
        """The prediction of what the profiler can see (see MemoryReport.measurable_peak_bytes)."""
        return self.predicted.measurable_peak_bytes

    @property
    def error_percent(self) -> float:
        return 100.0 * (self.predicted_peak_bytes - self.measured.peak_bytes) / max(self.measured.peak_bytes, 1)

    def to_json(self) -> dict:
        return {
            "workload": self.measured.workload, "device": self.measured.device, "batch_size": self.measured.batch_size,
            "plan": self.measured.plan,
            "peak_bytes": self.measured.peak_bytes, "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_device_peak_bytes": self.predicted.peak_bytes,
            "predicted_host_peak_bytes": self.predicted.host_peak_bytes,
            "error_percent": round(self.error_percent, 3), "tracker_peak_bytes": self.tracker_peak_bytes,
            "measured_by": self.measured_by,
            "reserved_bytes": self.reserved_bytes, "predicted_reserved_bytes": self.predicted_reserved_bytes,
            "reserved_error_percent": None if self.reserved_error_percent is None
            else round(self.reserved_error_percent, 3),
            "device_used_bytes": self.device_used_bytes,
            "load_peak_bytes": self.load_peak_bytes, "predicted_load_peak_bytes": self.predicted.load_peak_bytes,
            "load_reserved_bytes": self.load_reserved_bytes,
            "predicted_load_reserved_bytes": self.predicted.load_reserved_bytes,
            "predicted_cuda_context_bytes": self.predicted.cuda_context_bytes,
            "step_seconds": self.step_seconds, "breakdown": self.measured.breakdown,
            "predicted_breakdown": self.predicted.breakdown, "prediction_method": self.predicted.method,
            "approximations": self.predicted.approximations, "leaks": self.measured.leaks,
            "activations_by_module": dict(list(self.measured.activations_by_module.items())[:20]),
        }


class PeakWindow:
    """The peak of one chosen step of a longer run (``memfit train``), measured like ``profile``:
    on a CPU the profiler's allocator events from before the model is built (so their running sum
    is every live byte) with the peak taken inside the step's range; on a GPU the CUDA allocator's
    own peak over the step. Enter it before the model is built; ``step(i)`` around the step,
    then ``finish(i)``."""

    def __init__(self, dev: Device):
        self.cpu = dev.kind == "cpu"
        self.prof = None

    def __enter__(self):
        if self.cpu:
            self.prof = QuietProfiler(memory_profiler())
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prof is not None:
            self.prof.__exit__(*exc)
            self.prof = None
        return False

    @contextlib.contextmanager
    def step(self, index: int):
        if self.cpu:
            from torch.profiler import record_function
            with record_function(self._range(index)):
                yield
        else:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            yield
            torch.cuda.synchronize()

    def finish(self, index: int) -> int:
        if not self.cpu:
            return torch.cuda.max_memory_allocated()
        prof = self.prof.prof
        self.__exit__(None, None, None)
        return profiler_peak(prof, self._range(index))

    @staticmethod
    def _range(index: int) -> str:
        return f"{STEP_RANGE}:{index}"


def profile(workload: Workload | str, plan: Plan | str | None = None, *, batch_size: int | None = None,
            device: str | Device = "cpu", seq_len: int | None = None, resolution: int | None = None,
            repeats: int = 5,
            timeline: str | None = None, snapshot: str | None = None) -> ProfileResult:
    """Run the step for real on this machine: measured peak and breakdown next to the prediction.

    ``timeline``: also write the measured step's memory timeline (PNG: stacked by category on a
    CPU, by the phase that allocated each block on a GPU, from the caching allocator's history).
    ``snapshot``: also write the real run as a ``torch.cuda.memory._snapshot()`` pickle for
    memory_viz (on a CPU from the tracker, on a GPU the allocator's own; memfit.memory.snapshot)."""
    if snapshot:
        check_snapshot_path(snapshot)
    target = Target.resolve(workload, plan, batch_size, device, seq_len=seq_len, resolution=resolution)
    dev = target.device
    if dev.is_gpu and not torch.cuda.is_available():
        raise UserError(f"profile runs the step for real, and {dev.name} is a preset for prediction; this machine has no "
                        "CUDA GPU. Use --device cpu here, or memfit estimate --device " + dev.name)
    predicted = estimate_target(target)
    if dev.is_gpu:
        return _profile_cuda(target, predicted, repeats, timeline, snapshot=snapshot)
    if predicted.peak_bytes > available_host_bytes() * 0.8:
        raise UserError(f"profile: the step needs about {predicted.peak_bytes / 2**30:.1f} GiB but this machine has "
                        f"{available_host_bytes() / 2**30:.1f} GiB free; use a smaller batch or model, or memfit estimate")
    run, peak, load_peak = measured_cpu_run(target)  # (it collects garbage first: NOTE [ Frozen heap ])
    view = tracker_view(run.tracker, traced_device(dev, "real", target.tensor_device))
    tracker_peak = view.process_peak_bytes or view.peak_bytes
    measured = report_for(run.tracker, target, "real", measurement=Measurement(peak), view=view)
    if timeline:
        save_timeline_png(run.tracker, timeline, title=f"{target.describe()} · measured")
    if snapshot:
        save_snapshot(run, snapshot, target=target, report=measured, kind="measurement")
    times = _time_steps(run, target, repeats) if repeats else []
    return ProfileResult(measured=measured, predicted=predicted, tracker_peak_bytes=tracker_peak,
                         step_seconds=statistics.median(times) if times else float("nan"), step_seconds_all=times,
                         load_peak_bytes=load_peak)


# NOTE [ Independent measurement ]
# On a CPU the measured peak comes from the PyTorch profiler's allocator events
# (``profile_memory=True``): every allocation and free of PyTorch's CPU allocator, including kernel
# scratch memory that never reaches Python (oneDNN workspaces, sort buffers). The profiler runs from
# before the model is built, so the running sum of its events is the live bytes of everything
# memfit created; the peak is taken inside the steady-state step (a ``record_function`` range).
# On a CUDA GPU the measurement is the caching allocator's own (NOTE [ CUDA measurement ] in
# ``memfit.memory.cuda_history``): peak statistics reset just before the steady-state step,
# ``max_memory_allocated`` and ``max_memory_reserved`` read just after it, and compared with the
# predicted allocated peak and reserved bytes. The memory tracker runs too, on the real tensors,
# for the breakdown by category and module; the two are compared so a tracker blind spot shows up
# as a difference instead of hiding.
#
# Step time is the median over further steps with neither profiler nor tracker attached.
def measured_cpu_run(target: Target):
    """Run the target's step for real on this CPU under the tracker and the profiler (see NOTE
    [ Independent measurement ]): the run, the profiler's peak of the steady-state step, and its
    peak while the model was built or loaded."""
    from torch.profiler import record_function

    with silenced_warnings():
        prof = memory_profiler()
        run = run_tracked(target, fake=False, outer=QuietProfiler(prof),
                          around_step=lambda i: record_function(STEP_RANGE) if i == STEADY_STEP
                          else contextlib.nullcontext(), around_build=lambda: record_function(LOAD_RANGE))
    return run, profiler_peak(prof, STEP_RANGE), profiler_peak(prof, LOAD_RANGE)


def _profile_cuda(target: Target, predicted: MemoryReport, repeats: int, timeline: str | None,
                  cuda=None, snapshot: str | None = None) -> ProfileResult:
    """The GPU branch of :func:`profile`: the caching allocator measures the steady-state step.
    ``cuda`` stands in for ``torch.cuda`` in tests."""
    dev = target.device
    meter = CudaStepMeter(cuda, history=bool(timeline or snapshot))
    load = CudaStepMeter(cuda)
    try:  # (run_tracked collects garbage first: NOTE [ Frozen heap ])
        with silenced_warnings():
            run = run_tracked(target, fake=False, around_build=load.around,
                              around_step=lambda i: meter.around() if i == STEADY_STEP else contextlib.nullcontext())
    except torch.OutOfMemoryError as e:
        raise UserError(f"profile: out of memory on {dev.name} (predicted: {predicted.peak_bytes / 2**30:.2f} GiB "
                        f"allocated, {(predicted.reserved_bytes or 0) / 2**30:.2f} GiB reserved); use a smaller batch or "
                        f"a plan that fits (memfit plan ... --device {dev.name})") from e
    m = meter.result
    assert m is not None, "the steady-state step did not run"
    view = tracker_view(run.tracker, traced_device(dev, "real", target.tensor_device), sizes=allocator.round_size)
    tracked = report_for(run.tracker, target, "real", view=view)
    tracker_peak = tracked.peak_bytes  # the tracker's storages through the caching-allocator model
    measured = report_for(run.tracker, target, "real", view=view,
                          measurement=Measurement(m.allocated_peak_bytes, m.reserved_peak_bytes))
    if snapshot:
        save_allocator_snapshot(m.snapshot, snapshot, target=target, report=measured)
    if timeline:
        save_cuda_timeline_png(m, timeline, title=f"{target.describe()} · measured on {dev.name}")
    m.snapshot = None
    times = _time_steps(run, target, repeats) if repeats else []
    return ProfileResult(measured=measured, predicted=predicted, tracker_peak_bytes=tracker_peak,
                         step_seconds=statistics.median(times) if times else float("nan"), step_seconds_all=times,
                         measured_by="cuda-allocator", device_used_bytes=m.device_used_bytes,
                         load_peak_bytes=load.result.allocated_peak_bytes,
                         load_reserved_bytes=load.result.reserved_peak_bytes)


def _time_steps(run, target: Target, repeats: int) -> list[float]:
    step = run.step
    batch = make_batch(target)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(batch)  # float(loss) synchronises
        times.append(time.perf_counter() - t0)
    return times
