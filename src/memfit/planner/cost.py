"""Step-time models for the planner.

``calibrated`` (the device at hand, CPU here): a few short real steps of the same TrainStep keep
the model honest. The base plan is timed at every micro-batch size of the space, and each
technique value alone at the whole batch; a plan's time is the base time at its micro-batch size
times the factor of each technique it uses (factors are assumed to combine multiplicatively).

``roofline`` (GPU presets, no GPU needed): FLOPs counted with ``torch.utils.flop_counter`` on a
fake trace; compute time = FLOPs / (peak FLOP/s of the dtype x an assumed 40% utilisation);
recompute adds the forward FLOPs of what is recomputed; the optimizer is memory-bound (bytes
moved / bandwidth); offload adds bytes over the host link / link bandwidth (no overlap assumed);
each micro-batch adds a kernel-launch overhead per op.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.devices import Device
from memfit.errors import UserError
from memfit.planner.space import SearchSpace
from memfit.plans import Plan
from memfit.workload import Workload

DEFAULTS = {"precision": "fp32", "checkpointing": "none", "optimizer": "adamw", "optimizer_in_backward": False,
            "offload": (), "loss_chunks": 0, "attention": "auto"}
MFU = 0.4
LAUNCH_SECONDS = 5e-6


@dataclass
class TimeModel:
    kind: str
    """'calibrated' (measured here) or 'roofline' (FLOP counts and the preset's peak numbers)."""
    batch_size: int
    base_seconds: dict[int, float] = field(default_factory=dict)
    factors: dict[tuple[str, object], float] = field(default_factory=dict)
    seconds_spent: float = 0.0
    excluded: list[str] = field(default_factory=list)
    """Technique values left out of the space because they failed for this workload."""
    reduced_batch: int | None = None
    """Slow steps: the batch size the technique factors were measured at."""

    def predict(self, plan: Plan) -> float:
        micro = plan.micro_batch_size or self.batch_size
        t = self.base_seconds[micro]
        for name, default in DEFAULTS.items():
            value = getattr(plan, name)
            if value != default:
                t *= self.factors.get((name, value), 1.0)
        return t

    def describe(self) -> str:
        if self.kind == "calibrated":
            at = f" at batch {self.reduced_batch}" if self.reduced_batch else ""
            return (f"calibrated on this machine with short real steps ({self.seconds_spent:.1f} s); "
                    f"technique factors{at} combined multiplicatively")
        return f"roofline from FLOP counts and the preset's peak numbers ({MFU:.0%} utilisation assumed)"


# Techniques that only add work (recompute, copies, per-parameter steps): a measured factor below
# 1 is timing noise, so it is clamped. Precision and optimizer variants can genuinely be faster.
ADD_WORK = {"checkpointing", "optimizer_in_backward", "offload", "loss_chunks", "attention"}
MIN_TIMED_SECONDS = 0.3


def _time_plan(workload: Workload, plan: Plan, batch_size: int, device: Device, steps: int) -> float:
    """Median step time after a warm-up step; short steps are repeated for at least 0.3 s."""
    from memfit.step import build_step, make_batch
    step = build_step(workload, plan, batch_size, device)
    batch = make_batch(workload, batch_size, device)
    step(batch)  # warm-up: optimizer states, allocator, oneDNN primitives
    times: list[float] = []
    while len(times) < steps or (sum(times) < MIN_TIMED_SECONDS and len(times) < 50):
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


SLOW_STEP_SECONDS = 2.0
MICRO_BATCH_OVERHEAD = 0.03
"""For slow steps: each extra micro-batch costs this fraction of the step (launches, small matmuls)."""


def calibrate(workload: Workload, space: SearchSpace, batch_size: int, device: Device, steps: int = 2) -> TimeModel:
    """Measure the base plan and each technique value alone. When a step is slow (> 2 s), the
    technique factors are measured at the smallest micro-batch size instead (factors are ratios,
    roughly independent of the batch) and micro-batching is modelled as a small overhead."""
    t0 = time.perf_counter()
    model = TimeModel("calibrated", batch_size)
    base = _time_plan(workload, Plan(), batch_size, device, steps)
    model.base_seconds[batch_size] = base
    slow = base > SLOW_STEP_SECONDS
    for micro in space.micro_batches:
        if micro == batch_size:
            continue
        if slow:
            model.base_seconds[micro] = base * (1 + MICRO_BATCH_OVERHEAD * (batch_size // micro - 1))
        else:  # more, smaller micro-batches do not make a step faster
            model.base_seconds[micro] = max(base, _time_plan(workload, Plan(micro_batch_size=micro), batch_size,
                                                             device, steps))
    cal_batch = min(space.micro_batches) if slow else batch_size
    cal_base = _time_plan(workload, Plan(), cal_batch, device, steps) if slow else base
    model.reduced_batch = cal_batch if slow else None
    for name, values in space.values.items():
        for value in list(values):
            if value == DEFAULTS[name]:
                continue
            try:
                factor = _time_plan(workload, Plan(**{name: value}), cal_batch, device, steps) / cal_base
            except UserError as e:  # the technique does not suit this workload: leave it out
                values.remove(value)
                model.excluded.append(f"{name}={value}: {e}")
                continue
            model.factors[(name, value)] = max(factor, 1.0) if name in ADD_WORK else factor
    model.seconds_spent = time.perf_counter() - t0
    return model


def roofline(workload: Workload, space: SearchSpace, batch_size: int, device: Device, facts) -> TimeModel:
    """Time model from one fake trace with FLOP counting."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from memfit.step import build_step, make_batch
    t0 = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=True):
        step = build_step(workload, Plan(), batch_size, device)
        batch = make_batch(workload, batch_size, device)
        counter, ops = FlopCounterMode(display=False), _OpCount()
        with counter, ops:
            step.run(batch)
        n_ops = ops.n
    total = counter.get_total_flops()
    by_module = counter.get_flop_counts()
    fwd_total = total / 3  # backward ~ 2x forward for matmul-dominated models
    blocks = _blocks_flops(step.model, by_module) / 3
    head = _head_flops(step.model, by_module) / 3
    attention = sum(v for k, v in by_module.get("Global", {}).items()
                    if "scaled_dot_product" in str(k)) / 3
    peak = device.peak_flops
    fp32 = peak.get("float32", 1e12) * MFU
    half = peak.get("bfloat16" if device.bf16 else "float16", peak.get("float32", 1e12)) * MFU
    n = facts.n_params
    opt_bytes = {"adamw": 28 * n, "adamw8bit": 14 * n, "adafactor": 16 * n, "sgd": 16 * n}
    bw = device.mem_bandwidth or 1e12
    compute = total / fp32
    opt = opt_bytes["adamw"] / bw
    model = TimeModel("roofline", batch_size)
    for micro in {*space.micro_batches, batch_size}:  # the whole batch is the base of every factor
        model.base_seconds[micro] = compute + opt + (batch_size // micro) * n_ops * LAUNCH_SECONDS
    base = model.base_seconds[batch_size]
    f = model.factors
    f[("precision", "bf16")] = f[("precision", "fp16")] = f[("precision", "bf16-pure")] = \
        (total / half + opt) / base
    f[("checkpointing", "blocks")] = (base + blocks / fp32) / base
    for value in space.values.get("checkpointing", ()):
        if value.startswith("blocks:every="):  # every N-th block recomputed
            f[("checkpointing", value)] = (base + blocks / int(value[13:]) / fp32) / base
    f[("checkpointing", "blocks:every=2")] = (base + blocks / 2 / fp32) / base
    f[("checkpointing", "selective")] = (base + 0.15 * blocks / fp32) / base
    for value in {8, *space.values.get("loss_chunks", ())} - {0}:  # any K recomputes the head once
        f[("loss_chunks", value)] = (base + head / fp32) / base
    f[("attention", "chunked")] = (base + attention / fp32) / base
    for name, b in opt_bytes.items():
        f[("optimizer", name)] = (base - opt + b / bw) / base
    link = device.host_link_bandwidth or 25e9
    f[("offload", ("optimizer_states",))] = (base + 2 * 8 * n / link) / base
    f[("offload", ("activations",))] = (base + 2 * _activation_bytes(fwd_total) / link) / base
    model.seconds_spent = time.perf_counter() - t0
    return model


class _OpCount(TorchDispatchMode):
    """Counts ATen ops (kernel launches, for the per-micro-batch launch overhead)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _blocks_flops(model: torch.nn.Module, by_module: dict) -> float:
    from memfit.techniques.checkpointing import find_blocks
    names = {f"{type(model).__name__}.{n}" for n, _ in find_blocks(model)}
    return sum(sum(v.values()) for k, v in by_module.items() if k in names)


def _head_flops(model: torch.nn.Module, by_module: dict) -> float:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return 0.0
    name = next((n for n, m in model.named_modules() if m is head), None)
    key = f"{type(model).__name__}.{name}"
    return sum(by_module.get(key, {}).values())


def _activation_bytes(fwd_flops: float) -> float:
    # ~1 byte saved per 50 forward FLOPs for transformer blocks (a rough ratio; stated in the docs)
    return fwd_flops / 50
