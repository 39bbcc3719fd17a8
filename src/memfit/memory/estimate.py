"""estimate: predict the peak memory of a training step on fake tensors (no memory, no GPU).

The steady-state step (the second: optimizer states exist) of the one TrainStep is traced under
``FakeTensorMode`` with the storage tracker. For ``cpu`` the tracked bytes are what the CPU
allocator sees (kernel scratch probed on this machine). For a GPU target (a preset, or the local
card with ``--device cuda``) the trace runs inside the CUDA kernel model (memfit.memory.cuda, see
NOTE [ CUDA kernel model ]): CUDA's attention backends, autocast lists, fused dropout, cuDNN RNNs
and foreach optimizers, plus what CUDA kernels allocate inside (cuBLAS workspaces per thread,
attention/reduction buffers, cuDNN workspaces). The timeline is then replayed through the
caching-allocator model, giving allocated and reserved bytes; the CUDA context is reported beside
them. Without a GPU a preset is traced on fake CPU tensors (memfit.devices.tensor_device); with one,
on fake CUDA tensors; the kernel model makes both take the same kernels.

When fake tracing fails (a data-dependent op such as ``nonzero``), the error names the op; if
the workload plausibly fits in this machine's memory, the same tracker measures a real run on
this CPU instead, and the report says so.
"""

from __future__ import annotations

import time

import torch

from memfit.devices import Device, available_host_bytes, cpu_device
from memfit.errors import TraceError
from memfit.memory.faketrace import run_tracked
from memfit.memory.report import MemoryReport, report_for, traced_device
from memfit.memory.routing import WORST, experts_facts
from memfit.memory.snapshot import check_snapshot_path, save_snapshot
from memfit.memory.timeline import save_timeline_png
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target
from memfit.techniques.adapter import adapter_facts
from memfit.techniques.compiled import GraphBreaks
from memfit.workload import Workload


def estimate(workload: Workload | str, plan: Plan | str | None = None, *, batch_size: int | None = None,
             device: str | Device = "cpu", seq_len: int | None = None, resolution: int | None = None,
             fallback: bool = True,
             timeline: str | None = None, snapshot: str | None = None) -> MemoryReport:
    """Predict the steady-state peak memory of one training step of ``workload`` under ``plan``.

    ``timeline``: also write the step's memory timeline, stacked by category, to this PNG file.
    ``snapshot``: also write the trace as a ``torch.cuda.memory._snapshot()`` pickle for PyTorch's
    memory_viz (memfit.memory.snapshot).
    """
    if snapshot:
        check_snapshot_path(snapshot)
    target = Target.resolve(workload, plan, batch_size, device, seq_len=seq_len, resolution=resolution)
    return estimate_target(target, fallback=fallback, timeline=timeline, snapshot=snapshot)


def estimate_target(target: Target, *, fallback: bool = True, timeline: str | None = None,
                    snapshot: str | None = None) -> MemoryReport:
    """:func:`estimate` of a resolved target."""
    t0 = time.perf_counter()
    notes = plan_notes(target.plan)
    method = "fake"
    try:
        try:
            with silenced_warnings():
                run = run_tracked(target, fake=True)
        except GraphBreaks as e:  # NOTE [ A broken graph is not predicted as compiled ]
            if not fallback:
                raise
            target = target.with_plan(without_compile(target.plan))
            notes = [f"{e}: predicted with the plan {target.plan.short()} instead", *plan_notes(target.plan)]
            with silenced_warnings():
                run = run_tracked(target, fake=True)
    except TraceError as e:
        if not fallback or target.plan.config("shard").fsdp2:  # a sharded step runs in N processes: no real fallback
            raise
        run = _real_fallback(target, e)
        method = "real-fallback"
        notes.insert(0, f"{e}; measured by a real run on this CPU with the same tracker")
    peak, worst = report_for(run.tracker, target, method).peak_bytes, None
    if method == "fake" and run.routing is not None and run.routing.calls:
        with silenced_warnings():  # the bound of NOTE [ Routing on fake tensors ]
            worst = report_for(run_tracked(target, fake=True, routing=WORST).tracker, target, method).peak_bytes
    sample = target.workload.info.sample
    facts = [*experts_facts(run.routing, run.step.model, worst, peak), *adapter_facts(run.step.model, target.plan.config("adapter")),
             *([f"one sample: {sample}"] if sample else []),
             *([target.workload.info.loaded] if target.workload.info.loaded else [])]
    report = report_for(run.tracker, target, method, notes=notes, trace_seconds=time.perf_counter() - t0,
                        facts=facts, worst_routing_peak_bytes=worst)
    if timeline:
        save_timeline_png(run.tracker, timeline, device=traced_device(target.device, method, target.tensor_device),
                          title=f"{target.describe()} · predicted on {target.device.name}")
    if snapshot:
        save_snapshot(run, snapshot, target=target, report=report)
    return report


def without_compile(plan: Plan) -> Plan:
    """``plan`` as an eager step: no compile, and no activation memory budget (which needs one)."""
    import dataclasses
    budget = getattr(plan.config("checkpointing"), "fraction", None) is not None
    return dataclasses.replace(plan, compile="none", **({"checkpointing": "none"} if budget else {}))


def _real_fallback(target: Target, err: TraceError):
    """Measure with the same tracker on real CPU tensors, if that plausibly fits here.

    The size check counts the parameters on the meta device (no memory) and allows 4x their bytes
    for gradients and Adam states, plus headroom; a workload bigger than that gets the trace error.
    """
    with torch.device("meta"):
        try:
            n_bytes = sum(p.numel() * p.element_size() for p in target.workload.model().parameters())
        except Exception:
            raise err from None
    need, avail = 4 * n_bytes + (256 << 20), available_host_bytes()
    if need > avail // 2:
        fix = "" if err.library else ("; make the workload traceable (avoid data-dependent ops such as .item() or "
                                      "nonzero in the step)")
        raise TraceError(f"{err}; a real-run fallback would need about {need / 2**30:.1f} GiB, more than half of the "
                         f"{avail / 2**30:.1f} GiB free here{fix}", op=err.op, library=err.library) from err
    return run_tracked(target.on(cpu_device()) if target.device.is_gpu else target, fake=False)


def plan_notes(plan) -> list[str]:
    """What a prediction of ``plan`` approximates: each technique's notes, and what a QLoRA plan's precision
    is not (memfit.techniques.half_weights.precision_notes)."""
    from memfit.techniques.half_weights import precision_notes
    return [*(note for config in plan.techniques for note in config.notes()), *precision_notes(plan)]
