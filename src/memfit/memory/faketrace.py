"""Running the TrainStep under the tracker, on fake tensors (prediction) or real ones (measurement).

Both paths call :func:`run_tracked`: the same ``build_step``, the same batch, the same two steps.
Step 1 creates the optimizer states; step 2 is the steady state whose peak is reported.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from typing import Any

from memfit.devices import Device
from memfit.errors import TraceError
from memfit.memory.adapters import real_code_paths
from memfit.memory.heap import frozen_heap
from memfit.memory.tracker import MemoryTracker
from memfit.memory.workspaces import probe_for
from memfit.plans import Plan
from memfit.step import NullObserver, TrainStep, build_step, make_batch
from memfit.workload import Workload

STEADY_STEP = 2


def is_trace_error(exc: BaseException) -> bool:
    """Did fake-tensor tracing fail (rather than the workload itself)?"""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)):
        return True
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
        if isinstance(exc, GuardOnDataDependentSymNode):
            return True
    except ImportError:  # pragma: no cover - older torch
        pass
    msg = str(exc)
    return "FakeTensor" in msg or "fake tensor" in msg.lower() or "meta tensor" in msg.lower()


def trace_error_op(exc: BaseException) -> str:
    """The ATen op a fake-tensor failure names, if any."""
    func = getattr(exc, "func", None)
    if func is not None:
        return str(func)
    import re
    m = re.search(r"aten\.[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)?", str(exc))
    return m.group(0) if m else type(exc).__name__


@dataclass
class TrackedRun:
    tracker: MemoryTracker
    step: TrainStep
    seconds: float
    kernels: Any = None
    """The CUDA kernel model that was active (GPU targets), with what it booked."""


def run_tracked(workload: Workload, plan: Plan, batch_size: int, device: Device, *, fake: bool,
                steps: int = STEADY_STEP, outer: contextlib.AbstractContextManager | None = None,
                around_step=None) -> TrackedRun:
    """Build the step and run ``steps`` steps under a :class:`MemoryTracker`.

    ``outer`` wraps everything (e.g. a profiler); ``around_step(i)`` returns a context manager put
    around step ``i`` (e.g. a profiler range marking the steady-state step).
    """
    with frozen_heap(collect=not fake):  # NOTE [ Frozen heap ]
        return _run_tracked(workload, plan, batch_size, device, fake=fake, steps=steps, outer=outer,
                            around_step=around_step)


def _run_tracked(workload: Workload, plan: Plan, batch_size: int, device: Device, *, fake: bool, steps: int,
                 outer: contextlib.AbstractContextManager | None, around_step) -> TrackedRun:
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = MemoryTracker(assume_scalars=fake, probe=probe_for(device) if fake else None)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    hooks: list[Any] = []
    t0 = time.perf_counter()
    kernels = None
    try:
        with outer or contextlib.nullcontext(), fake_mode, tracker, \
                (real_code_paths(bitsandbytes=plan.optimizer == "adamw8bit") if fake else contextlib.nullcontext()), \
                (_cuda_kernel_model(device, tracker) if fake and device.is_gpu else contextlib.nullcontext()) as kernels:
            step = build_step(workload, plan, batch_size, device)
            params = [p for p in step.model.parameters()]
            tracker.label(params, "parameters")
            for p in params:
                if p.requires_grad:
                    hooks.append(p.register_post_accumulate_grad_hook(lambda q: tracker.label(q.grad, "gradients")))
            batch = make_batch(workload, step.batch_size, device)
            tracker.label(batch, "inputs")
            step.observer = tracker
            for i in range(1, steps + 1):
                gc.collect()
                tracker.mark("step")
                with (around_step(i) if around_step else contextlib.nullcontext()):
                    loss = step.run(batch)
                    del loss
                tracker.label([v for s in step.optimizer.state.values() for v in s.values()], "optimizer_states")
            tracker.mark("end")
            step.observer = NullObserver()
    except Exception as e:
        if fake and is_trace_error(e):
            op = trace_error_op(e)
            raise TraceError(f"fake-tensor tracing failed at {op}: {str(e).splitlines()[0][:200]}", op=op) from e
        raise
    finally:
        for h in hooks:
            h.remove()
    return TrackedRun(tracker=tracker, step=step, seconds=time.perf_counter() - t0, kernels=kernels)


def _cuda_kernel_model(device: Device, tracker: MemoryTracker):
    """See NOTE [ CUDA kernel model ] in memfit.memory.cuda."""
    from memfit.memory.cuda import cuda_kernel_model
    return cuda_kernel_model(device, tracker)
