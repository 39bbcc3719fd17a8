"""estimate: predict the peak memory of a training step on fake tensors (no memory, no GPU).

The steady-state step (the second: optimizer states exist) of the one TrainStep is traced under
``FakeTensorMode`` with the storage tracker. For ``cpu`` the tracked bytes are what the CPU
allocator sees (kernel scratch probed on this machine). For a GPU target (a preset, or the local
card with ``--device cuda``) the trace runs inside the CUDA kernel model (memfit.memory.cuda, see
NOTE [ CUDA kernel model ]): CUDA's attention backends, autocast lists, fused dropout, cuDNN RNNs
and foreach optimizers, plus what CUDA kernels allocate inside (cuBLAS workspaces per thread,
attention/reduction buffers, cuDNN workspaces). The timeline is then replayed through the
caching-allocator model, giving allocated and reserved bytes; the CUDA context is reported beside
them. Without a GPU a preset is traced on fake CPU tensors (memfit.step.tensor_device); with one,
on fake CUDA tensors; the kernel model makes both take the same kernels.

When fake tracing fails (a data-dependent op such as ``nonzero``), the error names the op; if
the workload plausibly fits in this machine's memory, the same tracker measures a real run on
this CPU instead, and the report says so.
"""

from __future__ import annotations

import time
import warnings

from memfit.devices import Device, get_device
from memfit.errors import TraceError, UserError
from memfit.memory import allocator
from memfit.memory.faketrace import run_tracked
from memfit.memory.report import MemoryReport, build_report, step_window
from memfit.plans import Plan
from memfit.techniques.precision import resolve_mode
from memfit.workload import Workload, load_workload


def resolve(workload: Workload | str, plan: Plan | str | None, batch_size: int | None,
            seq_len: int | None = None) -> tuple[Workload, Plan, int]:
    wl = load_workload(workload, seq_len=seq_len)
    if isinstance(plan, str):
        plan = Plan.load(plan)
    plan = plan or Plan()
    bs = batch_size or wl.default_batch_size
    if not isinstance(bs, int) or bs < 1:
        raise UserError(f"batch size must be a positive whole number, got {batch_size!r}")
    plan.check_implemented()
    plan.micro_batches(bs)
    return wl, plan, bs


def estimate(workload: Workload | str, plan: Plan | str | None = None, *, batch_size: int | None = None,
             device: str | Device = "cpu", seq_len: int | None = None, fallback: bool = True,
             timeline: str | None = None) -> MemoryReport:
    """Predict the steady-state peak memory of one training step of ``workload`` under ``plan``.

    ``timeline``: also write the step's memory timeline, stacked by category, to this PNG file.
    """
    wl, plan, bs = resolve(workload, plan, batch_size, seq_len)
    dev = get_device(device)
    t0 = time.perf_counter()
    failure: TraceError | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = run_tracked(wl, plan, bs, dev, fake=True)
    except TraceError as e:
        if not fallback:
            raise
        failure = e
        run = _real_fallback(wl, plan, bs, dev, e)
    report = report_for(run.tracker, wl, plan, bs, dev, "real-fallback" if failure else "fake")
    if plan.optimizer == "adamw8bit":
        from memfit.techniques.optimizers import ADAMW8BIT_FALLBACK, bitsandbytes_available
        if not bitsandbytes_available():
            report.approximations.insert(0, f"{ADAMW8BIT_FALLBACK}; this estimate is for that fallback")
    if failure:
        report.approximations.insert(0, f"{failure}; measured by a real run on this CPU with the same tracker")
    report.trace_seconds = time.perf_counter() - t0
    if timeline:
        from memfit.report.timeline import save_timeline_png
        save_timeline_png(run.tracker, timeline, device=_traced_device(dev, report.method),
                          title=f"{wl.name} · batch {bs} · {plan.describe()} · predicted on {dev.name}")
    return report


def _traced_device(dev: Device, method: str) -> str:
    from memfit.step import tensor_device
    return "cuda:0" if (dev.is_gpu and method != "real-fallback" and tensor_device(dev) == "cuda") else "cpu"


def report_for(tracker, wl: Workload, plan: Plan, bs: int, dev: Device, method: str) -> MemoryReport:
    report = _report_for(tracker, wl, plan, bs, dev, method)
    report.precision = resolve_mode(plan.precision, dev)
    return report


def _report_for(tracker, wl: Workload, plan: Plan, bs: int, dev: Device, method: str) -> MemoryReport:
    traced_device = _traced_device(dev, method)
    if not dev.is_gpu:
        return build_report(tracker, workload=wl.name, device_name=dev.name, device=traced_device,
                            batch_size=bs, plan=plan.to_dict(), method=method)
    report = build_report(tracker, workload=wl.name, device_name=dev.name, device=traced_device, batch_size=bs,
                          plan=plan.to_dict(), method=method, sizes=allocator.round_size)
    window = step_window(tracker, 2)
    alloc_peak, reserved, _ = allocator.replay(tracker, traced_device, window, getattr(tracker, "side_streams", None))
    # The report's breakdown uses 512-byte rounded storages; the replay also counts unsplit block
    # remainders. Their difference is allocator overhead, booked under "other".
    report.breakdown["other"] += alloc_peak - report.peak_bytes
    report.peak_bytes = alloc_peak
    report.reserved_bytes = reserved
    report.device_total_bytes = dev.total_bytes
    report.cuda_context_bytes = dev.context_bytes
    if method == "fake":
        # cuBLAS/cuBLASLt workspaces are in the trace (memfit.memory.cuda.blas), one per thread
        report.cuda_workspace_bytes = sum(r.nbytes for r in tracker.state.records
                                          if r.op.startswith(("cublas workspace", "cublaslt workspace")))
        report.approximations.append(
            f"CUDA kernels modelled for {dev.name} (sm{dev.compute_capability[0]}{dev.compute_capability[1]}, CUDA "
            f"{dev.cuda_version[0]}.{dev.cuda_version[1]}, cuDNN {dev.cudnn_version}): attention backend, autocast "
            "lists, foreach optimizers, cuBLAS/cuDNN workspaces, reduction buffers (memfit.memory.cuda); cuDNN "
            "convolution and RNN workspaces are calibrated estimates")
    else:
        ws = dev.workspace_bytes
        report.breakdown["other"] += ws
        report.peak_bytes += ws
        report.reserved_bytes = reserved + allocator.segment_size(ws) if ws else reserved
        report.cuda_workspace_bytes = ws
    if traced_device == "cpu" and method == "fake":
        report.approximations.append("traced on fake CPU tensors (no GPU here), with CUDA's kernel choices modelled")
    elif traced_device == "cpu":
        report.approximations.append("measured on this CPU: CPU kernel choices stand in for CUDA's")
    report.approximations.append(f"CUDA context ({dev.context_bytes >> 20} MiB) is a typical value for this card, "
                                 "not measured")
    return report


def _real_fallback(wl: Workload, plan: Plan, bs: int, dev: Device, err: TraceError):
    """Measure with the same tracker on real CPU tensors, if that plausibly fits here.

    The size check counts the parameters on the meta device (no memory) and allows 4x their bytes
    for gradients and Adam states, plus headroom; a workload bigger than that gets the trace error.
    """
    import torch

    from memfit.devices import cpu_device
    with torch.device("meta"):
        try:
            n_bytes = sum(p.numel() * p.element_size() for p in wl.model().parameters())
        except Exception:
            raise err from None
    need, avail = 4 * n_bytes + (256 << 20), _available_bytes()
    if need > avail // 2:
        raise TraceError(f"{err}; a real-run fallback would need about {need / 2**30:.1f} GiB but this machine has "
                         f"{avail / 2**30:.1f} GiB free; make the workload traceable (avoid data-dependent ops "
                         "such as .item() or nonzero in the step)", op=err.op) from err
    return run_tracked(wl, plan, bs, cpu_device() if dev.is_gpu else dev, fake=False)


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
