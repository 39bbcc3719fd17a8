"""The planner's step-time model for GPU presets: each plan timed by the ops its own step runs.

A plan's time is memfit.planner.timing's op-level model run on the ops of a fake trace of the plan's
own TrainStep, so what a technique costs is what it runs (recomputed blocks, smaller micro-batch
kernels, per-chunk loss kernels, 8-bit updates, copies over the host link). Tracing every candidate
at full depth would take minutes (672 plans for GPT-2), so the model works in three tiers:

1. **Estimate** (every candidate, no trace of its own): the default plan and each technique value
   alone are measured (tier 2); a combination is estimated as the default's time times the ratio
   of each of its values alone (memfit.planner.time_model.factor_estimate, the CPU model's too), and its footprint as the default's plus each value's saving alone.
   This orders the search, and spares it the traces of plans estimated well over the budget.
   Once the walk has measured plans, a plan's time is estimated from its nearest measured part
   instead (NOTE [ Estimates from the nearest measured plan ]).
2. **Measure** (the candidates the search visits, fastest estimate first): a shallow trace pair
   (memfit.planner.shallow: 2 and 3 blocks) gives the plan's full-depth ops (extrapolated op by
   op), hence its own step time, and its allocated peak (extrapolated on a line). The time
   replaces the estimate, and the plan goes back into the queue at it. The allocated peak plus the
   CUDA context is a lower bound of what the budget counts (the caching allocator reserves at
   least what is allocated): above the budget, the plan is too big.
3. **Confirm** (a plan measured fastest whose lower bound fits): one full trace, the same as
   ``memfit estimate``: reserved bytes and the time at full depth. Only a confirmed plan is chosen.

So the chosen plan's figures are those of its own full trace, and every plan it beat on time was
measured, not estimated. Independent traces (the values alone, a pair's two depths) run in forked
worker processes, one per CPU core (memfit.planner.workers).

Compile time (one-time, before the first step) comes from the compiled graph's size: the forward's
ops for ``compile: full``, one block's for ``blocks`` (read from the shallow pair), at the rate of
the one H100 recording (memfit.techniques.compile).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.deep_stream import Stream, deepen, from_tracker, replay
from memfit.memory.report import traced_device
from memfit.planner.cpu_floor import cpu_floor
from memfit.planner.ladder import GpuLadder
from memfit.planner.shallow import depth_of, depths, extrapolate, extrapolate_ops, shallow_workload
from memfit.planner.space import ModelFacts, SearchSpace
from memfit.planner.time_model import StepTimeModel, factor_estimate
from memfit.planner.timing import H100, Constants, StepTime, time_from_ops, trace_step
from memfit.planner.workers import SKIPPED, Workers
from memfit.plans import Plan
from memfit.target import Target
from memfit.techniques.base import GraphSize
from memfit.techniques.checkpointing import find_blocks

# NOTE [ Estimates from the nearest measured plan ]
# Values do not always combine multiplicatively: bitsandbytes' 8-bit AdamW is fast alone (on the
# device) and so is state offload alone (torch's fused AdamW on the host), but together the 8-bit
# update runs on the host, 6.8x the estimate (Llama-2-7B for the rtx4090 preset: 7,802 ms measured,
# 1,148 ms estimated). The walk then measured twelve plans with both, each estimated faster than the
# plan it chose and each 6x slower. So once plans are measured, a plan's time is estimated from each
# measured plan whose values are part of its own and in no larger such part: that plan's time
# times the factors of the values the plan adds (the base's time times all of them where there is
# none). What a measured plan showed of how its values combine carries to the plans containing it.
# Where several parts apply (8-bit with offload, and the step in backward with offload, for a plan
# with all three) the slowest estimate stands: each shows a path the plan runs, and the fastest
# would let a measured slow combination back in (an estimate that errs high can hide the fastest
# plan and one that errs low costs a trace; a slow path measured is the better evidence). The walk
# re-queues the plans whose estimate a measurement changed (memfit.planner.walk).

# NOTE [ The deeper trace of a plan over the budget at the shallower depth ]
# A model with more blocks holds no less at its peak (more weights, gradients, states and
# activations), so a plan whose shallower trace alone (2 blocks, less the extrapolation's margin)
# is over the budget is over it at full depth: its deeper trace cannot change the verdict. The walk
# measures plans two at a time (NOTE [ The next plan measured alongside ] in memfit.planner.walk):
# both shallower traces run first, side by side, and each deeper one runs only if its plan is still
# in the running. A plan ruled out so keeps the shallower trace's peak as its lower bound ("needs at
# least") and its estimated time. GPT-2 at 8 x 1024 for 2 GiB (h100-80gb): 8 of the 22 plans the
# walk measured needed more than 2 GiB at 2 blocks (2.21-3.48 GiB). The values measured alone before
# the walk keep both traces: their savings and ratios are taken from the pair.

# NOTE [ The walk's first traces behind the measuring ]
# While one worker compiled torchao's 4-bit update for GPT-2 at 8 x 1024 (2 GiB, h100-80gb; 15 s
# cold), the other ended every other trace before the walk and idled 4.8-5.6 s. The walk then began
# with what nothing measured before it decides: the maximal plans that do not split the batch
# (NOTE [ Maximal plans first when nothing measured fits ] in memfit.planner.walk; 2.4 s of traces)
# and the base's step at each micro-batch size (a split plan's estimated saving, asked for in the
# walk's second round). The search hands those plans to :meth:`GpuStepModel.prepare`, which queues
# their pairs behind its own (memfit.planner.workers): the idle worker traces them, and the walk
# takes the results. Where the fastest of the default plan and each value alone fits, they are
# dropped with the work-adding values (:meth:`Workers.cancel`); a trace already running finishes.
# Only shallow pairs are queued (a full trace left running would hold a worker the walk needs for
# seconds), and the walk's rounds, which replace the queue, keep the base's traces queued. The
# searches of ``--methods`` share the cores and queue none.

# NOTE [ Work-adding values when the default plan fits ]
# A value that only adds work (``Config.adds_work``: checkpointing's recompute, offload's copies, a
# chunked loss's loop) cannot make a plan faster. So where the default plan may fit (its weights,
# and their gradients where all of them train, are within the budget), the default and the values
# that do not only add work are measured first. When the fastest of those (the default, or one
# value alone where the values faster than the default are all of one technique, so that no two
# combine) fits by its own full trace, no plan can beat it: every other combination is estimated
# slower, and the work-adding values are not measured at all (left out, with a note). QLoRA of
# Llama-2-7B for the rtx4090 preset (bf16-pure alone is the fastest, and fits): 7 traces instead of
# 17. Where it does not fit, the rest are measured as before (one more wait for the workers).


# NOTE [ Compiled updates measured at the smallest weights ]
# torchao's update compiles a graph per parameter shape and weight dtype, about 4-13 s of a worker
# each on a cold cache here (GPT-2: six shapes), where any other value alone traces in half a
# second. Where the searched precisions hold weights of two dtypes (bf16 autocast keeps fp32
# weights, bf16-pure bf16 ones), such a value is measured once, at the precision alone with the
# smallest weights that may fit, against that precision alone: its ratio and saving carry to the
# other precisions' estimates. The plans the walk measures first are those smallest-weight ones
# (the fastest and the smallest): a plan with the update at the other weight dtype compiles only if
# the walk reaches it. GPT-2 at batch 8 x 1024 for 2 GiB (h100-80gb): the three updates for fp32
# weights (10.8, 12.1 and 4.1 s of a worker) are no longer compiled, 98 traces instead of 108, and
# the measuring before the walk takes 22 s instead of 33; the choice is the same. Where the base's
# weights exceed the budget (Llama-2-7B's fp32 weights on a 24 GB card), this also keeps the update
# from being compiled for weights no plan can hold (about 40 s each here).

def _adds_work(key: tuple[str, object]) -> bool:
    name, value = key
    if name == "micro_batch_size":
        return False
    from memfit.plans import technique_of
    return technique_of(name).config({name: value}).adds_work  # (the value alone: budget:F needs a compile mode in a Plan)


def _after_shallowest(jobs: list[tuple], which) -> dict:
    """Job -> the job it waits for: among the ``jobs`` of the plans ``which(plan)`` names, each
    deeper trace (full depth last) of a plan and batch starts after its shallowest one."""
    first, after = {}, {}
    for job in sorted((j for j in jobs if which(j[0])), key=lambda j: (j[1] is None, j[1] or 0)):
        key = (job[0], job[2])
        if key in first:
            after[job] = first[key]
        else:
            first[key] = job
    return after


def _shares_compiles(plan: Plan) -> bool:
    """The plan's compiled graphs are the same at every depth (torchao's update, one per parameter
    shape; ``compile: blocks``, one per block): a deeper trace after the shallowest finds them in
    Inductor's cache (NOTE [ Jobs in the background, and after the compile they share ] in
    memfit.planner.workers)."""
    return _compiles((plan, None, None)) is not None


def _compiles(job: tuple) -> tuple | None:
    """What a trace job compiles, as a key (None: nothing): the job runs in a worker that compiled
    it before (NOTE [ A compile's traces in the process that compiled it ] in memfit.planner.workers)."""
    plan = job[0]
    if plan.config("compile").mode == "blocks":
        return ("blocks", plan)
    per_weight = tuple((c.name, *map(str, c.values().values())) for c in plan.techniques if c.compiles_per_weight_dtype)
    return (per_weight, plan.config("precision").weights) if per_weight else None


def _weight_bytes(n_params: int, plan: Plan) -> int:
    """Every parameter in the plan's weight dtype (Precision.weights: fp32 or bf16)."""
    return n_params * (2 if plan.config("precision").weights == "bf16" else 4)


def _plans_of(first: list[Plan], pairs) -> list[Plan]:
    """``first``, then the plans of the (with, without) ``pairs``, each once."""
    return list(dict.fromkeys([*first, *(plan for pair in pairs for plan in pair)]))


FORWARD, BACKWARD = 2, 3  # memfit.planner.opcost.PHASES


def _forward_backward_span(ops: list) -> tuple[int, int]:
    """The indices of the first forward op and the last backward op (what runs per micro-batch)."""
    first = next((i for i, op in enumerate(ops) if op.phase == FORWARD), 0)
    last = max((i for i, op in enumerate(ops) if op.phase == BACKWARD), default=len(ops) - 1)
    return first, last


PEAK_MARGIN = 0.02
"""How far an extrapolated allocated peak may be above the full trace's (caching-allocator rounding;
1% seen with ``blocks:every=2`` on a small model): the lower bound that prunes is that much lower."""


class Traced(NamedTuple):
    """What the model keeps of one trace (small, so a worker process can send it back)."""

    peak_bytes: int
    context_bytes: int
    used_bytes: int
    """What the budget counts (reserved + context on a GPU preset)."""
    ops: list
    stream: Stream | None = None
    """Its allocations (shallow traces of eager plans: memfit.memory.deep_stream)."""


@dataclass
class Measured:
    """A plan's figures from its own traces (shallow and extrapolated, or full)."""

    seconds: float
    step: StepTime
    peak_bytes: int
    """Allocated peak."""
    used_lower: int
    """A lower bound of what the budget counts (allocated peak, less ``PEAK_MARGIN`` when it is
    extrapolated, + CUDA context)."""
    used_bytes: int | None = None
    """What the budget counts (reserved + context): full traces only."""
    graph: GraphSize = field(default_factory=GraphSize)
    shallower_only: bool = False
    """Over the budget at the shallower depth, its deeper trace skipped: ``seconds`` is the
    estimate, the peak and lower bound the shallower trace's (NOTE [ The deeper trace of a plan
    over the budget at the shallower depth ])."""
    full: bool = False


class _Deep(Exception):
    """A shallow trace failed for the model's sake: trace at full depth."""


class GpuStepModel(StepTimeModel):
    """Time model of the GPU-preset planner (see the module docstring)."""

    kind = "op-level"

    def __init__(self, target: Target, space: SearchSpace, facts: ModelFacts, budget: Budget, *,
                 fixed: dict | None = None, k: Constants = H100) -> None:
        """``fixed``: plan fields outside the search space that every candidate has (ema, ...)."""
        self.target, self.space, self.budget, self.k = target, space, budget, k
        self.fixed = dict(fixed or {})
        self.world = int(self.fixed.get("world_size") or 1)
        self.rank_batch = target.batch_size // self.world
        """The samples one rank's step runs (what micro-batch sizes split)."""
        self.depth = depth_of(facts.model)
        self._meta = facts.model
        self._n_params = facts.n_params
        self.measured: dict[Plan, Measured] = {}
        self._new: list[Plan] = []
        """Plans measured since the walk last asked (:meth:`newly_measured`)."""
        self._keys: dict[Plan, frozenset] = {}
        self.ratios: dict[tuple[str, object], float] = {}
        self.savings: dict[tuple[str, object], int] = {}
        """(technique, value) -> bytes of the budget saved alone (negative: saves), for the estimates."""
        self.cpu_extra: dict[tuple[str, object], tuple[float, float]] = {}
        """(technique, value) -> (extra CPU seconds alone, CPU seconds of the step measured against),
        for the CPU's floor (NOTE [ The CPU's floor under an estimate ] in memfit.planner.cpu_floor)."""
        self._forward_backward_cpu: dict[Plan, float] = {}
        self.excluded: list[str] = []
        self.traces = self.full_traces = 0
        self.seconds_spent = 0.0
        self.base: Plan | None = None
        self.shallow_failed: str | None = None
        self._workloads: dict[int, object] = {}
        self._traced: dict[tuple, Traced | Exception] = {}
        self._deep: dict[Plan, int | None] = {}
        self._containers = tuple(name for name, _ in find_blocks(facts.model))
        """The repeated-block containers (their module names give an allocation's block)."""
        # forked children cannot use CUDA once the parent has: no workers where tensors are CUDA's
        self.workers = Workers(self._trace, fork=target.tensor_device != "cuda", affinity=_compiles)

    def close(self) -> None:
        self.workers.close()

    # -- tier 1: estimates ---------------------------------------------------------------------
    def prepare(self, ahead: list[Plan] | None = ()) -> None:
        """Measure the default plan and each searched value alone, for the estimates (values that
        do not suit the workload leave the space, with the reason in ``excluded``); ``ahead``: plans
        the walk may measure first, queued behind (NOTE [ The walk's first traces behind the
        measuring ]; None: nothing is queued for the walk)."""
        self.base = self._base_plan()
        alone = {}
        for name, values in self.space.values.items():
            for value in values:
                plan = self._alone(name, value)
                if plan is not None and plan != self.base:
                    alone[(name, value)] = plan
        micro = [m for m in self.space.micro_batches if m != self.rank_batch]
        elsewhere = self._measured_elsewhere(alone)  # NOTE [ Compiled updates measured at the smallest weights ]
        pairs = {key: elsewhere.get(key, (plan, self.base)) for key, plan in alone.items()}
        walk_first = self._walk_first_jobs(ahead, micro) if ahead is not None else []
        if self._may_fit_alone():  # NOTE [ Work-adding values when the default plan fits ]
            others = {k: pair for k, pair in pairs.items() if not _adds_work(k)}
            self.trace_shallow(_plans_of([self.base], others.values()),
                               behind=[*self._jobs(_plans_of([], pairs.values())), *walk_first])
            if self._fastest_fits(others):
                walk_first = []  # (dropped with the work-adding values: the walk takes the plan that fits)
                left = [k for k in alone if _adds_work(k)]
                for name, value in left:
                    self.space.values[name].remove(value)
                    del alone[(name, value)], pairs[(name, value)]
                if left:
                    self.space.notes.append(
                        f"{', '.join(sorted({n for n, _ in left}))} not searched: these values only add work, and the "
                        "fastest of the default plan and each other value alone fits (by its full trace)")
        self.trace_shallow(_plans_of([self.base], pairs.values()), behind=walk_first)
        base = self.measure(self.base)
        for (name, value), (with_value, without) in pairs.items():
            try:
                m, ref = self.measure(with_value), self.measure(without)
            except UserError as e:
                self.space.values[name].remove(value)
                self.excluded.append(f"{name}={value}: {e}")
                continue
            self.ratios[(name, value)] = m.seconds / ref.seconds
            self.savings[(name, value)] = m.used_lower - ref.used_lower
            self.cpu_extra[(name, value)] = (m.step.cpu_seconds - ref.step.cpu_seconds, ref.step.cpu_seconds)
        for m in micro:  # (their savings are traced when first asked for: tight budgets only)
            self.ratios[("micro_batch_size", m)] = self._micro_seconds(m) / base.seconds
        if micro:  # (the CPU's floor splits their steps: NOTE [ The CPU's floor under an estimate ])
            for value in {self.base.precision, *self.space.values.get("precision", [])}:
                ref = self._precision_alone(value)
                if ref is not None:
                    self._forward_backward_cpu[ref] = self._forward_backward(ref)

    def _walk_first_jobs(self, ahead: list[Plan], micro: list[int]) -> list[tuple]:
        """NOTE [ The walk's first traces behind the measuring ]: the shallow pairs of ``ahead`` and
        the base's at each micro-batch size in ``micro`` (what a split plan's estimate asks for)."""
        pair = self._depths(self.base)
        if not pair:
            return []
        paired = [p for p in ahead if self._depths(p)]
        return [*self._jobs(paired), *((self.base, d, m) for m in micro for d in pair)]

    def _jobs(self, plans: list[Plan]) -> list[tuple]:
        """The shallow pairs (or full traces) of ``plans``, the shallower depth of every plan first: the
        deeper trace of a plan that compiles comes later, and finds its graphs in Inductor's cache
        (NOTE [ Predicted wrappers in Inductor's caches ])."""
        pairs = [self._depths(p) or (None,) for p in plans]
        jobs = [(p, pair[i], None) for i in range(max(map(len, pairs), default=0)) for p, pair in zip(plans, pairs)
                if i < len(pair)]
        for d in dict.fromkeys(d for _, d, _ in jobs if d is not None):  # (here: the forked workers share them)
            self._shallow(d)
        return jobs

    def _may_fit_alone(self) -> bool:
        """Whether the default plan's weights (and, where every weight trains, their gradients) are
        within the budget (quantized base weights: assumed): else it cannot fit, and nothing is gained
        by asking first."""
        if self.world > 1:
            return False
        if self.base.base_weights != "as-is":  # (quantized: most weights take a byte or less)
            return True
        return _weight_bytes(self._n_params, self.base) * (1 if self.base.adapter != "none" else 2) <= self.budget.bytes

    def _fastest_fits(self, others: dict) -> bool:
        """NOTE [ Work-adding values when the default plan fits ]: the fastest of the default plan and
        each value alone in ``others`` ((name, value) -> (plan with it, plan without it)) fits by
        its full trace, and no plan can be faster (the values faster than the default's are of one
        technique: no two combine; a value measured at another precision that is faster there
        leaves the fastest plan alone unknown)."""
        try:
            base = self.measure(self.base)
            faster = []
            for (name, _), (plan, without) in others.items():
                try:
                    m, ref = self.measure(plan), self.measure(without)
                except UserError:  # (left out below, with the reason)
                    continue
                if without != self.base and m.seconds < ref.seconds:
                    return False
                if m.seconds < base.seconds:
                    faster.append((m.seconds, name, plan))
            if len({name for _, name, _ in faster}) > 1:
                return False
            best = min(faster, key=lambda x: x[0])[2] if faster else self.base
            if self.measure(best).used_lower > self.budget.bytes:
                return False
            self.workers.cancel()  # (the work-adding values queued behind: likely not needed now)
            return self.confirm(best).used_bytes <= self.budget.bytes
        except UserError:
            return False

    def _measured_elsewhere(self, alone: dict) -> dict:
        """(name, value) -> (plan with it, plan without it) for the values alone that compile per
        weight dtype (torchao's update), measured at the searched precision with the smallest
        weights that may fit, against that precision alone, where the base's weights are larger
        (NOTE [ Compiled updates measured at the smallest weights ])."""
        fitting = [(_weight_bytes(1, plan), key[1], plan) for key, plan in alone.items()
                   if key[0] == "precision" and self._weights_fit(plan)
                   and _weight_bytes(1, plan) < _weight_bytes(1, self.base)]
        if not fitting:
            return {}
        _, precision, reference = min(fitting, key=lambda x: x[0])
        out = {}
        for key, plan in alone.items():
            if key[0] != "precision" and any(c.compiles_per_weight_dtype for c in plan.techniques):
                try:
                    out[key] = (plan.replace(precision=precision), reference)
                except UserError:
                    continue
        return out

    def _weights_fit(self, plan: Plan) -> bool:
        """Whether the plan's weights alone (each parameter in its weight dtype) are within the budget
        (sharded ranks hold a part: always, there)."""
        return self.world > 1 or _weight_bytes(self._n_params, plan) <= self.budget.bytes

    def estimated_used(self, plan: Plan) -> int:
        """What the plan is estimated to need of the budget without a trace of its own: the
        default's lower bound plus each value's saving alone. Savings on different parts (optimizer
        states, activations) add up; two on the same part (activations) save less together than
        the sum: the estimate errs low (a product of the fractions each leaves errs high where the
        parts differ, and hid the fastest plan at a tight budget). It only spares the search the
        traces of plans well over the budget."""
        if not self.can_estimate_used(plan):  # the base's step at the plan's micro-batch size, traced
            micro = plan.micro_batches(self.target.batch_size)[0]
            try:
                saved = self._lower_bound(self.base, micro) - self.measured[self.base].used_lower
            except UserError:  # unknown: no estimate spares this plan's trace
                saved = -self.measured[self.base].used_lower
            self.savings[("micro_batch_size", micro)] = saved
        return self.measured[self.base].used_lower + sum(self.savings.get(key, 0) for key in self.technique_keys(plan))

    def can_estimate_used(self, plan: Plan) -> bool:
        """:meth:`estimated_used` needs no trace for ``plan`` (its micro-batch size's saving is known)."""
        micro = plan.micro_batches(self.target.batch_size)[0]
        return micro == self.rank_batch or ("micro_batch_size", micro) in self.savings

    def _micro_seconds(self, micro: int) -> float:
        """The base split into micro-batches of ``micro``, estimated without a trace from the base's
        ops: forward and backward once per micro-batch, each op doing ``micro / batch`` of its work
        (optimistic: the weights are read by every micro-batch), the rest once."""
        ops = self._ops_of(self.base)
        n = self.rank_batch // micro
        first, last = _forward_backward_span(ops)
        part = [op._replace(flops=op.flops / n, nbytes=op.nbytes // n) for op in ops[first:last + 1]]
        return time_from_ops(ops[:first] + part * n + ops[last + 1:], self.target.with_plan(self.base),
                             self.k).seconds

    def _base_plan(self) -> Plan:
        precisions = self.space.values.get("precision", [])
        half = next((p for p in precisions if p in ("bf16", "fp16")), None)
        first = {name: values[0] for name, values in self.space.values.items() if values}
        return Plan(**{**first, **self.fixed, **({"precision": half} if half else {})})

    def _alone(self, name: str, value) -> Plan | None:
        """The base with ``value`` (or, when it cannot run alone, with the first other searched value
        that lets it run: ``budget:F`` with a compile mode)."""
        try:
            return self.base.replace(**{name: value})
        except UserError:
            pass
        for other, values in self.space.values.items():
            for v in values if other != name else ():
                try:
                    return self.base.replace(**{name: value, other: v})
                except UserError:
                    continue
        return None

    def predict(self, plan: Plan) -> float:
        """The plan's measured step time, else its estimate (tier 1) from its nearest measured part
        (NOTE [ Estimates from the nearest measured plan ])."""
        m = self.measured.get(plan)
        if m is not None and not m.shallower_only:
            return m.seconds
        keys = self.technique_keys(plan)
        parts = [(part, m.seconds) for other, m in self.measured.items()
                 if not m.shallower_only and (part := self.technique_keys(other)) and part <= keys]
        largest = [(part, seconds) for part, seconds in parts if not any(part < bigger for bigger, _ in parts)]
        if not largest:
            estimate = factor_estimate(self.measured[self.base].seconds, keys, self.ratios)
        else:
            estimate = max(factor_estimate(seconds, keys - part, self.ratios) for part, seconds in largest)
        return max(estimate, self.cpu_floor(plan))

    def cpu_floor(self, plan: Plan) -> float:
        """What the CPU at least spends issuing ``plan``'s step, from its precision's step and each
        other value's extra alone (NOTE [ The CPU's floor under an estimate ]); 0 where there is no
        floor (compiled, sharded, the update on the host) or its parts are not measured."""
        if self.world > 1 or not plan.config("compile").is_default or plan.config("offload").states == "optimizer_states":
            return 0.0
        keys = self.technique_keys(plan)
        ref = self._precision_alone(plan.precision)
        n = plan.micro_batches(self.target.batch_size)[1]
        extras = [(key, *self.cpu_extra[key]) for key in keys if key[0] != "precision" and key in self.cpu_extra]
        measured = self.measured.get(ref) if ref is not None else None
        if measured is None or measured.step is None or (n == 1 and not extras):
            return 0.0
        if n > 1 and ref not in self._forward_backward_cpu:  # (measured before the walk, or no floor: no trace here)
            return 0.0
        return cpu_floor(measured.step.cpu_seconds, self._forward_backward_cpu.get(ref, 0.0), n, extras)

    def _precision_alone(self, precision) -> Plan | None:
        """The base at ``precision``, where it was measured (the CPU floor's reference)."""
        try:
            plan = self.base.replace(precision=precision)
        except UserError:
            return None
        return plan if plan in self.measured else None

    def _forward_backward(self, plan: Plan) -> float:
        """CPU seconds issuing a measured plan's forward and backward (once per micro-batch)."""
        ops = self._ops_of(plan)
        first, last = _forward_backward_span(ops)
        return time_from_ops(ops[first:last + 1], self.target.with_plan(plan), self.k).cpu_seconds

    def technique_keys(self, plan: Plan) -> frozenset:
        """The plan's (technique, value) pairs that differ from the base, with its micro-batch size
        where it splits the batch."""
        keys = self._keys.get(plan)
        if keys is None:
            keys = {(name, getattr(plan, name)) for name in self.space.values if getattr(plan, name) != getattr(self.base, name)}
            micro = plan.micro_batches(self.target.batch_size)[0]
            if micro != self.rank_batch:
                keys.add(("micro_batch_size", micro))
            keys = self._keys[plan] = frozenset(keys)
        return keys

    def newly_measured(self) -> list[Plan]:
        new, self._new = self._new, []
        return new

    def estimate_depends_on(self, plan: Plan, measured: list[Plan]) -> bool:
        keys = self.technique_keys(plan)
        return any(self.technique_keys(m) <= keys for m in measured)

    def is_estimate(self, plan: Plan) -> bool:
        return plan not in self.measured

    def ladder(self, target: Target, budget: Budget) -> GpuLadder:
        return GpuLadder(self)

    def is_measured(self, plan: Plan) -> bool:
        return plan in self.measured

    def is_confirmed(self, plan: Plan) -> bool:
        m = self.measured.get(plan)
        return m is not None and m.full

    # -- tiers 2 and 3: traces -----------------------------------------------------------------
    def measure(self, plan: Plan) -> Measured:
        """The plan's time and allocated peak from a shallow trace pair (full depth when the model
        is shallow, or a shallow trace failed once)."""
        if plan in self.measured:
            return self.measured[plan]
        pair = self._depths(plan)
        if not pair:
            return self.confirm(plan)
        try:
            a, b = self._run([(plan, d, None) for d in pair])
        except (_Deep, UserError):  # the shallow model failed: the full one decides (and raises)
            return self.confirm(plan)
        if b is SKIPPED:  # NOTE [ The deeper trace of a plan over the budget at the shallower depth ]
            m = self.measured[plan] = Measured(seconds=self.predict(plan), step=None, peak_bytes=a.peak_bytes,
                                               used_lower=self._shallow_lower(a), shallower_only=True)
            return m
        (d, e), full = pair, self.depth
        ops = extrapolate_ops(a.ops, b.ops, d, e, full)
        target = self.target.with_plan(plan)
        if ops is not None:
            step = time_from_ops(ops, target, self.k)
        else:  # the runs do not line up: the time on the line through both depths
            sa, sb = time_from_ops(a.ops, target, self.k), time_from_ops(b.ops, target, self.k)
            step = dataclasses.replace(sb, seconds=extrapolate(sa.seconds, sb.seconds, d, e, full),
                                       cpu_seconds=extrapolate(sa.cpu_seconds, sb.cpu_seconds, d, e, full), notes=[
                "the shallow steps' ops did not line up: time extrapolated on a line"])
        peak = int(extrapolate(a.peak_bytes, b.peak_bytes, d, e, full))  # (PEAK_MARGIN below)
        n = plan.micro_batches(self.target.batch_size)[1]  # a graph is compiled once, run per micro-batch
        fwd_a, fwd_b = (sum(op.phase == FORWARD for op in t.ops) // n for t in (a, b))
        graph = GraphSize(forward_ops=int(extrapolate(fwd_a, fwd_b, d, e, full)), block_ops=max(1, (fwd_b - fwd_a) // (e - d)))
        m = Measured(seconds=step.seconds, step=step, peak_bytes=peak,
                     used_lower=int(peak * (1 - PEAK_MARGIN)) + b.context_bytes, graph=graph)
        self.measured[plan] = m
        self._new.append(plan)
        return m

    def deep_used(self, plan: Plan) -> int | None:
        """What the budget counts for a measured plan, from its shallow pair's allocations
        replayed at full depth (NOTE [ Allocations at full depth ]; 0.05-0.5 s, so asked only of a
        plan about to be confirmed); None where they do not line up, or the plan has no pair."""
        if plan not in self._deep:
            pair, traced = self._depths(plan), None
            if pair and all(isinstance(self._traced.get((plan, d, None)), Traced) for d in pair):
                traced = [self._traced[(plan, d, None)] for d in pair]
            deep = None
            if traced and traced[0].stream is not None and traced[1].stream is not None:
                deep = deepen(traced[0].stream, traced[1].stream, *pair, self.depth)
            self._deep[plan] = None if deep is None else replay(deep, STEADY_STEP, expandable=plan.config("allocator").expands)[1] + traced[1].context_bytes
        return self._deep[plan]

    def confirm(self, plan: Plan) -> Measured:
        """The plan's full trace: what ``memfit estimate`` reports, and its time at full depth."""
        m = self.measured.get(plan)
        if m is not None and m.full:
            return m
        (t,) = self._run([(plan, None, None)])
        step = time_from_ops(t.ops, self.target.with_plan(plan), self.k)
        forward = sum(op.phase == FORWARD for op in t.ops) // plan.micro_batches(self.target.batch_size)[1]
        graph = GraphSize(forward_ops=forward, block_ops=m.graph.block_ops if m else forward // max(1, self.depth or 1))
        m = Measured(seconds=step.seconds, step=step, peak_bytes=t.peak_bytes, used_lower=t.peak_bytes + t.context_bytes,
                     used_bytes=t.used_bytes, graph=graph, full=True)
        self.measured[plan] = m
        self._new.append(plan)
        return m

    def trace_shallow(self, plans: list[Plan], behind: list[tuple] = (), skip_over: bool = False) -> None:
        """Run the shallow pairs of ``plans`` together (in parallel; :meth:`measure` then reads them);
        the jobs ``behind`` are queued after them, in the background (memfit.planner.workers).
        ``skip_over``: a plan over the budget at its shallower depth is not traced deeper (NOTE [ The
        deeper trace of a plan over the budget at the shallower depth ])."""
        jobs = self._jobs(plans)
        rest = [j for j in dict.fromkeys(behind) if j not in jobs and j not in self._traced]
        self._run(jobs, check=False, behind=rest, skip_over=skip_over and len(plans) > 1)

    def queue_shallowest(self, plans: list[Plan]) -> None:
        """The shallowest trace of each of ``plans`` (those with a pair) queued in the background, in
        place of the plans queued before (NOTE [ The next round's traces in the background ] in
        memfit.planner.walk); the base's traces at other micro-batch sizes stay queued, behind them."""
        micro = [j for j in self.workers.cancel() if j[2] is not None]  # (the base at a micro-batch size: kept)
        jobs = [(p, pair[0], None) for p in plans for pair in [self._depths(p)] if pair]
        self.workers.start([j for j in [*jobs, *micro] if j not in self._traced])

    def _shallow_lower(self, t: Traced) -> int:
        """A lower bound of the full plan's need from one shallow trace (more blocks hold no less)."""
        return int(t.peak_bytes * (1 - PEAK_MARGIN)) + t.context_bytes

    def _skip_deeper(self, job: tuple, shallower) -> bool:
        return isinstance(shallower, Traced) and self._shallow_lower(shallower) > self.budget.bytes

    def trace_full(self, plans: list[Plan]) -> None:
        """Trace ``plans`` at full depth together (in parallel; :meth:`confirm` then reads them)."""
        self._run([(p, None, None) for p in plans], check=False)

    def has_full_trace(self, plan: Plan) -> bool:
        return (plan, None, None) in self._traced

    def has_shallow_traces(self, plan: Plan) -> bool:
        """Its shallow pair ran (or failed): :meth:`measure` costs no trace (a full trace where it has none)."""
        pair = self._depths(plan)
        return all((plan, d, None) in self._traced for d in pair) if pair else self.has_full_trace(plan)

    def _depths(self, plan: Plan) -> tuple[int, ...]:
        return () if not self.depth or self.shallow_failed else (depths(plan, self.depth) or ())

    def _lower_bound(self, plan: Plan, batch: int) -> int:
        """The lower bound of what ``plan`` at ``batch`` needs (a micro-batch's step: what the
        plan split into micro-batches of ``batch`` holds at its peak, but the accumulated gradients)."""
        pair = self._depths(plan)
        if pair:
            try:
                a, b = self._run([(plan, d, batch) for d in pair])
                peak = extrapolate(a.peak_bytes, b.peak_bytes, *pair, self.depth)
                return int(peak * (1 - PEAK_MARGIN)) + b.context_bytes
            except _Deep:
                pass
        (t,) = self._run([(plan, None, batch)])
        return t.peak_bytes + t.context_bytes

    def _ops_of(self, plan: Plan) -> list:
        """The full-depth ops of a measured plan."""
        pair = self._depths(plan)
        if pair and not self.is_confirmed(plan):
            a, b = self._run([(plan, d, None) for d in pair])
            ops = extrapolate_ops(a.ops, b.ops, *pair, self.depth)
            if ops is not None:
                return ops
        (t,) = self._run([(plan, None, None)])
        return t.ops

    # -- running traces --------------------------------------------------------------------------
    def _run(self, jobs: list[tuple], check: bool = True, behind: list[tuple] = (),
             skip_over: bool = False) -> list[Traced]:
        """The traces of ``jobs`` ((plan, depth or None for full, batch or None)), cached; those not
        traced yet run on the worker processes. ``check``: raise the first job's error (a plan's
        UserError, or _Deep when a shallow trace failed for another reason: then shallow traces
        stop); ``behind``: jobs queued after them, in the background, for a later call to take."""
        todo = list(dict.fromkeys(j for j in jobs if j not in self._traced))
        after = _after_shallowest(todo, _shares_compiles)
        todo.sort(key=lambda job: job not in after.values())  # (the compiles first: the longest jobs)
        if skip_over:  # each deeper shallow trace after its plan's shallower one (which may make it needless)
            after = {**_after_shallowest([j for j in todo if j[1] is not None], lambda plan: True), **after}
        t0 = time.perf_counter()
        for job, result in zip(todo, self.workers.map(todo, after=after, behind=list(behind),
                                                      skip=self._skip_deeper if skip_over else None)):
            self._traced[job] = result
            if result is SKIPPED:
                continue
            if isinstance(result, Traced):
                self.traces += 1
                self.full_traces += job[1] is None
            elif job[1] is not None and not isinstance(result, UserError):
                self.shallow_failed = self.shallow_failed or f"{type(result).__name__}: {result}"
        self.seconds_spent += time.perf_counter() - t0
        out = [self._traced[j] for j in jobs]
        for job, result in zip(jobs, out if check else ()):
            if isinstance(result, UserError):
                raise result
            if isinstance(result, Exception):
                if job[1] is None:
                    raise result
                raise _Deep(str(result))
        return out

    def _shallow(self, depth: int):
        """The workload cut to ``depth`` blocks (one per depth: its meta model is cut once)."""
        if depth not in self._workloads:
            self._workloads[depth] = shallow_workload(self.target.workload, depth, meta=self._meta)
        return self._workloads[depth]

    def _trace(self, job: tuple) -> Traced | Exception:
        """One trace (run in a worker process): a plan's error comes back as a value."""
        plan, depth, batch = job
        target = self.target.with_plan(plan)
        if batch is not None:
            target = dataclasses.replace(target, batch_size=batch * self.world)  # (``batch``: one rank's)
        if depth is not None:
            target = dataclasses.replace(target, workload=self._shallow(depth))
        trackers = []
        try:
            report, _, ops = trace_step(target, self.k, on_tracker=trackers.append if depth and not batch else None)
        except UserError as e:
            return e
        except Exception as e:  # noqa: BLE001 - shallow: the model indexes its blocks by a count
            if depth is None:
                raise
            return RuntimeError(f"{type(e).__name__}: {e}")
        stream = None
        if trackers:
            tracker = trackers[0]
            stream = from_tracker(tracker, traced_device(target.device, "fake", target.tensor_device),
                                  getattr(tracker, "side_streams", None), self._containers)
        return Traced(report.peak_bytes, report.cuda_context_bytes or 0, self.budget.used_bytes(report), ops, stream)

    # -- what the planner asks of every time model ---------------------------------------------
    def warmup(self, plan: Plan) -> float:
        """One-time compile seconds before the first step, from the compiled graph's size."""
        configs = [c for c in plan.techniques if not c.is_default]
        if not any(c.warms_up for c in configs):
            return 0.0
        m = self.measured.get(plan) or self.measured.get(self.base)
        return sum(c.warmup_seconds(m.graph, plan) for c in configs) if m else 0.0

    def describe(self) -> str:
        shallow = (f"; plans measured by shallow traces at 2 and 3 of {self.depth} blocks (2 and 4 with a period of 2), their ops extrapolated, "
                   "the chosen one confirmed by a full trace") if self._depths(self.base or Plan()) else ""
        return (f"op-level: each plan's own ops on the {self.target.device.name} preset, constants fitted on H100 "
                f"recordings{shallow}; {self.traces} traces ({self.full_traces} at full depth, "
                f"{self.workers.count} processes) in {self.seconds_spent:.1f} s")
