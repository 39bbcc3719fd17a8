"""Step time on a GPU preset, from the ops the plan's own step runs (no GPU needed).

The step is traced once on fake tensors, as ``estimate`` traces it (memfit.memory.faketrace, with
the CUDA kernel model for GPU presets), with an :class:`~memfit.planner.opcost.OpRecorder` around
the steady-state step: every ATen op with its FLOPs, bytes, dtype and host transfers. What a
technique costs is then what it runs: recomputed blocks, more and smaller micro-batch kernels,
per-chunk loss kernels, per-parameter optimizer updates, copies over the host link.

Each op's GPU time is a roofline with achievable fractions of the preset's peaks (names in capitals
are :class:`Constants` fields)::

    matmul      max(FLOPs / (peak[dtype] * MM_EFF[dtype]), bytes / (BW * MEM_EFF)) + MM_OVERHEAD
    attention   FLOPs (halved when causal) / (peak[dtype] * ATTN_EFF[dtype]), or bytes, + KERNEL
    other       bytes / (BW * MEM_EFF) + KERNEL            (elementwise, norms, reductions, casts)
    library op  max(bytes / BW, elements / CUSTOM_ELEMENTS) + KERNEL   (outside ATen: bitsandbytes)
    cuDNN RNN   FLOPs / (peak * MM_EFF) + RNN_STEP per time step, layer and direction
    _foreach    bytes / (BW * MEM_EFF) + KERNEL per FOREACH_CHUNK tensors (the optimizer step)
    host copy   bytes / (LINK * LINK_EFF) + COPY_LATENCY   (pinned, asynchronous, on its stream)
    host op     blocking pageable copy of its device inputs (half the pinned rate) + bytes / HOST_BW

fp32 matmuls run on CUDA cores (PyTorch leaves TF32 off for matmuls; ``FP32_SIMT``), fp32
convolutions on TF32 tensor cores (cuDNN's default). Eager PyTorch is also a CPU program: each op
costs CPU time to dispatch (``CPU_FORWARD``, ``CPU_BACKWARD``, ``CPU_OPTIMIZER`` by phase: Python
modules in forward, the C++ autograd engine in backward, Python optimizer loops), plus
``CPU_PY_MODE`` for an op that passes through a Python dispatch mode (selective checkpointing),
``CPU_CUSTOM`` for a library op (bitsandbytes), ``CPU_STEP_CALL`` per ``optimizer.step()`` call and
``CPU_PER_TENSOR`` per tensor of a foreach list. Two clocks run through the ops: the CPU issues an
op at ``c += cpu``, the GPU runs it at ``g = max(g, c) + gpu``; a scalar read of a device value
(``.item()``), a host op or a library op that synchronises (bitsandbytes' update) makes the CPU
wait for the GPU; offloaded optimizer states are prefetched on a side stream (a third clock) that
the update reading them waits for (NOTE [ Prefetch overlap ]). The step ends when both are done. So
a small model is CPU-bound (launches), a large one GPU-bound, and more micro-batches cost CPU time
first.

``compile: blocks|full`` is not traced op by op here (Inductor's fused kernels are opaque to a
dispatch mode): the eager step is traced and the memory-bound GPU time and CPU time of its forward
and backward are scaled by ``COMPILE_FUSION`` (the optimizer stays eager), solved so that GPT-2
(124M, bf16, batch 8 x 1024) goes from the recorded eager 75.7 ms to the recorded compiled 35.2 ms
on the H100 (``h100-handwritten-gpt2-compile.jsonl``);
``checkpointing: budget:F`` multiplies by the recorded slowdown at that budget (1.187 at 0.5,
1.244 at 0.1, interpolated; 1 at F = 1: memfit.techniques.checkpointing.recorded_cost).

NOTE [ Step-time calibration ]
The constants (:class:`Constants`) were fitted by ``python bench/planner_gpu.py --fit`` on the H100
rows of ``tests/data/h100.jsonl`` that ran one case at a time (rows 1-39, memfit's own TrainStep;
rows 40-75 ran four processes at once and are only reported). The fit minimises, by Nelder-Mead
over the constants' logarithms, the squared log error of each fit row's time ratio to plain bf16 of
the same workload and batch, plus half the mean squared log error of every clean row's absolute
time, plus a pull towards hardware-plausible values (``PRIOR`` there). Each technique is fitted on
one workload and held out on the other (GPT-2 124M at batch 8 x 1024; 4 Llama layers at 7B width,
batch 2 x 2048): fitted on GPT-2 fp32, blocks, offloaded activations, micro-batch 2, EMA on the
host, Adafactor, 8-bit AdamW, and bf16-pure + blocks + in-backward + chunks; on Llama selective,
chunks, offloaded optimizer states, bf16-pure + 8-bit + blocks. Residuals: fit rows within -7%..+7%
(ratio), held-out rows (GPT-2 fp16, selective, blocks + chunks, offloaded optimizer states, blocks
+ 8-bit; Llama blocks, micro-batch 1, bf16-pure + in-backward, 8-bit; MHA chunked attention) within
-9%..+6%; Spearman of the 22 ratios 0.994; absolute times of rows 1-39: median |error| 7%, Spearman
0.976, worst on small CPU-bound models and T5 (cnn -33%, t5 -18%, transformer -16%). The ratios are
what the planner ranks by.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field

from memfit.devices import Device
from memfit.memory.categories import STEADY_STEP
from memfit.memory.report import MemoryReport
from memfit.planner.opcost import (
    AFTER_COMPUTE,
    ATTENTION,
    BACKGROUND,
    COMM,
    COMM_STREAM,
    CUSTOM,
    D2H,
    FOREACH,
    H2D,
    HOST,
    MATMUL,
    MEMORY,
    OUT_STREAM,
    PHASES,
    PY_MODE,
    RECOMPUTE,
    RNN,
    SCALAR,
    SIDE_STREAM,
    STEP_CALL,
    SYNC,
    SYNC_AFTER,
    VIEW,
    WAIT,
    WORKER,
    Op,
    OpRecorder,
)
from memfit.plans import Plan
from memfit.target import Target
from memfit.techniques.checkpointing import recorded_cost
from memfit.techniques.offload import STASH

FORWARD_PHASE = PHASES.index("forward")
OPTIMIZER_PHASE = PHASES.index("optimizer")

FP32_SIMT = {"h100-80gb": 67e12, "h200-141gb": 67e12, "a100-80gb": 19.5e12, "a100-40gb": 19.5e12, "l4": 30.3e12}
"""fp32 FLOP/s without tensor cores where it differs from the preset's float32 (TF32) figure."""


@dataclass(frozen=True)
class Constants:
    """The time model's constants: fitted on the H100 (NOTE [ Step-time calibration ]) unless marked
    fixed; the fit's starting point and pull (its prior) is ``bench/planner_gpu.py``'s ``PRIOR``."""

    mm_eff_half: float = 0.7787
    """Achieved fraction of the bf16/fp16 tensor-core peak in large matmuls."""
    mm_eff_fp32: float = 0.8711
    """Achieved fraction of the fp32 CUDA-core (or TF32 for convolutions) peak."""
    mm_overhead: float = 4.456e-6
    """Fixed seconds per matmul kernel (tile ramp-up, small shapes)."""
    attn_eff_half: float = 0.355
    """Achieved fraction of the tensor-core peak in fused attention (flash / cuDNN / efficient)."""
    attn_eff_fp32: float = 0.3745
    mem_eff: float = 0.5633
    """Achieved fraction of memory bandwidth for memory-bound kernels (eager: many small kernels,
    strided copies, reductions)."""
    custom_elements: float = 3.302e10
    """Elements per second of an op outside ATen (bitsandbytes' blockwise 8-bit update: a search of
    the quantisation map per element makes it compute-bound), or its bytes if slower."""
    kernel: float = 2.827e-6
    """Minimum GPU seconds of one kernel."""
    foreach_chunk: int = 48
    """Tensors per launch of a multi-tensor-apply (``_foreach``) kernel (fixed)."""
    link_eff: float = 0.9886
    """Achieved fraction of the host link's bandwidth for pinned copies in one direction."""
    copy_latency: float = 8.771e-6
    duplex: float = 2.0
    """Copies both ways at once: each runs this much slower (2: no faster than in turn; the fit sits
    at that bound)."""
    host_bw: float = 1.099e10
    """Host-memory bytes/s of an op run on the host CPU (EMA's update on host weights)."""
    cpu_forward: float = 1.75e-5
    """CPU seconds to dispatch one ATen op in forward (Python modules, autocast)."""
    cpu_backward: float = 1.187e-5
    """The same in backward (the C++ autograd engine, saved-tensor hooks)."""
    cpu_optimizer: float = 1.582e-5
    """The same in the optimizer step (Python loops)."""
    cpu_per_tensor: float = 0.4e-6
    """CPU seconds per tensor of a ``_foreach`` list (fixed)."""
    cpu_py_mode: float = 1.646e-5
    """Extra CPU seconds per op that passes through a Python dispatch mode."""
    comm_eff: float = 0.8
    """Achieved fraction of the interconnect's bandwidth in a ring collective (fixed: NCCL's
    published bus bandwidths reach 75-85% of NVLink's; no multi-GPU run was recorded)."""
    comm_latency: float = 20e-6
    """Seconds per collective beyond its bytes (fixed, unmeasured)."""
    cpu_custom: float = 3.925e-5
    """Extra CPU seconds per op of a library outside ATen (reached through its Python wrappers:
    bitsandbytes' per-parameter 8-bit update)."""
    cpu_scalar: float = 1.5e-6
    """CPU seconds of an op on zero-dim host scalars (optimizer step counters; fixed)."""
    cpu_step_call: float = 1.098e-4
    """CPU seconds of one ``optimizer.step()`` call before its ops (per-parameter optimizers)."""
    rnn_step: float = 2.6e-5
    """GPU seconds per sequential step (time step x layer x direction) of a cuDNN RNN call."""
    compile_fusion: float = 0.2889
    """Compiled regions: the memory-bound GPU time and the CPU time of forward and backward are
    scaled by this (solved so that GPT-2's compiled/eager ratio is the recorded 0.465)."""


H100 = Constants()


@dataclass
class StepTime:
    """A predicted step time and where it goes (seconds). The GPU-side parts add up, with
    ``cpu_bound`` (the GPU waiting for the CPU to issue work) and ``host`` (work on the host CPU
    the GPU waits for), to ``seconds``."""

    seconds: float
    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    """Forward ops run again in backward (checkpointing, chunked loss)."""
    optimizer: float = 0.0
    transfers: float = 0.0
    """Host-device copies on the compute stream, and side-stream waits."""
    communication: float = 0.0
    """The compute stream waiting for collectives (sharding): what compute did not hide."""
    host: float = 0.0
    cpu_bound: float = 0.0
    cpu_seconds: float = 0.0
    """CPU time to issue the step (each op's dispatch)."""
    kernels: int = 0
    ops: int = 0
    factor: float = 1.0
    """Compile and memory-budget factor applied (1 for eager plans)."""
    trace_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def parts(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("forward", "backward", "recompute", "optimizer", "transfers",
                                               "communication", "host", "cpu_bound")}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in self.parts().items() if v >= 5e-5)
        return f"{self.seconds * 1e3:.1f} ms ({parts}; {self.kernels} kernels)"


# -- the per-op model ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rates:
    """A device's peaks and the constants, resolved once per prediction."""

    peak: dict
    bw: float
    link: float
    p2p: float
    """Interconnect bytes/s a collective achieves (NOTE [ Collectives ])."""
    k: Constants

    @classmethod
    def of(cls, device: Device, k: Constants) -> Rates:
        from memfit.devices import preset_for_card
        fl = device.peak_flops or {"float32": 1e12}
        name = device.name if device.name in FP32_SIMT or not device.name.startswith("cuda") else \
            preset_for_card(device.name)
        half = fl.get("bfloat16", fl.get("float16", fl.get("float32", 1e12)))
        tf32 = fl.get("float32", 1e12)
        return cls(peak={"half": half, "tf32": tf32, "fp32": FP32_SIMT.get(name, tf32)},
                   bw=(device.mem_bandwidth or 1e12) * k.mem_eff,
                   link=(device.host_link_bandwidth or 25e9) * k.link_eff,
                   p2p=(device.interconnect_bandwidth or device.host_link_bandwidth or 25e9) * k.comm_eff,
                   k=k)

    def gpu(self, op: Op, fused: float = 1.0) -> float:
        """GPU seconds of one op (``fused`` scales the memory-bound time of forward and backward
        ops: compiled regions; the optimizer stays eager)."""
        k, kind = self.k, op.kind
        if kind == MATMUL:
            eff = k.mm_eff_half if op.dtype == "half" else k.mm_eff_fp32
            return max(op.flops / (self.peak[op.dtype] * eff), op.nbytes / self.bw) + k.mm_overhead
        if kind == ATTENTION:
            eff = k.attn_eff_half if op.dtype == "half" else k.attn_eff_fp32
            flops = op.flops * (0.5 if op.is_causal else 1.0)
            return max(flops / (self.peak[op.dtype] * eff), op.nbytes / self.bw) + k.kernel
        if kind == MEMORY:
            if op.flags & CUSTOM:
                return max(op.nbytes / self.bw, op.elements / k.custom_elements) + k.kernel
            return fused * op.nbytes / self.bw + k.kernel
        if kind == RNN:
            eff = k.mm_eff_half if op.dtype == "half" else k.mm_eff_fp32
            return op.flops / (self.peak[op.dtype] * eff) + k.rnn_step * op.tensors
        if kind == FOREACH:
            return op.nbytes / self.bw + k.kernel * math.ceil(op.tensors / k.foreach_chunk)
        if kind in (H2D, D2H):
            return op.nbytes / self.link + k.copy_latency
        return 0.0

    def cpu(self, op: Op) -> float:
        k = self.k
        per_op = k.cpu_forward if op.phase == 2 else k.cpu_backward if op.phase == 3 else k.cpu_optimizer
        if op.flags & RECOMPUTE:
            per_op = k.cpu_forward
        if op.flags & STEP_CALL:
            return k.cpu_step_call
        if op.kind == SCALAR:
            return k.cpu_scalar
        extra = (k.cpu_py_mode if op.flags & PY_MODE else 0.0) + (k.cpu_custom if op.flags & CUSTOM else 0.0)
        return per_op + extra + (k.cpu_per_tensor * op.tensors if op.kind == FOREACH else 0.0)


def simulate(ops: list[Op], device: Device, k: Constants = H100, *, fused: float = 1.0) -> StepTime:
    """Run the ops through the CPU and GPU clocks (see the module docstring)."""
    rates = Rates.of(device, k)
    c = g = side = out_end = 0.0  # out_end: when the last device-to-host copy ends
    ready: dict[int, float] = {}
    busy = dict.fromkeys(("forward", "backward", "recompute", "optimizer", "transfers", "communication"), 0.0)
    host = 0.0
    kernels = 0
    w = w_in = out = 0.0  # NOTE [ Host optimizer ]: the worker thread, the stream in, the stream out
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
            busy["transfers"] += dt if kind == H2D else 0.0
            continue
        if not joined and op.phase >= PHASES.index("optimizer"):  # the step waits for the updates
            c, g, joined = max(c, w), max(g, w_in), True
        if stash and op.phase != FORWARD_PHASE:  # backward waits for every copy out still in flight
            g = max(g, stash[-1])
            stash.clear()
        in_graph = fused if op.phase in (2, 3) else 1.0
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
    cpu_seconds = sum(rates.cpu(op) * (fused if op.phase in (2, 3) else 1.0) for op in ops)
    return StepTime(seconds=total, **busy, host=host, cpu_bound=cpu_bound, cpu_seconds=cpu_seconds,
                    kernels=kernels, ops=len(ops))


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


# NOTE [ Prefetch overlap ]
# Offloaded optimizer states are fetched on a side stream one parameter ahead of the update, so a
# fetch could in principle run while the GPU still works through the backward the CPU issued
# earlier. The H100 recordings say it does not help that much: GPT-2's offload costs what its
# copies cost one after the other (+55 ms for 2 x 1 GB). The model therefore starts a prefetch no
# earlier than the compute stream's position when it is issued; it overlaps the update of the
# previous parameter and its copy out (at ``duplex`` slowdown), not the backward.


# NOTE [ Host optimizer ]
# Offloaded activations go out on a stream of their own too (OUT_STREAM in forward), the compute
# stream waiting for the oldest copy when more than STASH are in flight, and for all of them before
# backward. With offloaded optimizer states (memfit.techniques.offload_optimizer) gradients go out on a stream
# of their own as backward makes them (OUT_STREAM: after what the compute stream has queued, not
# delaying it), a worker thread runs each parameter's update on the host once its gradient is out
# (WORKER host ops: host bytes at HOST_BW, on the worker's clock, not the step's CPU) and copies the
# parameter back on another stream (WORKER H2D). The step waits for the worker and that stream before
# its next optimizer-phase op, and ends when every clock has.


# NOTE [ Beside the next step ]
# The EMA on the host (memfit.techniques.ema) enqueues its copies of the weights on a side stream at
# the end of the step and averages them in a worker thread while the next step runs; the next
# update waits for the previous one. In the steady state a step therefore lasts at least that chain
# (the copies, then the averaging), and otherwise costs only issuing the copies.


def _on_worker(op: Op, rates: Rates, w: float, w_in: float, ready: float) -> tuple[float, float, float]:
    """A worker-thread op of the host optimizer: (worker clock, stream-in clock, its seconds)."""
    k = rates.k
    if op.kind == HOST:
        dt = op.host_bytes / k.host_bw
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
    compiled = not target.plan.config("compile").is_default
    st = simulate(ops, target.device, k, fused=k.compile_fusion if compiled else 1.0)
    if compiled:
        _, slowdown, notes = eager_plan(target.plan)
        st.factor = slowdown
        st.notes = notes
        for name in ("seconds", *st.parts()):
            setattr(st, name, getattr(st, name) * slowdown)
    return st


def record_ops(target: Target) -> list[Op]:
    """The ops of ``target``'s steady-state step, from one fake trace (its eager step for a
    compiled plan, see :func:`eager_plan`)."""
    from memfit.memory.faketrace import run_tracked
    from memfit.quiet import silenced_warnings

    traced = target.with_plan(eager_plan(target.plan)[0])
    recorder = OpRecorder()
    with silenced_warnings():
        run_tracked(traced, fake=True, around_step=steady_step_recorder(recorder))
    return recorder.ops


def trace_step(target: Target, k: Constants = H100, on_tracker=None) -> tuple[MemoryReport, StepTime, list[Op]]:
    """One fake trace of ``target``'s step giving both what the planner needs: its memory report (as
    ``estimate`` gives it) and its step time (and the ops behind it). A compiled plan takes two: its
    compiled step for memory, its eager step for the ops (:func:`eager_plan`).

    ``on_tracker(tracker)``: told of the memory tracker of an eager plan's trace (compiled: not)."""
    from memfit.memory.estimate import estimate_target
    from memfit.memory.faketrace import run_tracked
    from memfit.memory.report import report_for
    from memfit.quiet import silenced_warnings

    t0 = time.perf_counter()
    if not target.plan.config("compile").is_default:
        report = estimate_target(target, fallback=False)
        ops = record_ops(target)
    else:
        recorder = OpRecorder()
        with silenced_warnings():
            run = run_tracked(target, fake=True, around_step=steady_step_recorder(recorder))
        notes = [note for config in target.plan.techniques for note in config.notes()]
        report = report_for(run.tracker, target, "fake", notes=notes, trace_seconds=time.perf_counter() - t0)
        ops = recorder.ops
        if on_tracker is not None:
            on_tracker(run.tracker)
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
