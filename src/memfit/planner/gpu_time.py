"""The planner's step-time model for GPU presets: each plan priced by the ops its own step runs.

A plan's time is memfit.planner.timing's op-level model run on the ops of a fake trace of the plan's
own TrainStep, so what a technique costs is what it runs (recomputed blocks, smaller micro-batch
kernels, per-chunk loss kernels, 8-bit updates, copies over the host link). The traces are the trace
book's (memfit.planner.traces); this model only prices their ops:

1. **Estimate** (a plan the walk has not measured): the base plan's time times the ratio each of
   the plan's values had alone (memfit.planner.baseline measures them before the walk;
   memfit.planner.time_model.factor_estimate, the CPU model's too), and once the walk has measured
   plans, from the plan's nearest measured part instead (NOTE [ Estimates from the nearest measured
   plan ]); never under the CPU's floor, nor under the host update's of a measured plan updating
   alike (memfit.planner.cpu_floor).
2. **Measured** (a plan the walk visited: a shallow pair's ops extrapolated to full depth, or a full
   trace's): the plan's own ops, priced. The walk puts it back into its queue at that time.

Compile time (one-time, before the first step) comes from the compiled graph's size: the forward's
ops for ``compile: full``, one block's for ``blocks`` (read from the shallow pair), at the rate of
the one H100 recording (memfit.techniques.compile).
"""

from __future__ import annotations

import dataclasses

from memfit.memory.managed import Migration
from memfit.planner.baseline import Baseline
from memfit.planner.cpu_floor import FLOOR_SHARE, cpu_floor, update_signature, updates_on_host
from memfit.planner.ops import forward_backward_span
from memfit.planner.shallow import extrapolate
from memfit.planner.time_model import StepTimeModel, factor_estimate
from memfit.planner.timing import H100, Constants, StepTime, time_from_ops
from memfit.planner.traces import Measured, TraceBook
from memfit.plans import Plan


class GpuStepModel(StepTimeModel):
    """Time model of the GPU-preset planner (see the module docstring)."""

    kind = "op-level"

    def __init__(self, book: TraceBook, baseline: Baseline, *, k: Constants = H100, host=None) -> None:
        self.book, self.baseline, self.k = book, baseline, k
        self.host = host
        """The training machine whose host costs ``k`` carries (memfit.hosts.Host; None: the default)."""
        self.target = book.target
        self.ratios: dict[tuple[str, object], float] = {}
        """(technique, value) -> its step time over the step measured against, alone."""
        self.cpu_extra: dict[tuple[str, object], tuple[float, float]] = {}
        """(technique, value) -> (extra CPU seconds alone, CPU seconds of the step measured against),
        for the CPU's floor (NOTE [ The CPU's floor under an estimate ] in memfit.planner.cpu_floor)."""
        self._forward_backward_cpu: dict[Plan, float] = {}
        self._priced: dict[Plan, tuple[Measured, StepTime]] = {}

    @property
    def base(self) -> Plan | None:
        return self.baseline.base

    @property
    def excluded(self) -> list[str]:
        return self.baseline.excluded

    def prepare(self, ahead: list[Plan] | None = ()) -> None:
        """Measure the base and each searched value alone (memfit.planner.baseline), and take each
        value's ratio and extra CPU time; ``ahead``: plans the walk may measure first, queued behind
        (None: nothing is queued for the walk)."""
        self.baseline.measure(ahead, self.seconds)
        base = self.seconds(self.base)
        for key, (with_value, without) in self.baseline.pairs.items():
            m, ref = self.step(with_value), self.step(without)
            self.ratios[key] = self._unpaged(with_value) / self._unpaged(without)  # (NOTE [ Migration in estimates ])
            self.cpu_extra[key] = (m.cpu_seconds - ref.cpu_seconds, ref.cpu_seconds)
        for m in self.baseline.micro:  # (their savings are traced when first asked for: tight budgets only)
            self.ratios[("micro_batch_size", m)] = self._micro_seconds(m) / base
        if self.baseline.micro:  # (the CPU's floor splits their steps: NOTE [ The CPU's floor under an estimate ])
            for value in {self.base.precision, *self.baseline.space.values.get("precision", [])}:
                ref = self.baseline.precision_alone(value)
                if ref is not None:
                    self._forward_backward_cpu[ref] = self._forward_backward(ref)

    # -- a measured plan's own time ---------------------------------------------------------------
    def step(self, plan: Plan) -> StepTime | None:
        """The step time of a measured plan, its ops priced (None: not measured, or only at its
        shallower depth)."""
        m = self.book.measured.get(plan)
        if m is None or m.shallower_only:
            return None
        priced = self._priced.get(plan)
        if priced is None or priced[0] is not m:
            priced = self._priced[plan] = (m, self._price(plan, m))
        return priced[1]

    def seconds(self, plan: Plan) -> float:
        """The step seconds of a measured plan."""
        return self.step(plan).seconds

    def _unpaged(self, plan: Plan) -> float:
        """A measured plan's step seconds without its managed pages' migration."""
        step = self.step(plan)
        return step.seconds - step.migration

    def _price(self, plan: Plan, m: Measured) -> StepTime:
        target = self.target.with_plan(plan)
        if m.ops is not None:
            return self._migrated(time_from_ops(m.ops, target, self.k), m)
        a, b, d, e, full = m.pair  # the runs do not line up: the time on the line through both depths
        sa, sb = time_from_ops(a, target, self.k), time_from_ops(b, target, self.k)
        worker = extrapolate(sa.worker, sb.worker, d, e, full)  # (a step lasts at least its worker's seconds)
        return self._migrated(dataclasses.replace(sb, seconds=max(worker, extrapolate(sa.seconds, sb.seconds, d, e, full)),
                                                  cpu_seconds=extrapolate(sa.cpu_seconds, sb.cpu_seconds, d, e, full),
                                                  worker=worker,
                                                  notes=["the shallow steps' ops did not line up: time extrapolated on a line"]), m)

    # NOTE [ Migration in estimates ]
    # A paged optimizer's states that the budget has no room for migrate over the host link each step
    # (memfit.memory.managed), and how many depends on the plan's allocator side: a plan measured by a
    # shallow pair has only its lower bound (so its migration errs low until its full trace), and a plan
    # not measured has none. So the time of a measured plan adds its migration, and the ratios and
    # nearest-part estimates are taken without it: a paged value measured alone on the base plan (whose
    # activations leave no room) would otherwise carry the whole states' migration into every plan that
    # pages, hiding the plans that leave the states room. An estimate without migration errs low, which
    # costs a trace, not the answer.
    def _migrated(self, step: StepTime, m: Measured) -> StepTime:
        """``step`` plus its managed pages' migration (NOTE [ Managed memory over the budget ] in
        memfit.memory.budget), from the allocator side measured (a lower bound before the full trace)."""
        moved = self._moved(m)
        if moved is None:
            return step
        return dataclasses.replace(step, seconds=step.seconds + moved.seconds, migration=moved.seconds,
                                   notes=[*step.notes, _migration_note(moved)])

    def _moved(self, m: Measured) -> Migration | None:
        """The managed pages a measured plan's step migrates (None: none)."""
        if not m.managed_bytes:
            return None
        allocator = m.used_bytes if m.used_bytes is not None else m.used_lower
        moved = self.book.budget.migration(allocator, m.managed_bytes)
        return moved if moved.seconds else None

    # -- estimates -----------------------------------------------------------------------------
    #
    # NOTE [ Estimates from the nearest measured plan ]
    # Values do not always combine multiplicatively (bitsandbytes' 8-bit AdamW is fast alone and so is
    # state offload alone, but together the 8-bit update runs on the host, several times the estimate).
    # So once plans are measured, a plan's time is estimated from each measured plan whose values are part
    # of its own and in no larger such part: that plan's time times the factors of the values the plan
    # adds (the base's time times all of them where there is none). What a measured plan showed of how its
    # values combine carries to the plans containing it. Where several parts apply the slowest estimate
    # stands: each shows a path the plan runs, and the fastest would let a measured slow combination back
    # in (an estimate that errs high can hide the fastest plan and one that errs low costs a trace; a slow
    # path measured is the better evidence). The walk re-queues the plans whose estimate a measurement
    # changed (memfit.planner.walk). Measured: docs/planner-notes.md.
    def predict(self, plan: Plan) -> float:
        """The plan's measured step time, else its estimate from its nearest measured part."""
        m = self.book.measured.get(plan)
        if m is not None and not m.shallower_only:
            return self.seconds(plan)
        keys = self.technique_keys(plan)
        parts = [(part, self._unpaged(other)) for other, m in list(self.book.measured.items())
                 if not m.shallower_only and (part := self.technique_keys(other)) and part <= keys]
        largest = [(part, seconds) for part, seconds in parts if not any(part < bigger for bigger, _ in parts)]
        if not largest:
            estimate = factor_estimate(self._unpaged(self.base), keys, self.ratios)
        else:
            estimate = max(factor_estimate(seconds, keys - part, self.ratios) for part, seconds in largest)
        return max(estimate, self.cpu_floor(plan), self.update_floor(plan))

    def factor_between(self, plan: Plan, measured: Plan) -> float | None:
        if self.is_estimate(measured) or not self.is_estimate(plan):
            return None
        mine, theirs = self.technique_keys(plan), self.technique_keys(measured)
        return factor_estimate(1.0, mine - theirs, self.ratios) / factor_estimate(1.0, theirs - mine, self.ratios)

    def update_floor(self, plan: Plan) -> float:
        """The host update's floor under ``plan``'s estimate (NOTE [ The host's update under an estimate ] in
        memfit.planner.cpu_floor): 0 where no measured plan updates on the host as it does."""
        if not updates_on_host(plan):
            return 0.0
        signature = update_signature(plan)
        workers = [step.worker for other, m in list(self.book.measured.items())  # (an equal signature updates on the host too)
                   if not m.shallower_only and update_signature(other) == signature and (step := self.step(other))]
        return FLOOR_SHARE * max(workers, default=0.0)

    def cpu_floor(self, plan: Plan) -> float:
        """What the CPU at least spends issuing ``plan``'s step, from its precision's step and each
        other value's extra alone (NOTE [ The CPU's floor under an estimate ]); 0 where there is no
        floor (compiled, sharded, the update on the host) or its parts are not measured."""
        if self.book.world > 1 or not plan.config("compile").is_default or updates_on_host(plan):
            return 0.0
        keys = self.technique_keys(plan)
        ref = self.baseline.precision_alone(plan.precision)
        n = plan.micro_batches(self.target.batch_size)[1]
        extras = [(key, *self.cpu_extra[key]) for key in keys if key[0] != "precision" and key in self.cpu_extra]
        step = self.step(ref) if ref is not None else None
        if step is None or (n == 1 and not extras):
            return 0.0
        if n > 1 and ref not in self._forward_backward_cpu:  # (measured before the walk, or no floor: no trace here)
            return 0.0
        return cpu_floor(step.cpu_seconds, self._forward_backward_cpu.get(ref, 0.0), n, extras)

    def _micro_seconds(self, micro: int) -> float:
        """The base split into micro-batches of ``micro``, estimated without a trace from the base's
        ops: forward and backward once per micro-batch, each op doing ``micro / batch`` of its work
        (optimistic: the weights are read by every micro-batch), the rest once."""
        ops = self.book.ops_of(self.base)
        n = self.book.rank_batch // micro
        first, last = forward_backward_span(ops)
        part = [op._replace(flops=op.flops / n, nbytes=op.nbytes // n) for op in ops[first:last + 1]]
        return time_from_ops(ops[:first] + part * n + ops[last + 1:], self.target.with_plan(self.base),
                             self.k).seconds

    def _forward_backward(self, plan: Plan) -> float:
        """CPU seconds issuing a measured plan's forward and backward (once per micro-batch)."""
        ops = self.book.ops_of(plan)
        first, last = forward_backward_span(ops)
        return time_from_ops(ops[first:last + 1], self.target.with_plan(plan), self.k).cpu_seconds

    def technique_keys(self, plan: Plan) -> frozenset:
        return self.baseline.technique_keys(plan)

    # -- what the planner asks of every time model ---------------------------------------------
    def newly_measured(self) -> list[Plan]:
        return self.book.newly_measured()

    def estimate_depends_on(self, plan: Plan, measured: list[Plan]) -> bool:
        keys = self.technique_keys(plan)
        return any(self.technique_keys(m) <= keys for m in measured) or updates_on_host(plan) and any(
            update_signature(m) == update_signature(plan) for m in measured)

    def is_estimate(self, plan: Plan) -> bool:
        return not self.book.is_measured(plan)

    def step_notes(self, plan: Plan) -> list[str]:
        """The measured step's migration (NOTE [ Migration in estimates ]) and, where the host's update
        sets its pace on a host nobody measured, that (NOTE [ A step the host sets ]); nothing for an estimate."""
        m = self.book.measured.get(plan)
        if m is None or m.shallower_only:
            return []
        moved = self._moved(m)
        step = self.step(plan)
        notes = [_migration_note(moved)] if moved is not None else []
        return notes + ([_host_note(step, self.host)] if step and _host_sets_pace(step, self.host) else [])

    def warmup(self, plan: Plan) -> float:
        """One-time compile seconds before the first step, from the compiled graph's size."""
        configs = [c for c in plan.techniques if not c.is_default]
        if not any(c.warms_up for c in configs):
            return 0.0
        m = self.book.measured.get(plan) or self.book.measured.get(self.base)
        return sum(c.warmup_seconds(m.graph, plan) for c in configs) if m else 0.0

    def describe(self) -> str:
        book = self.book
        depth = book.stacks.describe() if book.stacks else ""
        least, t = (book.stacks.least, "t = " if book.stacks.kinds else "") if book.stacks else (2, "")
        shallow = (f"; plans measured by shallow traces at {t}{least} and {least + 1} of {depth} (deeper where a plan repeats every few "
                   "blocks: checkpointing every 2, a share of the blocks offloaded or swapped), their ops extrapolated, "
                   "the chosen one confirmed by its allocations deepened to a third depth, or by a full trace") if book.depths(self.base or Plan()) else ""
        host = f", host {self.host.name}" if self.host is not None else ""
        return (f"op-level: each plan's own ops on the {self.target.device.name} preset{host}, constants fitted on H100 "
                f"recordings{shallow}; {book.traces} traces ({book.full_traces} at full depth, "
                f"{book.workers.count} processes) in {book.seconds_spent:.1f} s")


# NOTE [ A step the host sets ]
# A step whose optimizer updates on the host lasts at least the host's update (StepTime.worker), which
# the host's memory bandwidth sets, not the card. The hosts behind cards differ (NOTE [ One kind of
# machine, several hosts ] in memfit.hosts): memfit's 24 GB plan for an 8B model ran 1.45x its
# prediction on the 2026-12-04 H200 machine, where torchtune's recipe (states paged on the card) ran
# 1.49x faster than it. So where the update is at least HOST_SHARE of a plan's step and the host is a
# preset rather than this machine measured or one the user named by a multiple, the report says so.
HOST_SHARE = 0.5


def _host_sets_pace(step: StepTime, host) -> bool:
    from memfit.hosts import HOSTS
    return step.worker >= HOST_SHARE * step.seconds and (host is None or host.name in HOSTS)


def _host_note(step: StepTime, host) -> str:
    name = host.name if host is not None else "h100-box"
    return (f"the host's optimizer update sets this step's pace ({step.worker * 1e3:.0f} of {step.seconds * 1e3:.0f} ms), "
            f"priced for the {name} host's memory bandwidth, not measured on the machine that trains; on the "
            "2026-12-04 H200 machine such a step ran 1.45x its prediction: plan on that machine (--device cuda) to "
            "measure it, or name it (--host)")


def _migration_note(moved: Migration) -> str:
    return (f"{moved.in_bytes / 2**30:.2f} GiB of paged optimizer states migrate in and out over the host link each "
            f"step ({moved.short_bytes / 2**30:.2f} GiB more than the budget leaves them): {moved.seconds * 1e3:.0f} ms")
