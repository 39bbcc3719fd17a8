"""Running the TrainStep under the tracker, on fake tensors (prediction) or real ones (measurement).

Both paths call :func:`run_tracked`: the same ``build_step``, the same batch, the same two steps.
Step 1 creates the optimizer states; step 2 (``STEADY_STEP``) is the steady state whose peak is
reported (a workload whose steady state comes later runs ``warmup_steps`` before them: Wan 2.2's experts).
A fake trace also enters what the plan's techniques need to take a real run's code path on fake tensors
(``Config.trace_context``) and, for a GPU target, the CUDA kernel model.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from memfit.devices import Device
from memfit.errors import TraceError, is_trace_error, trace_error_op
from memfit.memory.adapters import fsdp_buffers, real_code_paths, rng_states_seen
from memfit.memory.categories import STEADY_STEP
from memfit.memory.cuda import cuda_kernel_model
from memfit.memory.heap import frozen_heap
from memfit.memory.reference_kernels import kernel_fallbacks_listed
from memfit.memory.routing import BALANCED, routing_mode
from memfit.memory.tracker import MemoryTracker
from memfit.memory.triton_launches import fake_triton_launches
from memfit.memory.workspaces import probe_for
from memfit.step import TrainStep, build_step, make_batch
from memfit.target import Target
from memfit.untraced_imports import imports_outside_the_trace


@dataclass
class TrackedRun:
    tracker: MemoryTracker
    step: TrainStep
    seconds: float
    kernels: Any = None
    """The CUDA kernel model that was active (GPU targets), with what it booked."""
    routing: Any = None
    """What the routing mode answered (fake traces: NOTE [ Routing on fake tensors ])."""


def run_tracked(target: Target, *, fake: bool, steps: int = STEADY_STEP,
                outer: contextlib.AbstractContextManager | None = None, around_step=None,
                around_build=None, routing: str = BALANCED) -> TrackedRun:
    """Build the target's step and run ``steps`` steps under a :class:`MemoryTracker`.

    ``outer`` wraps everything (e.g. a profiler); ``around_step(i)`` returns a context manager put
    around step ``i`` (e.g. a profiler range marking the steady-state step); ``around_build()`` one
    put around building the step (loading the model: its own peak). ``routing``: what a fake trace
    assumes of data-dependent mixture-of-experts routing (NOTE [ Routing on fake tensors ]).
    """
    with frozen_heap(collect=not fake):  # NOTE [ Frozen heap ]
        return _run_tracked(target, fake=fake, steps=steps, outer=outer, around_step=around_step,
                            around_build=around_build, routing=routing)


def _run_tracked(target: Target, *, fake: bool, steps: int, outer: contextlib.AbstractContextManager | None,
                 around_step, around_build=None, routing: str = BALANCED) -> TrackedRun:
    from memfit.fake_mode import fake_mode

    device = target.device
    tracker = MemoryTracker(assume_scalars=fake, probe=probe_for(device) if fake else None)
    hooks: list[Any] = []
    t0 = time.perf_counter()
    kernels = routed = None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(outer or contextlib.nullcontext())
            stack.enter_context(imports_outside_the_trace())  # NOTE [ Modules loaded during a trace ]
            if fake:
                stack.enter_context(fake_mode())
            stack.enter_context(tracker)
            stack.enter_context(fsdp_buffers(tracker, target.plan.config("shard").fsdp2))
            if not device.is_gpu:
                stack.enter_context(rng_states_seen(tracker))  # NOTE [ RNG states ]
            if fake:
                _enter_trace_contexts(stack, target)
                routed = stack.enter_context(routing_mode(routing, tracker)).answers
                stack.enter_context(fake_triton_launches(tracker))  # NOTE [ Triton kernels on fake tensors ]
                if device.is_gpu:
                    kernels = stack.enter_context(_cuda_kernel_model(device, tracker))
            with (around_build() if around_build else contextlib.nullcontext()):
                step = build_step(target)
            if fake:
                stack.enter_context(kernel_fallbacks_listed(tracker, step.model))  # NOTE [ Kernel libraries missing here ]
            tracker.state.built = len(tracker.state.events)
            params = [p for p in step.model.parameters()]
            tracker.label(params, "parameters")
            for p in params:
                if p.requires_grad:
                    hooks.append(p.register_post_accumulate_grad_hook(lambda q: tracker.label(q.grad, "gradients")))
            batch = make_batch(target)
            tracker.label(batch, "inputs")
            with step.observed_by(tracker):
                for _ in range(target.workload.warmup_steps):  # (before the first "step" mark: not a traced step)
                    step.run(batch)
                    tracker.label(optimizer_state_tensors(step.optimizer), "optimizer_states")
                for i in range(1, steps + 1):
                    gc.collect()
                    tracker.mark("step")
                    with (around_step(i) if around_step else contextlib.nullcontext()):
                        loss = step.run(batch)
                        del loss
                    tracker.label(optimizer_state_tensors(step.optimizer), "optimizer_states")
                    # (an update may give a parameter new storage: galore-torch's 8-bit AdamW assigns ``p.data``)
                    tracker.label(params, "parameters")
                    # (FSDP2 sets its sharded gradients itself: no accumulate-grad hook sees them)
                    tracker.label([p.grad for p in params if p.grad is not None], "gradients")
                tracker.mark("end")
    except Exception as e:
        if fake and is_trace_error(e) and not isinstance(e, TraceError):
            op = trace_error_op(e)
            raise TraceError(f"fake-tensor tracing failed at {op}: {str(e).splitlines()[0][:200]}", op=op) from e
        raise
    finally:
        for h in hooks:
            h.remove()
    return TrackedRun(tracker=tracker, step=step, seconds=time.perf_counter() - t0, kernels=kernels, routing=routed)


def optimizer_state_tensors(optimizer) -> list:
    """The tensors an optimizer's state holds: its values, and the tensors an object among them holds
    (GaLore's and APOLLO's projectors keep their projection matrix as an attribute)."""
    out = []
    for state in optimizer.state.values():
        for value in state.values():
            out.append(value)
            if not isinstance(value, (torch.Tensor, int, float, str, bool)) and hasattr(value, "__dict__"):
                out.extend(tree_leaves(vars(value)))
    return out


def _enter_trace_contexts(stack: contextlib.ExitStack, target: Target) -> None:
    """What a fake trace of the target's step needs to take a real run's code paths."""
    stack.enter_context(real_code_paths())
    for config in target.plan.techniques:
        stack.enter_context(config.trace_context())


def trainable_parameters(target: Target) -> int:
    """How many parameters the target's step trains, from its step built on fake tensors (no memory). The
    build's scalar reads are answered as in a trace (NOTE [ Assumed scalars ]: ``trunc_normal_``'s
    ``mask.any()`` in Gemma 3's SigLIP init raised on a bare fake tensor)."""
    from memfit.fake_mode import fake_mode

    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_mode())
        stack.enter_context(MemoryTracker(assume_scalars=True))
        _enter_trace_contexts(stack, target)
        step = build_step(target)
        return sum(p.numel() for p in step.model.parameters() if p.requires_grad)


def _cuda_kernel_model(device: Device, tracker: MemoryTracker):
    """See NOTE [ CUDA kernel model ] in memfit.memory.cuda."""
    return cuda_kernel_model(device, tracker)
