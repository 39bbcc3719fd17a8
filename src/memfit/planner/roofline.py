"""Each op's seconds on a GPU preset: a roofline on the GPU, a dispatch cost on the CPU.

memfit.planner.timing runs a step's recorded ops (memfit.planner.opcost) through the CPU and GPU
clocks; what one op costs on each is priced here, from the preset's peaks and :class:`Constants`.

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
``CPU_PER_TENSOR`` per tensor of a foreach list.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from memfit.devices import Device
from memfit.hosts import REFERENCE_HOST_FUSED_BW
from memfit.planner.ops import (
    ATTENTION,
    COMPILED,
    CUSTOM,
    D2H,
    FOREACH,
    H2D,
    MATMUL,
    MEMORY,
    PY_MODE,
    RECOMPUTE,
    RNN,
    SCALAR,
    STEP_CALL,
    SYNC_AFTER,
    VIEW,
    Op,
)

FP32_SIMT = {"h100-80gb": 67e12, "h200-141gb": 67e12, "a100-80gb": 19.5e12, "a100-40gb": 19.5e12, "l4": 30.3e12,
             "l40s": 91.6e12, "rtxa6000": 38.7e12}
"""fp32 FLOP/s without tensor cores where it differs from the preset's float32 (TF32) figure."""


# NOTE [ Step-time calibration ]
# The constants (:class:`Constants`) are fitted by ``python -m tools.fit.time_constants --fit`` on
# the H100 rows of ``tests/data/h100.jsonl``: by Nelder-Mead over the constants' logarithms, the
# squared log error of each fit row's time ratio to plain bf16 of the same workload and batch, plus
# half the mean squared log error of every clean row's absolute time, plus a pull towards
# hardware-plausible values (``PRIOR`` there); each technique is fitted on one workload and held out
# on the other. The ratios are what the planner ranks by. The fit's rows and residuals:
# docs/planner-notes.md.
@dataclass(frozen=True)
class Constants:
    """The time model's constants: fitted on the H100 (NOTE [ Step-time calibration ]) unless marked
    fixed; the fit's starting point and pull (its prior) is ``tools/fit/time_constants.py``'s ``PRIOR``."""

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
    host_fused_bw: float = REFERENCE_HOST_FUSED_BW
    """Host-memory bytes/s of torch's fused CPU AdamW/Adam, the host optimizer's update (fixed:
    solved so that the one measured row, 4 Llama layers at 7B width with ``offload:
    [optimizer_states]`` on an H100 machine with 16 host cores, takes its measured 327.0 ms;
    bench/results/offload_gpu_h100.jsonl. ``host_bw`` gave 1616.6 ms there)."""
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
    cpu_compiled_call: float = 3.0e-4
    """CPU seconds of one call of a compiled region beyond its kernels' launches: dynamo's guards,
    Inductor's wrapper, and (torchao's update, a call per parameter) the Python around it. Fixed on
    the H100 so that GPT-2's step with torchao's 8-bit AdamW is the measured 1.69x that with torch's
    AdamW (bf16-pure, batch 8 x 1024; 1.71x predicted; held out: with blocks:every=2, 1.78x measured,
    1.69x predicted): NOTE [ Compiled kernels in the step time ] in memfit.planner.opcost."""
    rnn_step: float = 2.6e-5
    """GPU seconds per sequential step (time step x layer x direction) of a cuDNN RNN call."""
    compile_fusion: float = 0.2889
    """``compile: full``: the memory-bound GPU time and the CPU time of forward and backward are
    scaled by this (solved so that GPT-2's compiled/eager ratio is the recorded 0.465; memfit's own
    step measured 0.439 on the H100 in 2026-11-27's rows, 0.465 predicted)."""
    compile_fusion_blocks: float = 0.7188
    """``compile: blocks``, as ``compile_fusion``: each block is a graph of its own, with the eager
    code between blocks, its launches and the blocks' boundaries (solved so that memfit's GPT-2 bf16
    step compiled by blocks is the measured 0.788 of its eager step: h100.jsonl c-gpt2-bf16-blocks
    against c-gpt2-bf16-eager; the full factor had predicted 0.465 for it)."""


H100 = Constants()

DISPATCH_FIELDS = ("cpu_forward", "cpu_backward", "cpu_optimizer", "cpu_per_tensor", "cpu_py_mode", "cpu_custom",
                   "cpu_scalar", "cpu_step_call", "cpu_compiled_call")
"""The constants that are the host's dispatch costs (memfit.hosts)."""


def for_host(host, base: Constants = H100) -> Constants:
    """``base`` with its host constants scaled to ``host`` (a memfit.hosts.Host): dispatch costs by
    ``host.dispatch``, host memory bandwidths by ``host.memory``."""
    if host.dispatch == 1.0 and host.memory == 1.0:
        return base
    return dataclasses.replace(base, **{n: getattr(base, n) * host.dispatch for n in DISPATCH_FIELDS},
                               host_bw=base.host_bw * host.memory, host_fused_bw=base.host_fused_bw * host.memory)


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
    migration: float = 0.0
    """Managed pages over the host link (a paged optimizer's states the budget has no room for:
    memfit.memory.managed), added to the step: the update waits for its states' pages."""
    host: float = 0.0
    worker: float = 0.0
    """The host update's worker thread, busy (NOTE [ Host optimizer ] in memfit.planner.timing): the step
    lasts at least this long."""
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
        name = device.name if device.name in FP32_SIMT or not device.is_local_gpu else \
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
            if op.flags & CUSTOM and op.flags & SYNC_AFTER:  # bitsandbytes' blockwise optimizer update
                return max(op.nbytes / self.bw, op.elements / k.custom_elements) + k.kernel
            if op.flags & CUSTOM:  # a library's memory-bound kernel (QLoRA's dequantize_4bit)
                return op.nbytes / self.bw + k.kernel
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
        if op.flags & COMPILED and op.kind == VIEW:
            return k.cpu_compiled_call
        if op.kind == SCALAR:
            return k.cpu_scalar
        extra = (k.cpu_py_mode if op.flags & PY_MODE else 0.0) + (k.cpu_custom if op.flags & CUSTOM else 0.0)
        return per_op + extra + (k.cpu_per_tensor * op.tensors if op.kind == FOREACH else 0.0)
