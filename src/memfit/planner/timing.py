"""Step time on a GPU preset, from the ops the plan's own step runs (no GPU needed).

The step is traced once on fake tensors, as ``estimate`` traces it (memfit.memory.faketrace, with
the CUDA kernel model for GPU presets), with an :class:`~memfit.planner.opcost.OpRecorder` around
the steady-state step: every ATen op with its FLOPs, bytes, dtype and host transfers. What a
technique costs is then what it runs: recomputed blocks, more and smaller micro-batch kernels,
per-chunk loss kernels, per-parameter optimizer updates, copies over the host link.

Each op's GPU and CPU seconds come from memfit.planner.roofline (the roofline, the constants
fitted on the H100: NOTE [ Step-time calibration ] there). Two clocks run through the ops: the CPU
issues an op at ``c += cpu``, the GPU runs it at ``g = max(g, c) + gpu``; a scalar read of a device value
(``.item()``), a host op or a library op that synchronises (bitsandbytes' update) makes the CPU
wait for the GPU; offloaded optimizer states are prefetched on a side stream (a third clock) that
the update reading them waits for (NOTE [ Prefetch overlap ]). The step ends when both are done. So
a small model is CPU-bound (launches), a large one GPU-bound, and more micro-batches cost CPU time
first.

``compile: blocks|full`` is not traced op by op here (Inductor's fused kernels are opaque to a
dispatch mode): the eager step is traced and the memory-bound GPU time and CPU time of its forward
and backward are scaled by ``COMPILE_FUSION`` (the optimizer stays eager), solved so that GPT-2
(124M, bf16, batch 8 x 1024) goes from the recorded eager 75.7 ms to the recorded compiled 35.2 ms
on the H100 (``h100-handwritten-gpt2-compile.jsonl``), and for ``blocks`` by its own
``COMPILE_FUSION_BLOCKS`` (memfit's GPT-2 step compiled by blocks, 55.4 ms against 70.3 eager);
Inductor's kernels that the step does dispatch through a predicted wrapper (torchao's update) are
recorded as such (NOTE [ Compiled kernels in the step time ] in memfit.planner.opcost);
``checkpointing: budget:F`` multiplies by the recorded slowdown at that budget (1.187 at 0.5,
1.244 at 0.1, interpolated; 1 at F = 1: memfit.techniques.checkpointing.recorded_cost).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time

from memfit.devices import Device
from memfit.memory.categories import STEADY_STEP
from memfit.memory.report import MemoryReport
from memfit.planner.opcost import OpRecorder
from memfit.planner.ops import (
    AFTER_COMPUTE,
    BACKGROUND,
    COMM,
    COMM_STREAM,
    COMPILED,
    D2H,
    FUSED_HOST,
    H2D,
    HOST,
    OUT_STREAM,
    PHASES,
    RECOMPUTE,
    SCALAR,
    SIDE_STREAM,
    SYNC,
    SYNC_AFTER,
    VIEW,
    WAIT,
    WORKER,
    Op,
)
from memfit.planner.roofline import H100, Constants, Rates, StepTime
from memfit.plans import Plan
from memfit.target import Target
from memfit.techniques.checkpointing import recorded_cost
from memfit.techniques.offload import STASH

FORWARD_PHASE = PHASES.index("forward")
OPTIMIZER_PHASE = PHASES.index("optimizer")


def _in_graph(op: Op, fused: float) -> float:
    """The compile fusion factor an op's time is scaled by: forward and backward ops of the model's
    graph; not the optimizer, nor a compiled update stepped in backward (Inductor's code already)."""
    return fused if op.phase in (2, 3) and not op.flags & COMPILED else 1.0


# NOTE [ Collectives ]
# With sharding (FSDP2) a rank's step has collectives: an all-gather of each block's parameters
# before its forward (and its backward), a reduce-scatter of its gradients after its backward. The
# fake trace runs FSDP2's own code against a fake process group, so the recorder sees each
# collective where FSDP2 issues it (COMM ops, priced at what one rank sends over the interconnect:
# ring algorithms, (N - 1) / N of the gathered or reduced bytes, at ``comm_eff`` of the card's
# NVLink or PCIe bandwidth, plus ``comm_latency``), the ops FSDP2 runs on its own streams (copies
# into and out of the flat buffers, the division of the reduced gradients: COMM_STREAM), and the
# first compute-stream op that reads what a collective wrote (WAIT). The collectives and FSDP2's
# stream ops run in order on one clock of their own, from when the CPU issues them (a prefetched
# all-gather overlaps the block computing before it); a reduce-scatter first waits for the compute
# stream, as does whatever FSDP2 runs on its streams after telling them to (``wait_stream``: the
# gradients just made; the first all-gather of a step, after the optimizer). A WAIT holds the compute
# stream until that clock has passed the op it reads; before the optimizer the compute stream waits
# for all of it (FSDP2's final backward callback waits for the last reduce-scatter). Those waits are
# the exposed communication, the step's own part. Nothing here was measured on several GPUs;
# the bandwidths are the specification sheets'.
#
# NOTE [ Prefetch overlap ]
# Offloaded optimizer states are fetched on a side stream one parameter ahead of the update, so a
# fetch could in principle run while the GPU still works through the backward the CPU issued
# earlier. The H100 recordings say it does not help that much: GPT-2's offload costs what its
# copies cost one after the other (+55 ms for 2 x 1 GB). The model therefore starts a prefetch no
# earlier than the compute stream's position when it is issued; it overlaps the update of the
# previous parameter and its copy out (at ``duplex`` slowdown), not the backward.
#
# NOTE [ Host optimizer ]
# Offloaded activations go out on a stream of their own too (OUT_STREAM in forward), the compute
# stream waiting for the oldest copy when more than STASH are in flight, and for all of them before
# backward. With offloaded optimizer states (memfit.techniques.offload_optimizer) gradients go out on a stream
# of their own as backward makes them (OUT_STREAM: after what the compute stream has queued, not
# delaying it), a worker thread runs each parameter's update on the host once its gradient is out
# (WORKER host ops: host bytes at HOST_BW, on the worker's clock, not the step's CPU) and copies the
# parameter back on another stream (WORKER H2D). The step waits for the worker and that stream before
# its next optimizer-phase op, and ends when every clock has.
#
# NOTE [ Beside the next step ]
# The EMA on the host (memfit.techniques.ema) enqueues its copies of the weights on a side stream at
# the end of the step and averages them in a worker thread while the next step runs; the next
# update waits for the previous one. In the steady state a step therefore lasts at least that chain
# (the copies, then the averaging), and otherwise costs only issuing the copies.
def simulate(ops: list[Op], device: Device, k: Constants = H100, *, fused: float = 1.0) -> StepTime:
    """Run the ops through the CPU and GPU clocks (see the module docstring)."""
    rates = Rates.of(device, k)
    c = g = side = out_end = 0.0  # out_end: when the last device-to-host copy ends
    ready: dict[int, float] = {}
    busy = dict.fromkeys(("forward", "backward", "recompute", "optimizer", "transfers", "communication"), 0.0)
    host = 0.0
    kernels = 0
    w = w_in = out = worker = 0.0  # NOTE [ Host optimizer ]: the worker thread, the stream in, the stream out; its busy seconds
    joined = True
    beside = 0.0  # NOTE [ Beside the next step ]
    stash: collections.deque = collections.deque()  # when offloaded activations' copies out end
    comm = 0.0  # NOTE [ Collectives ]: FSDP2's streams
    done: dict[int, float] = {}  # serial -> when a collective (or an op on FSDP2's streams) last ended
    reduced = False  # the compute stream waited for the collectives before the optimizer
    for op in ops:
        kind = op.kind
        if kind == WAIT or (comm and not reduced and op.phase >= OPTIMIZER_PHASE):
            end = done.get(op.key, 0.0) if kind == WAIT else comm
            reduced = reduced or op.phase >= OPTIMIZER_PHASE
            if end > g:
                busy["communication"] += end - g
                g = end
            if kind == WAIT:
                continue
        if op.flags & BACKGROUND:
            if kind == D2H:
                c += rates.cpu(op)
                beside += rates.gpu(op)
                busy["transfers"] += rates.gpu(op)
            elif kind == HOST:
                beside += op.host_bytes / k.host_bw
                host += op.host_bytes / k.host_bw
            continue
        if op.flags & WORKER:
            joined = False
            w, w_in, dt = _on_worker(op, rates, w, w_in, max(c, out))
            host += dt if kind == HOST else 0.0
            worker += dt if kind != H2D else 0.0
            busy["transfers"] += dt if kind == H2D else 0.0
            continue
        if not joined and op.phase >= PHASES.index("optimizer"):  # the step waits for the updates
            c, g, joined = max(c, w), max(g, w_in), True
        if stash and op.phase != FORWARD_PHASE:  # backward waits for every copy out still in flight
            g = max(g, stash[-1])
            stash.clear()
        in_graph = _in_graph(op, fused)
        c += rates.cpu(op) * in_graph
        if kind == COMM or (op.flags & COMM_STREAM and kind not in (VIEW, SCALAR)):
            dt = op.nbytes / rates.p2p + k.comm_latency if kind == COMM else rates.gpu(op)
            comm = max(comm, c, g if op.flags & AFTER_COMPUTE else 0.0) + dt
            done[op.key] = comm
            continue
        if kind == VIEW or kind == SCALAR:
            continue
        if kind == SYNC:
            c = max(c, g)
            continue
        if kind == HOST:  # blocking pageable copy of its device inputs, then the op on the host CPU
            c = max(c, g, out)
            dt = op.nbytes / (rates.link * 0.5) + op.host_bytes / k.host_bw
            c += dt
            host += dt
            continue
        dt = rates.gpu(op, in_graph)
        kernels += 1
        if op.flags & OUT_STREAM:  # after what the compute stream has queued, beside what follows
            out = max(out, g, c) + dt
            busy["transfers"] += dt
            if op.phase == FORWARD_PHASE:  # offloaded activations: forward waits beyond STASH in flight
                stash.append(out)
                if len(stash) > STASH:
                    g = max(g, stash.popleft())
            continue
        if op.flags & SIDE_STREAM:  # a host-to-device prefetch, sharing the link with copies out
            start = max(side, c, g)  # NOTE [ Prefetch overlap ]
            side = start + _duplex(dt, out_end - start, k.duplex)
            ready[op.key] = side
            continue
        start = max(g, c)
        if ready and op.key in ready:
            wait = ready.pop(op.key)
            if wait > start:
                busy["transfers"] += wait - start
                start = wait
        if kind == D2H:
            dt = _duplex(dt, side - start, k.duplex)
            out_end = start + dt
        g = start + dt
        if op.flags & SYNC_AFTER:
            c = max(c, g)
        phase = "transfers" if kind in (H2D, D2H) else "recompute" if op.flags & RECOMPUTE else \
            PHASES[op.phase] if PHASES[op.phase] in busy else "optimizer"
        busy[phase] += dt
    total = max(c, g, w, w_in, out, beside, comm)
    cpu_bound = max(0.0, total - sum(busy.values()) - host)
    cpu_seconds = sum(rates.cpu(op) * _in_graph(op, fused) for op in ops)
    return StepTime(seconds=total, **busy, host=host, worker=worker, cpu_bound=cpu_bound, cpu_seconds=cpu_seconds,
                    kernels=kernels, ops=len(ops))


def _on_worker(op: Op, rates: Rates, w: float, w_in: float, ready: float) -> tuple[float, float, float]:
    """A worker-thread op of the host optimizer: (worker clock, stream-in clock, its seconds)."""
    k = rates.k
    if op.kind == HOST:
        dt = op.host_bytes / (k.host_fused_bw if op.flags & FUSED_HOST else k.host_bw)
        return max(w, ready) + dt, w_in, dt
    if op.kind == H2D:
        dt = rates.gpu(op)
        return w, max(w_in, w) + dt, dt
    dt = rates.cpu(op)  # (Python work: the optimizer.step() call, step counters)
    return w + dt, w_in, dt


def _duplex(seconds: float, overlap: float, slowdown: float) -> float:
    """A copy that overlaps a copy the other way for ``overlap`` seconds runs that part slower."""
    return seconds + min(seconds, max(0.0, overlap)) * (slowdown - 1.0)


# -- the API -----------------------------------------------------------------------------------------
def steady_step_recorder(recorder: OpRecorder):
    """``around_step`` for ``run_tracked``: record the steady-state step's ops into ``recorder``
    (the planner records time and memory in one trace)."""
    return lambda i: recorder if i == STEADY_STEP else contextlib.nullcontext()


def eager_plan(plan: Plan) -> tuple[Plan, float, list[str]]:
    """The plan whose eager step is traced (``plan`` without compile and memory budget), the
    recorded budget slowdown, and notes."""
    compiled = plan.config("compile")
    if compiled.is_default:
        return plan, 1.0, []
    budget = getattr(plan.config("checkpointing"), "fraction", None)
    changes = {"compile": "none"}
    slowdown = 1.0
    if budget is not None:
        changes["checkpointing"] = "none"
        slowdown = recorded_cost(float(budget))[0]
    notes = [f"compile: {compiled.mode}: the eager step's memory-bound and CPU time in forward and backward "
             f"scaled by the fitted fusion factor" +
             (f"; budget {budget}: x{slowdown:.3f} (recorded on GPT-2)" if budget is not None else "")]
    return dataclasses.replace(plan, **changes), slowdown, notes


def time_from_ops(ops: list[Op], target: Target, k: Constants = H100) -> StepTime:
    """The step time of ``target`` from the ops recorded on its steady-state step."""
    mode = target.plan.config("compile").mode
    compiled = mode != "none"
    fused = k.compile_fusion_blocks if mode == "blocks" else k.compile_fusion if compiled else 1.0
    st = simulate(ops, target.device, k, fused=fused)
    if compiled:
        _, slowdown, notes = eager_plan(target.plan)
        st.factor = slowdown
        st.notes = notes
        for name in ("seconds", *st.parts()):
            setattr(st, name, getattr(st, name) * slowdown)
    return st


def record_ops(target: Target, *, as_planned: bool = False) -> list[Op]:
    """The ops of ``target``'s steady-state step, from one fake trace (its eager step for a
    compiled plan, see :func:`eager_plan`; ``as_planned``: the compiled step's own, Inductor's kernels
    as its wrapper launches them: tools.fit.compiled_ops)."""
    from memfit.memory.faketrace import run_tracked
    from memfit.quiet import silenced_warnings

    traced = target if as_planned else target.with_plan(eager_plan(target.plan)[0])
    recorder = OpRecorder()
    with silenced_warnings():
        run_tracked(traced, fake=True, around_step=steady_step_recorder(recorder))
    return recorder.ops


def record_step(target: Target, on_tracker=None) -> tuple[MemoryReport, list[Op]]:
    """One fake trace of ``target``'s step giving both what the planner needs: its memory report (as
    ``estimate`` gives it) and the ops of its steady-state step. A compiled plan takes two: its
    compiled step for memory, its eager step for the ops (:func:`eager_plan`).

    ``on_tracker(tracker)``: told of the memory tracker of an eager plan's trace (compiled: not)."""
    from memfit.memory.estimate import estimate_target, plan_notes
    from memfit.memory.faketrace import run_tracked
    from memfit.memory.report import report_for
    from memfit.quiet import silenced_warnings

    t0 = time.perf_counter()
    if not target.plan.config("compile").is_default:
        return estimate_target(target, fallback=False), record_ops(target)
    recorder = OpRecorder()
    with silenced_warnings():
        run = run_tracked(target, fake=True, around_step=steady_step_recorder(recorder))
    notes = plan_notes(target.plan)
    report = report_for(run.tracker, target, "fake", notes=notes, trace_seconds=time.perf_counter() - t0)
    if on_tracker is not None:
        on_tracker(run.tracker)
    return report, recorder.ops


def trace_step(target: Target, k: Constants = H100, on_tracker=None) -> tuple[MemoryReport, StepTime, list[Op]]:
    """:func:`record_step`, and the step time of its ops."""
    t0 = time.perf_counter()
    report, ops = record_step(target, on_tracker)
    st = time_from_ops(ops, target, k)
    st.trace_seconds = time.perf_counter() - t0
    return report, st, ops


def step_seconds(target: Target, k: Constants = H100) -> StepTime:
    """Predict one steady-state training step of ``target`` on its device (a GPU preset), from one
    fake trace of the plan's own step."""
    if not target.device.is_gpu:
        raise ValueError(f"step_seconds: the op-level time model is for GPU targets, got device "
                         f"{target.device.name!r}; CPU plans are timed by short real steps "
                         "(memfit.planner.cost.calibrate)")
    t0 = time.perf_counter()
    st = time_from_ops(record_ops(target), target, k)
    st.trace_seconds = time.perf_counter() - t0
    return st
