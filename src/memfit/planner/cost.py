"""Step-time models for the planner.

``calibrated`` (the device at hand, CPU here): a few short real steps of the same TrainStep keep
the model honest. The base plan is timed at every micro-batch size of the space, and each
technique value alone at the whole batch; a plan's time is the base time at its micro-batch size
times the factor of each technique it uses (factors are assumed to combine multiplicatively).

``roofline`` (GPU presets, no GPU needed): FLOPs counted with ``torch.utils.flop_counter`` on a
fake trace (:class:`~memfit.techniques.base.Roofline`); compute time = FLOPs / (peak FLOP/s of the
dtype x an assumed 40% utilisation); each micro-batch adds a kernel-launch overhead per op; each
technique's config gives its own factor (``Config.time_factor``): recompute adds the forward FLOPs
of what is recomputed, the optimizer is memory-bound (bytes moved / bandwidth), offload adds bytes
over the host link / link bandwidth (no overlap assumed).

Both key a technique's factor by (technique, plan value): only non-default values have one.

Compile time is one-time, not part of the step (:meth:`TimeModel.warmup`): measured by
``calibrated`` as the extra time of the first step of each value that ``warms_up`` (compile modes,
activation budgets: the partitioner's search), predicted by ``roofline`` from each config's
``warmup_seconds``. The planner counts it per step only when told how long the run is
(:meth:`TimeModel.per_step`): step + compile / steps.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from memfit.errors import UserError
from memfit.planner.space import ModelFacts, SearchSpace
from memfit.plans import Plan, technique_of
from memfit.step import build_step, make_batch
from memfit.target import Target
from memfit.techniques.base import Config, Roofline
from memfit.techniques.checkpointing import find_blocks

MFU = 0.4
LAUNCH_SECONDS = 5e-6
OPTIMIZER_BYTES_PER_PARAM = 28
"""The default optimizer's (AdamW's) update: fp32 weight, gradient and two states read and written."""


@dataclass
class TimeModel:
    kind: str
    """'calibrated' (measured here) or 'roofline' (FLOP counts and the preset's peak numbers)."""
    batch_size: int
    base_seconds: dict[int, float] = field(default_factory=dict)
    factors: dict[tuple[str, object], float] = field(default_factory=dict)
    """(technique, plan value) -> measured factor (calibrated)."""
    warmups: dict[tuple[str, object], float] = field(default_factory=dict)
    """(technique, plan value) -> measured one-time seconds before the first step (calibrated)."""
    roofline: Roofline | None = None
    """The roofline's inputs: each technique's factor comes from its config (roofline)."""
    seconds_spent: float = 0.0
    excluded: list[str] = field(default_factory=list)
    """Technique values left out of the space because they failed for this workload."""
    reduced_batch: int | None = None
    """Slow steps: the batch size the technique factors were measured at."""

    def predict(self, plan: Plan) -> float:
        t = self.base_seconds[plan.micro_batches(self.batch_size)[0]]
        for config in plan.techniques:
            if not config.is_default:
                t *= self.factor(config)
        return t

    def warmup(self, plan: Plan) -> float:
        """One-time seconds before ``plan``'s first step (compiling); the values' own, added."""
        configs = [c for c in plan.techniques if not c.is_default]
        if self.roofline is not None:
            return sum(c.warmup_seconds(self.roofline, plan) for c in configs)
        return sum(self.warmups.get(_key(c), 0.0) for c in configs)

    def per_step(self, plan: Plan, steps: int | None) -> float:
        """Seconds per step over a run of ``steps`` steps (compile time spread over them); None: a
        run long enough for compile time not to count."""
        return self.predict(plan) + (self.warmup(plan) / steps if steps else 0.0)

    def factor(self, config: Config) -> float:
        if self.roofline is not None:
            return config.time_factor(self.roofline)
        return self.factors.get(_key(config), 1.0)

    def describe(self) -> str:
        if self.kind == "calibrated":
            at = f" at batch {self.reduced_batch}" if self.reduced_batch else ""
            return (f"calibrated on this machine with short real steps ({self.seconds_spent:.1f} s); "
                    f"technique factors{at} combined multiplicatively")
        return f"roofline from FLOP counts and the preset's peak numbers ({MFU:.0%} utilisation assumed)"


def _key(config: Config) -> tuple[str, object]:
    """(technique, plan value); a technique with several keys (micro-batches) has no factor: the
    base time is measured per micro-batch size."""
    values = config.values()
    return config.technique.name, next(iter(values.values())) if len(values) == 1 else tuple(values.values())


MIN_TIMED_SECONDS = 0.3


def time_plan(target: Target, steps: int) -> float:
    """Median step time after a warm-up step; short steps are repeated for at least 0.3 s."""
    return _time_steps(target, steps)[0]


def _time_steps(target: Target, steps: int) -> tuple[float, float]:
    """(median step time, warm-up: the first step's extra time over it)."""
    step = build_step(target)
    batch = make_batch(target)
    t0 = time.perf_counter()
    step(batch)  # warm-up: optimizer states, allocator, oneDNN primitives, compiling
    first = time.perf_counter() - t0
    times: list[float] = []
    while len(times) < steps or (sum(times) < MIN_TIMED_SECONDS and len(times) < 50):
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return median, max(first - median, 0.0)


SLOW_STEP_SECONDS = 2.0
MICRO_BATCH_OVERHEAD = 0.03
"""For slow steps: each extra micro-batch costs this fraction of the step (launches, small matmuls)."""


def calibrate(target: Target, space: SearchSpace, steps: int = 2) -> TimeModel:
    """Measure the base plan and each technique value alone (``target``'s workload, batch and
    device). When a step is slow (> 2 s), the technique factors are measured at the smallest
    micro-batch size instead (factors are ratios, roughly independent of the batch) and
    micro-batching is modelled as a small overhead. A technique that only adds work
    (``Config.adds_work``) cannot come out faster than the base: such a factor below 1 is timing
    noise, and is clamped. A value that cannot run alone (``budget:F`` needs compile) is timed
    with the first other value of the space that lets it run, against that value alone
    (:func:`_alone`). A value that ``warms_up`` (compiles) has its warm-up measured: the first
    step's extra time beyond its reference's (in this process: a region compiled before is served
    from torch.compile's caches)."""
    t0 = time.perf_counter()
    batch_size = target.batch_size
    model = TimeModel("calibrated", batch_size)
    base, base_warmup = _time_steps(target.with_plan(Plan()), steps)
    model.base_seconds[batch_size] = base
    slow = base > SLOW_STEP_SECONDS
    for micro in space.micro_batches:
        if micro == batch_size:
            continue
        if slow:
            model.base_seconds[micro] = base * (1 + MICRO_BATCH_OVERHEAD * (batch_size // micro - 1))
        else:  # more, smaller micro-batches do not make a step faster
            model.base_seconds[micro] = max(base, time_plan(target.with_plan(Plan(micro_batch_size=micro)), steps))
    cal_batch = min(space.micro_batches) if slow else batch_size
    at_cal = Target(target.workload, Plan(), cal_batch, target.device)
    timed = {Plan(): _time_steps(at_cal, steps) if slow else (base, base_warmup)}
    model.reduced_batch = cal_batch if slow else None

    def timing(p: Plan) -> tuple[float, float]:
        if p not in timed:
            timed[p] = _time_steps(at_cal.with_plan(p), steps)
        return timed[p]
    for name, values in space.values.items():
        for value in list(values):
            try:
                plan, reference = _alone(name, value, space)
                config = plan.config(technique_of(name).name)
                if config.is_default:
                    continue
                (seconds, warmup), (ref_seconds, ref_warmup) = timing(plan), timing(reference)
            except UserError as e:  # the technique does not suit this workload: leave it out
                values.remove(value)
                model.excluded.append(f"{name}={value}: {e}")
                continue
            factor = seconds / ref_seconds
            model.factors[(name, value)] = max(factor, 1.0) if config.adds_work else factor
            if config.warms_up:
                model.warmups[(name, value)] = max(warmup - ref_warmup, 0.0)
    model.seconds_spent = time.perf_counter() - t0
    return model


def _alone(name: str, value, space: SearchSpace) -> tuple[Plan, Plan]:
    """The plan that times ``value`` and the plan it is compared with: ``value`` alone against the
    default plan, or, when it cannot run alone, with the first other value of the space that lets
    it run (e.g. ``budget:0.5`` with ``compile: blocks``) against that value alone."""
    try:
        return Plan(**{name: value}), Plan()
    except UserError as e:
        alone_error = e
    for other, values in space.values.items():
        for v in values if other != name else ():
            try:
                return Plan(**{name: value, other: v}), Plan(**{other: v})
            except UserError:
                continue
    raise alone_error


def roofline(target: Target, space: SearchSpace, facts: ModelFacts) -> TimeModel:
    """Time model from one fake trace of the default plan with FLOP counting."""
    t0 = time.perf_counter()
    device, batch_size = target.device, target.batch_size
    with FakeTensorMode(allow_non_fake_inputs=True):
        default = target.with_plan(Plan())
        step = build_step(default)
        batch = make_batch(default)
        counter, ops = FlopCounterMode(display=False), _OpCount(step)
        with counter, ops:
            step.run(batch)
        ops.remove_hooks()
        n_ops = ops.n
    total = counter.get_total_flops()
    by_module = counter.get_flop_counts()
    peak = device.peak_flops
    fp32 = peak.get("float32", 1e12) * MFU
    half = peak.get("bfloat16" if device.bf16 else "float16", peak.get("float32", 1e12)) * MFU
    bw = device.mem_bandwidth or 1e12
    compute = total / fp32
    opt = OPTIMIZER_BYTES_PER_PARAM * facts.n_params / bw
    model = TimeModel("roofline", batch_size)
    for micro in {*space.micro_batches, batch_size}:  # the whole batch is the base of every factor
        model.base_seconds[micro] = compute + opt + (batch_size // micro) * n_ops * LAUNCH_SECONDS
    model.roofline = Roofline(  # backward ~ 2x forward for matmul-dominated models: forward = total / 3
        base_seconds=model.base_seconds[batch_size], total_flops=total, fwd_flops=total / 3,
        block_fwd_flops=_blocks_flops(step.model, by_module) / 3, head_fwd_flops=_head_flops(step.model, by_module) / 3,
        attention_fwd_flops=sum(v for k, v in by_module.get("Global", {}).items()
                                if "scaled_dot_product" in str(k)) / 3,
        fp32_flops_per_s=fp32, half_flops_per_s=half, n_params=facts.n_params, mem_bandwidth=bw,
        host_link_bandwidth=device.host_link_bandwidth or 25e9, optimizer_seconds=opt,
        forward_ops=ops.forward, block_ops=ops.block)
    model.seconds_spent = time.perf_counter() - t0
    return model


class _OpCount(TorchDispatchMode):
    """Counts ATen ops: all of them (kernel launches, for the per-micro-batch launch overhead), the
    forward's (the graph ``compile: full`` compiles) and one repeated block's forward (``blocks``')."""

    def __init__(self, step):
        super().__init__()
        self.n = self.forward = self.block = 0
        self.step, self.in_block, self.hooks = step, False, []
        blocks = find_blocks(step.model)
        if blocks:
            first = blocks[0][1][0]
            self.hooks = [first.register_forward_pre_hook(lambda *_: setattr(self, "in_block", True)),
                          first.register_forward_hook(lambda *_: setattr(self, "in_block", False))]

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        if self.step.phase == "forward":
            self.forward += 1
            self.block += self.in_block
        return func(*args, **(kwargs or {}))


def _blocks_flops(model: torch.nn.Module, by_module: dict) -> float:
    """FLOPs of the repeated blocks: FlopCounterMode counts each block under its own name (the
    container is never called)."""
    names = set()
    for name, children in find_blocks(model):
        prefix = ".".join(filter(None, (type(model).__name__, name)))
        ids = {id(c) for c in children}
        names |= {f"{prefix}.{n}" for n, c in model.get_submodule(name).named_children() if id(c) in ids}
    return sum(sum(v.values()) for k, v in by_module.items() if k in names)


def _head_flops(model: torch.nn.Module, by_module: dict) -> float:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return 0.0
    name = next((n for n, m in model.named_modules() if m is head), None)
    key = f"{type(model).__name__}.{name}"
    return sum(by_module.get(key, {}).values())
