"""profile's GPU branch without a GPU: a stand-in for torch.cuda records what the branch asks of it.

The claim under test (NOTE [ CUDA measurement ]): the caching allocator's peak statistics are reset
just before the steady-state step and read just after it; the allocated peak is compared with the
predicted peak and the reserved peak with the predicted reserved bytes; the timeline is built from
the allocator's history of that step.
"""

import io
import types

import torch
from rich.console import Console
from torch import nn

from memfit.devices import cpu_device
from memfit.memory.cuda_history import (
    CudaStepMeasurement,
    CudaStepMeter,
    save_cuda_timeline_png,
    timeline_series,
)
from memfit.memory.estimate import estimate
from memfit.memory.measure import _profile_cuda
from memfit.plans import Plan
from memfit.report.tables import print_profile
from memfit.target import Target
from memfit.workload import Workload

GiB = 2**30


class FakeCuda:
    """Answers like torch.cuda; every call goes into ``log`` (shared with the workload's loss)."""

    def __init__(self, log, allocated=3 * GiB, reserved=4 * GiB, snapshot=None):
        self.log = log
        self.allocated, self.reserved = allocated, reserved
        self.snapshot = snapshot or {"device_traces": [[]], "segments": []}
        self.memory = types.SimpleNamespace(_record_memory_history=self._record, _snapshot=self._snapshot)

    def synchronize(self):
        self.log.append("synchronize")

    def reset_peak_memory_stats(self):
        self.log.append("reset")

    def memory_allocated(self):
        return GiB

    def memory_reserved(self):
        return 2 * GiB

    def max_memory_allocated(self):
        self.log.append("read allocated")
        return self.allocated

    def max_memory_reserved(self):
        self.log.append("read reserved")
        return self.reserved

    def mem_get_info(self):
        return 70 * GiB, 80 * GiB

    def _record(self, enabled="all", **kwargs):
        self.log.append("history on" if enabled else "history off")

    def _snapshot(self):
        self.log.append("snapshot")
        return self.snapshot


def _workload(log):
    def loss(m, x):
        log.append("step")
        return m(x).pow(2).mean()
    return Workload(model=lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)),
                    batch=lambda n: torch.randn(n, 32), loss=loss, name="toy", default_batch_size=4)


def _profile(log, cuda, timeline=None, repeats=2):
    wl = _workload(log)
    predicted = estimate(wl, Plan(), batch_size=4, device="h100-80gb")
    log.clear()
    return _profile_cuda(Target.resolve(wl, Plan(), 4, cpu_device()), predicted, repeats, timeline, cuda=cuda)


def test_peak_statistics_are_reset_before_the_steady_step_and_read_after_it():
    log: list[str] = []
    result = _profile(log, FakeCuda(log))
    core = [x for x in log if x != "synchronize"]
    # the load measured (reset, build, read), step 1 (optimizer states appear), reset, step 2 (steady
    # state), read, then the timed steps
    assert core == ["reset", "read allocated", "read reserved",
                    "step", "reset", "step", "read allocated", "read reserved", "step", "step"]
    log = log[log.index("step"):]
    assert log[log.index("reset") - 1] == "synchronize" and log[log.index("read allocated") - 1] == "synchronize"
    assert result.measured_by == "cuda-allocator"
    assert result.peak_bytes == 3 * GiB and result.reserved_bytes == 4 * GiB
    assert result.device_used_bytes == 10 * GiB


def test_allocated_and_reserved_are_each_compared_with_their_prediction():
    log: list[str] = []
    result = _profile(log, FakeCuda(log, allocated=2 * GiB, reserved=3 * GiB))
    p = result.predicted
    assert p.reserved_bytes is not None and result.predicted_peak_bytes == p.peak_bytes
    assert result.error_percent == 100 * (p.peak_bytes - 2 * GiB) / (2 * GiB)
    assert result.reserved_error_percent == 100 * (p.reserved_bytes - 3 * GiB) / (3 * GiB)
    out = result.to_json()
    assert out["peak_bytes"] == 2 * GiB and out["reserved_bytes"] == 3 * GiB
    assert out["predicted_reserved_bytes"] == p.reserved_bytes and out["measured_by"] == "cuda-allocator"
    assert round(result.reserved_error_percent, 3) == out["reserved_error_percent"]
    text = io.StringIO()
    print_profile(result, Console(file=text, width=200))
    printed = text.getvalue()
    assert "peak reserved" in printed and "reserved error" in printed and "caching allocator" in printed


def _frame(name, filename="??", line=0):
    return {"name": name, "filename": filename, "line": line}


FWD = [_frame("forward", "/x/model.py", 10)]
BWD = [_frame("at::native::mm"), _frame("torch::autograd::Engine::thread_main(...)")]
OPT = [_frame("_multi_tensor_adamw", "/site-packages/torch/optim/adamw.py", 400)]


def _snapshot():
    def ev(action, addr, size, frames=()):
        return {"action": action, "addr": addr, "size": size, "frames": list(frames)}
    return {"device_traces": [[
        ev("free_completed", 1, 100),            # a gradient from before the step (zero_grad)
        ev("segment_alloc", 50, 2 * 2**20),
        ev("alloc", 10, 1000, FWD),              # an activation
        ev("alloc", 11, 500, BWD),               # a gradient, on autograd's thread
        ev("free_requested", 10, 1000, FWD),     # not a free yet
        ev("free_completed", 10, 1000, FWD),
        ev("alloc", 12, 300, OPT),               # a foreach temporary
        ev("free_completed", 12, 300, OPT),
    ]]}


def test_timeline_stacks_the_step_by_the_phase_that_allocated_each_block(tmp_path):
    m = CudaStepMeasurement(allocated_peak_bytes=1400 + 1000, reserved_peak_bytes=4 * 2**20,
                            allocated_before_bytes=1000, reserved_before_bytes=2 * 2**20, snapshot=_snapshot())
    xs, series, reserved = timeline_series(m)
    assert len(xs) == 7  # free_requested is not an event of the live count
    assert series["before the step"] == [900] * 7
    assert series["forward"] == [0, 0, 1000, 1000, 0, 0, 0]
    assert series["backward"] == [0, 0, 0, 500, 500, 500, 500]
    assert series["optimizer"] == [0, 0, 0, 0, 0, 300, 0]
    assert reserved[0] == 2 * 2**20 and reserved[-1] == 4 * 2**20
    png = save_cuda_timeline_png(m, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_comes_from_history_recorded_around_the_steady_step_only(tmp_path):
    log: list[str] = []
    png = tmp_path / "cuda.png"
    result = _profile(log, FakeCuda(log, snapshot=_snapshot()), timeline=str(png), repeats=1)
    core = [x for x in log if x != "synchronize"]
    assert core[3:9] == ["step", "reset", "history on", "step", "snapshot", "history off"]
    assert png.stat().st_size > 5_000 and result.peak_bytes == 3 * GiB


def test_meter_turns_history_off_when_the_step_fails():
    log: list[str] = []
    meter = CudaStepMeter(FakeCuda(log), history=True)
    try:
        with meter.around():
            raise torch.OutOfMemoryError("out of memory")
    except torch.OutOfMemoryError:
        pass
    assert log[-1] == "history off" and meter.result is None
