"""The calibrated step-time model: the planner's on the device at hand (the CPU here).

A few short real steps of the same TrainStep keep the model honest. The base plan is timed at every
micro-batch size of the space, and each technique value alone at the whole batch; a plan's time is
the base time at its micro-batch size times the factor of each technique it uses (factors are
assumed to combine multiplicatively). A factor is keyed by (technique, plan value): only non-default
values have one.

Compile time is one-time, not part of the step (:meth:`TimeModel.warmup`): measured as the extra
time of the first step of each value that ``warms_up`` (compile modes, activation budgets: the
partitioner's search). The planner counts it per step only when told how long the run is
(:meth:`TimeModel.per_step`): step + compile / steps.

The estimate itself is memfit.planner.time_model's ``factor_estimate``, shared with the GPU model.
GPU presets have no device to time: their plans are timed by the ops their own steps run
(memfit.planner.gpu_time).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from memfit.devices import available_host_bytes
from memfit.errors import TraceError, UserError
from memfit.memory.estimate import estimate_target
from memfit.planner.candidate import Evidence, Fidelity
from memfit.planner.progress import NoProgress
from memfit.planner.space import SearchSpace
from memfit.planner.time_model import StepTimeModel, factor_estimate
from memfit.plans import Plan, technique_of, with_what_it_needs
from memfit.quiet import silenced_warnings
from memfit.step import build_step, make_batch
from memfit.target import Target
from memfit.techniques.base import Config
from memfit.units import fmt_bytes


@dataclass
class TimeModel(StepTimeModel):
    kind: str
    """'calibrated' (measured here), or a name a test gives a fixed model."""
    batch_size: int
    base_seconds: dict[int, float] = field(default_factory=dict)
    factors: dict[tuple[str, object], float] = field(default_factory=dict)
    """(technique, plan value) -> measured factor (calibrated)."""
    warmups: dict[tuple[str, object], float] = field(default_factory=dict)
    """(technique, plan value) -> measured one-time seconds before the first step (calibrated)."""
    seconds_spent: float = 0.0
    excluded: list[str] = field(default_factory=list)
    """Technique values left out of the space because they failed for this workload."""
    reduced_batch: int | None = None
    """Slow steps: the batch size the technique factors were measured at."""
    extrapolated_from: int | None = None
    """The batch the plain step was timed at, where the whole batch does not fit this machine
    (NOTE [ Real steps that fit this machine ] in :func:`calibrate`)."""

    def predict(self, plan: Plan) -> float:
        keys = (_key(c) for c in plan.techniques if not c.is_default)
        return factor_estimate(self.base_seconds[plan.micro_batches(self.batch_size)[0]], keys, self.factors)

    def is_estimate(self, plan: Plan) -> bool:
        return False  # (final: each factor was measured here)

    def warmup(self, plan: Plan) -> float:
        """One-time seconds before ``plan``'s first step (compiling); the values' own, added."""
        return sum(self.warmups.get(_key(c), 0.0) for c in plan.techniques if not c.is_default)

    def describe(self) -> str:
        at = f" at batch {self.reduced_batch}" if self.reduced_batch else ""
        if self.extrapolated_from:
            at += f" (the plain step timed at batch {self.extrapolated_from}, scaled to {self.batch_size})"
        return (f"{self.kind} on this machine with short real steps ({self.seconds_spent:.1f} s); "
                f"technique factors{at} combined multiplicatively")


def _key(config: Config) -> tuple[str, object]:
    """(technique, plan value); a technique with several keys (micro-batches) has no factor: the
    base time is measured per micro-batch size."""
    values = config.values()
    return config.technique.name, next(iter(values.values())) if len(values) == 1 else tuple(values.values())


MIN_TIMED_SECONDS = 0.3
SLOW_STEP_SECONDS = 2.0


def time_plan(target: Target, steps: int) -> float:
    """Median step time after a warm-up step; short steps are repeated for at least 0.3 s."""
    return _time_steps(target, steps)[0]


class MeasuredRun:
    """The evaluator of real runs here (memfit.planner.ladder's protocol): a plan's median step
    time, and its warm-up (the first step's extra time over the median: compiling)."""

    fidelity = Fidelity.MEASURED

    def __init__(self, target: Target, steps: int) -> None:
        self.target, self.steps = target, steps

    def evaluate(self, plan: Plan) -> Evidence:
        median, warmup = _time_steps(self.target.with_plan(plan), self.steps)
        return Evidence(Fidelity.MEASURED, seconds=median, compile_seconds=warmup)


def _time_steps(target: Target, steps: int) -> tuple[float, float]:
    """(median step time, warm-up: the first step's extra time over it). A timed step over
    ``SLOW_STEP_SECONDS`` is the only one: GPT-2 at 1024 tokens takes 12 s a step here, and the CPU
    planner times a dozen values (the warm-up step, which may compile, does not decide)."""
    step = build_step(target)
    batch = make_batch(target)
    t0 = time.perf_counter()
    step(batch)  # warm-up: optimizer states, allocator, oneDNN primitives, compiling
    first = time.perf_counter() - t0
    times: list[float] = []
    while len(times) < steps or (sum(times) < MIN_TIMED_SECONDS and len(times) < 50):
        if times and times[0] > SLOW_STEP_SECONDS:
            break
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return median, max(first - median, 0.0)


MICRO_BATCH_OVERHEAD = 0.03
"""For slow steps: each extra micro-batch costs this fraction of the step (launches, small matmuls)."""


# NOTE [ Real steps that fit this machine ]
# The plain step is timed here only at a batch whose predicted peak (a fake trace) fits ``HOST_SHARE``
# of this machine's free memory: GPT-2 at batch 8 x 1024 needs 28 GiB in fp32, and the OS killed the
# planner. Where the whole batch does not fit, the plain step is timed at the largest micro-batch size
# of the space that does, its time scaled to the whole batch (a CPU step's time grows with the tokens
# it computes), and the factors are measured as for slow steps, at the smallest micro-batch size.
def calibrate(target: Target, space: SearchSpace, steps: int = 2, progress=None) -> TimeModel:
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
    progress = progress or NoProgress()
    batch_size = target.batch_size
    model = TimeModel("calibrated", batch_size)
    here = MeasuredRun(target, steps)
    fitting = _largest_fitting_batch(target, space)
    progress.stage(f"timing the plain step at batch {fitting}")
    if fitting == batch_size:
        base_run = here.evaluate(Plan())
        base = base_run.seconds
    else:
        base_run = MeasuredRun(Target(target.workload, Plan(), fitting, target.device), steps).evaluate(Plan())
        base = base_run.seconds * batch_size / fitting
        model.extrapolated_from = fitting
    model.base_seconds[batch_size] = base
    slow = base > SLOW_STEP_SECONDS or fitting < batch_size
    cal_batch = min(space.micro_batches) if slow else batch_size
    todo = sum(value != getattr(Plan(), name) for name, values in space.values.items() for value in values)
    _say_how_long(progress, todo, base_run.seconds * cal_batch / fitting, cal_batch)  # (as soon as it is known)
    for micro in space.micro_batches:
        if micro == batch_size:
            continue
        if slow:
            model.base_seconds[micro] = base * (1 + MICRO_BATCH_OVERHEAD * (batch_size // micro - 1))
        else:  # more, smaller micro-batches do not make a step faster
            model.base_seconds[micro] = max(base, here.evaluate(Plan(micro_batch_size=micro)).seconds)
    at_cal = Target(target.workload, Plan(), cal_batch, target.device)
    at_cal_run = MeasuredRun(at_cal, steps)
    timed = {Plan(): base_run if not slow or cal_batch == fitting < batch_size else at_cal_run.evaluate(Plan())}
    model.reduced_batch = cal_batch if slow else None

    def timing(p: Plan) -> tuple[float, float]:
        if p not in timed:
            timed[p] = at_cal_run.evaluate(p)
        return timed[p].seconds, timed[p].compile_seconds
    done = 0
    for name, values in space.values.items():
        for value in list(values):
            try:
                plan, reference = _alone(name, value, space)
                config = plan.config(technique_of(name).name)
                if config.is_default:
                    continue
                done += 1
                progress.stage(f"timing {name}={value} ({done} of {todo}, at batch {cal_batch})")
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


SAY_HOW_LONG_SECONDS = 60.0
"""Timing the values for longer than this gets a line saying so, and how to plan for a GPU instead."""


def _say_how_long(progress, values: int, step_seconds: float, batch: int) -> None:
    """Tell the user, up front, when timing ``values`` values alone by real steps of about
    ``step_seconds`` (the plain step's, scaled to ``batch``) will take minutes (a warm-up step and
    one or two timed ones each)."""
    seconds = values * step_seconds * (2 if step_seconds > SLOW_STEP_SECONDS else 3)
    if seconds > SAY_HOW_LONG_SECONDS:
        progress.note(f"memfit plan: timing {values} technique values by real steps on this machine's CPU takes "
                      f"about {seconds / 60:.0f} min ({step_seconds:.1f} s a step at batch {batch}); to plan for a "
                      "GPU instead, give --device (see memfit devices)")


CPU_STATE_BYTES = 16
"""Bytes per parameter of the plain fp32 AdamW step the CPU planner times for real first (weights,
gradients and two moments), before any activation."""


def check_real_steps_fit(workload, facts) -> None:
    """The CPU planner times real steps, the plain plan's first: refuse, in one line, a model whose
    plain step cannot fit this machine's memory (the OS would kill the process)."""
    need, free = facts.n_params * CPU_STATE_BYTES, available_host_bytes()
    if need > 0.8 * free:
        raise UserError(f"memfit plan on the cpu device times real steps of each technique, the plain fp32 AdamW "
                        f"step first: {workload.name} needs {fmt_bytes(need)} for its weights, gradients and AdamW "
                        f"states alone ({facts.n_params / 1e9:.2f}B parameters), and this machine has "
                        f"{fmt_bytes(free)} free; plan for a GPU preset (e.g. --device h100-80gb; see memfit "
                        "devices), which traces on fake tensors without that memory")


HOST_SHARE = 0.6
"""A step timed here may need this share of the memory the machine has free: the rest is this
process's own (torch, the traces), and what a technique timed alone adds to the plain step."""


def _largest_fitting_batch(target: Target, space: SearchSpace) -> int:
    """The whole batch where the plain step's predicted peak fits ``HOST_SHARE`` of this machine's
    free memory, else the largest micro-batch size of the space that does (NOTE [ Real steps that
    fit this machine ]); a UserError where none does."""
    free = available_host_bytes()
    sizes = sorted({target.batch_size, *space.micro_batches}, reverse=True)
    need = 0
    for size in sizes:
        try:
            with silenced_warnings():  # (no real step in its place: that is what this check keeps from running)
                need = estimate_target(Target(target.workload, Plan(), size, target.device), fallback=False).peak_bytes
        except TraceError:  # a model fake tensors cannot trace: unknown, timed as before
            return target.batch_size
        if need <= HOST_SHARE * free:
            return size
    raise UserError(f"memfit plan on the cpu device times real steps of each technique: {target.workload.name}'s "
                    f"plain step needs {fmt_bytes(need)} at batch {sizes[-1]} (predicted), more than "
                    f"{HOST_SHARE:.0%} of the {fmt_bytes(free)} this machine has free; plan for a GPU preset (e.g. "
                    "--device h100-80gb; see memfit devices), which traces on fake tensors without that memory")


def _alone(name: str, value, space: SearchSpace) -> tuple[Plan, Plan]:
    """The plan that times ``value`` and the plan it is compared with: ``value`` alone against the
    default plan, or, when it cannot run alone, with the first other value of the space that lets
    it run (e.g. ``budget:0.5`` with ``compile: blocks``) against that value alone."""
    found = with_what_it_needs(name, value, ((k, v) for k, vs in space.values.items() for v in vs))
    if found is None:
        Plan(**{name: value})  # (raises why it cannot run alone)
    plan, other = found
    return plan, Plan(**other)
