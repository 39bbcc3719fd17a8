"""Measuring one step on a CUDA GPU with the caching allocator's own counters and history."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.memory.timeline import pyplot_for

HISTORY_ENTRIES = 2_000_000
PHASES = ("before the step", "forward", "backward", "optimizer")


# NOTE [ CUDA measurement ]
# On a GPU every tensor and every kernel workspace (cuBLAS, cuDNN, flash attention's scratch) is a
# block of PyTorch's caching allocator, so the allocator's statistics are the measurement: reset the
# peak statistics just before the steady-state step, and read ``max_memory_allocated`` (bytes in
# live blocks, what ``MemoryReport.peak_bytes`` predicts) and ``max_memory_reserved`` (bytes
# cudaMalloc'd into segments, what ``reserved_bytes`` predicts) just after it. The CUDA context and
# library handles live outside the allocator; ``total - free`` from ``mem_get_info`` shows them.
#
# The timeline comes from the allocator's history (``torch.cuda.memory._record_memory_history``),
# recorded over the same step: every alloc and free with its stack. Bytes are stacked by what held
# them: blocks from before the step (weights, states, gradients, the batch) and blocks allocated in
# forward, backward (autograd's device thread) or the optimizer, as the allocation's stack says.
@dataclass
class CudaStepMeasurement:
    allocated_peak_bytes: int = 0
    """``max_memory_allocated`` over the step."""
    reserved_peak_bytes: int = 0
    """``max_memory_reserved`` over the step."""
    allocated_before_bytes: int = 0
    reserved_before_bytes: int = 0
    device_used_bytes: int | None = None
    """``total - free`` (``mem_get_info``) after the step: the CUDA context and library handles included."""
    snapshot: dict[str, Any] | None = field(default=None, repr=False)
    """The allocator snapshot with the step's history (when recorded)."""


class CudaStepMeter:
    """``with meter.around():`` one step; then ``meter.result``. ``cuda`` is ``torch.cuda`` (a stand-in in tests)."""

    def __init__(self, cuda=None, history: bool = False):
        if cuda is None:
            import torch
            cuda = torch.cuda
        self.cuda = cuda
        self.history = history
        self.result: CudaStepMeasurement | None = None

    @contextlib.contextmanager
    def around(self):
        c = self.cuda
        c.synchronize()
        c.reset_peak_memory_stats()
        m = CudaStepMeasurement(allocated_before_bytes=c.memory_allocated(), reserved_before_bytes=c.memory_reserved())
        if self.history:
            c.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
        try:
            yield m
            c.synchronize()
        finally:
            if self.history:
                try:
                    m.snapshot = c.memory._snapshot()
                finally:
                    c.memory._record_memory_history(enabled=None)
        m.allocated_peak_bytes = c.max_memory_allocated()
        m.reserved_peak_bytes = c.max_memory_reserved()
        free, total = c.mem_get_info()
        m.device_used_bytes = total - free
        self.result = m


def phase_of_stack(frames: list[dict]) -> str:
    """forward / backward / optimizer, from an allocation's stack (Python and C++ frames)."""
    optimizer = False
    for f in frames:
        name, filename = f.get("name", ""), f.get("filename", "")
        if "Engine::thread_main" in name or "torch/autograd/graph.py" in filename and name == "_engine_run_backward":
            return "backward"
        if "/torch/optim/" in filename or "techniques/optimizers.py" in filename or "grad_scaler.py" in filename:
            optimizer = True
    return "optimizer" if optimizer else "forward"


def timeline_series(m: CudaStepMeasurement) -> tuple[list[int], dict[str, list[int]], list[int]]:
    """(event index, {phase: live bytes allocated in it}, reserved bytes) over the recorded step.

    Blocks alive when recording started are "before the step"; their frees lower that band."""
    if not m.snapshot:
        raise ValueError("timeline_series: no allocator history was recorded (CudaStepMeter(history=True))")
    trace = m.snapshot["device_traces"][0] if m.snapshot.get("device_traces") else []
    live = dict.fromkeys(PHASES, 0)
    live["before the step"] = m.allocated_before_bytes
    reserved = m.reserved_before_bytes
    owner: dict[int, str] = {}
    xs, series, res = [], {p: [] for p in PHASES}, []
    for i, e in enumerate(trace):
        action, size, addr = e["action"], e["size"], e["addr"]
        if action == "alloc":
            owner[addr] = phase_of_stack(e.get("frames", []))
            live[owner[addr]] += size
        elif action == "free_completed":
            live[owner.pop(addr, "before the step")] -= size
        elif action == "segment_alloc":
            reserved += size
        elif action == "segment_free":
            reserved -= size
        else:
            continue
        xs.append(i)
        for p in PHASES:
            series[p].append(live[p])
        res.append(reserved)
    return xs, series, res


def save_cuda_timeline_png(m: CudaStepMeasurement, path: str | Path, title: str = "") -> Path:
    """The step's live bytes stacked by the phase that allocated them, with reserved bytes as a line."""
    plt, path = pyplot_for(path)
    xs, series, reserved = timeline_series(m)
    colors = {"before the step": "#4c72b0", "forward": "#c44e52", "backward": "#dd8452", "optimizer": "#55a868"}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.stackplot(xs, *[[b / 2**20 for b in series[p]] for p in PHASES], labels=[f"allocated: {p}" for p in PHASES],
                 colors=[colors[p] for p in PHASES], linewidth=0)
    ax.plot(xs, [b / 2**20 for b in reserved], color="black", linewidth=0.8, label="reserved")
    ax.axhline(m.allocated_peak_bytes / 2**20, color="gray", linestyle="--", linewidth=0.6,
               label="max_memory_allocated")
    ax.set_xlabel("caching-allocator events in the steady-state step")
    ax.set_ylabel("MiB")
    ax.set_title(title or "CUDA caching allocator over the step")
    ax.legend(loc="lower right", fontsize=7, ncol=2, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
