"""plan(): the fastest plan that fits, found on predictions.

1. Enumerate the valid plans of the search space (memfit.planner.space).
2. Predict every plan's step time: on the CPU by short real steps (memfit.planner.cost, final);
   on GPU presets by the ops of each plan's own step (memfit.planner.gpu_time: estimated from each
   technique value alone, then measured by shallow traces for the plans the walk visits). Compile
   time is shown beside it, and counted per step when the run's length is given (``steps``: step +
   compile / steps), so a short run can prefer an eager plan.
3. Walk the plans fastest first (:class:`_Walk`); predict the memory of each with a fake-tensor
   trace of the real TrainStep (on GPU presets: a shallow lower bound first, a full trace, as
   ``estimate`` runs it, for the plan chosen). The first that fits is the answer, and its reason
   names the faster plans it beat on memory and the next ones it beat on time.
4. Prune without tracing: a plan that saves no more memory in any dimension than a plan that
   already did not fit cannot fit either (techniques are assumed not to *add* memory). The
   maximal plans (none saves less than another everywhere) are traced first: when none of them
   fits, nothing does, and the smallest of their footprints is the budget to ask for.

Budget: ``--budget 20GiB``, ``--budget 80%`` of the device, or when omitted the device's capacity
minus headroom (10%); what counts against it is :class:`~memfit.memory.budget.Budget`'s: on a GPU
preset the caching allocator's *reserved* bytes plus the CUDA context; for the CPU, device and
host bytes together (one memory).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.devices import Device, available_host_bytes
from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate_target
from memfit.planner import cost
from memfit.planner.gpu_time import DEEP_MARGIN, GpuStepModel
from memfit.planner.space import candidates, default_space, drop_unused, model_facts, saves_no_more_than
from memfit.plans import Plan, technique_of
from memfit.quiet import silenced_warnings
from memfit.step import build_step
from memfit.target import Target
from memfit.units import fmt_bytes
from memfit.workload import Workload

WALK_BEFORE_FEASIBILITY = 8
"""Traces of the fastest plans before checking that any plan fits at all."""


@dataclass
class Candidate:
    plan: Plan
    seconds: float
    """Predicted seconds per step, what plans are ranked by: the steady step, plus compile time
    spread over the run when its length is given."""
    step_seconds: float | None = None
    """Predicted steady step time (None: ``seconds``)."""
    compile_seconds: float = 0.0
    """One-time compile seconds before the first step: measured (calibrated) or predicted from the compiled graph size (GPU presets)."""
    status: str = "not evaluated"
    """chosen | too big | pruned | slower | not evaluated"""
    reason: str = ""
    used_bytes: int | None = None
    """What the budget holds: reserved + context (GPU) or device + host (CPU)."""
    peak_bytes: int | None = None


@dataclass
class PlanResult:
    workload: str
    device: str
    batch_size: int
    budget_bytes: int
    time_model: str
    chosen: Candidate | None
    candidates: list[Candidate] = field(default_factory=list)
    traces: int = 0
    seconds: float = 0.0
    smallest: Candidate | None = None
    """When nothing fits: the plan with the smallest footprint found, and its footprint."""
    run_steps: int | None = None
    """The run's length compile time was spread over (None: not counted)."""
    notes: list[str] = field(default_factory=list)
    """Techniques left out of the search here, and why."""

    def to_json(self) -> dict:
        def row(c: Candidate) -> dict:
            return {"plan": c.plan.to_dict(), "predicted_step_seconds": c.seconds,
                    "steady_step_seconds": c.step_seconds if c.step_seconds is not None else c.seconds,
                    "compile_seconds": c.compile_seconds, "status": c.status,
                    "reason": c.reason, "used_bytes": c.used_bytes, "peak_bytes": c.peak_bytes}
        evaluated = [c for c in self.candidates if c.status != "not evaluated"]
        return {"workload": self.workload, "device": self.device, "batch_size": self.batch_size,
                "budget_bytes": self.budget_bytes, "time_model": self.time_model, "run_steps": self.run_steps,
                "chosen": row(self.chosen) if self.chosen else None, "traces": self.traces,
                "planning_seconds": self.seconds, "candidates_total": len(self.candidates),
                "smallest": row(self.smallest) if self.smallest else None, "notes": self.notes,
                "ranked": [row(c) for c in evaluated[:50]]}


def resolve_budget(budget: str | int | None, device: Device) -> int:
    """The budget in bytes (see :meth:`memfit.memory.budget.Budget.resolve`)."""
    return Budget.resolve(budget, device).bytes


def plan(workload: Workload | str, *, budget: str | int | None = None, device: str | Device = "cpu",
         batch_size: int | None = None, seq_len: int | None = None,
         optimizers: tuple[str, ...] = ("adamw", "adamw8bit"), max_traces: int = 60,
         time_model: cost.TimeModel | None = None, space=None, fixed: dict | None = None,
         compile_modes: tuple[str, ...] | None = None, steps: int | None = None) -> PlanResult:
    """The fastest plan for ``workload`` whose predicted memory fits ``budget`` on ``device``.

    ``fixed``: plan fields the user set (``--precision bf16``); the search covers the others.
    ``compile_modes``: the compile modes to search (None: the device's default, ``none`` for now;
    memfit.techniques.compile says why). ``steps``: the run's
    length; compile time then counts as compile seconds / steps per step (None: a long run).
    """
    t0 = time.perf_counter()
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise UserError(f"plan: steps must be a whole number >= 1 (the run's length), got {steps!r}")
    target = Target.resolve(workload, None, batch_size, device, seq_len=seq_len)
    wl, dev, bs = target.workload, target.device, target.batch_size
    budget_obj = Budget.resolve(budget, dev)
    budget_bytes = budget_obj.bytes
    facts = model_facts(wl)
    world = int((fixed or {}).get("world_size") or 1)
    if world > 1 and not dev.is_gpu:
        raise UserError(f"plan --world-size {world} times sharded plans on GPU presets (on the CPU the planner times "
                        "real steps, which a sharded plan runs in several processes); give --device, e.g. h100-80gb")
    _check_budget_above_weights(budget_bytes, facts, dev, world)
    if not dev.is_gpu and time_model is None:
        _check_real_steps_fit(wl, facts)
    rank_bs = Plan(world_size=world).config("shard").rank_batch(bs)  # (a sharded rank's micro-batches split this)
    space = space or default_space(facts, dev, rank_bs, optimizers, compile_modes)
    fixed, constrained = _constrain(space, dict(fixed or {}), dev, rank_bs)
    _check_suits(target, constrained)
    for m in space.micro_batches:
        Plan(micro_batch_size=m if m != rank_bs else None).micro_batches(rank_bs)
    plans = candidates(space, rank_bs)
    if fixed:  # fields outside the search space (ema, bf16_update, ...) apply to every candidate
        kept = []
        for p in plans:
            try:
                kept.append(p.replace(**fixed))
            except UserError:
                continue
        plans = kept
    if not plans:
        raise UserError("plan: no valid plan is left with the fields you fixed; remove some of the plan flags")
    drop_unused(space, plans)
    with silenced_warnings():
        if time_model is not None:
            model = time_model
        elif dev.is_gpu:
            model = GpuStepModel(target, space, facts, budget_obj, fixed=fixed)
        else:
            model = cost.calibrate(target, space)
    try:
        return _search(t0, target, budget_obj, space, plans, constrained, model, steps, max_traces)
    finally:
        if isinstance(model, GpuStepModel):
            model.close()


def _search(t0: float, target: Target, budget_obj: Budget, space, plans: list[Plan], constrained: dict, model,
            steps: int | None, max_traces: int) -> PlanResult:
    wl, dev, bs, budget_bytes = target.workload, target.device, target.batch_size, budget_obj.bytes
    if isinstance(model, GpuStepModel):
        with silenced_warnings():
            model.prepare()
    for name, value in constrained.items():
        if not space.values[name]:  # the time model's runs found that the value does not suit the workload
            why = next((x.split(": ", 1)[-1] for x in model.excluded if x.startswith(f"{name}=")), "")
            raise _unsuited(wl, name, value, why)
    plans = [p for p in plans if all(getattr(p, n) in v for n, v in space.values.items())]  # after exclusions
    ranked = [Candidate(p, 0.0) for p in plans]
    for c in ranked:
        _retime(c, model, steps)
    walk = _Walk(target, budget_obj, model, steps, max_traces)
    chosen = walk.run(ranked)
    if chosen is None and not any(c.used_bytes is not None for c in ranked):
        invalid = next((c for c in ranked if c.status == "invalid"), None)
        reason = invalid.reason.removeprefix("plan: ") if invalid else "no candidate plan is left"
        raise UserError(f"plan: no candidate plan can run {wl.name}: {reason}")
    ranked.sort(key=lambda c: c.seconds)
    if chosen is not None:
        for c in ranked:
            if c.status == "not evaluated" and c is not chosen:
                c.status, c.reason = "slower", f"{c.seconds / chosen.seconds:.2f}x the chosen plan's time" + \
                    ("" if not walk.gpu or walk.measured(c) else " (estimated)")
        chosen.reason = _why_chosen(chosen, ranked, bs)
    result = PlanResult(workload=wl.name, device=dev.name, batch_size=bs, budget_bytes=budget_bytes,
                        time_model=model.describe(), chosen=chosen, candidates=ranked, traces=walk.traces,
                        run_steps=steps, notes=[*space.notes, *(f"{x} (left out)" for x in model.excluded), *walk.notes])
    if chosen is None:  # nothing fits (or the trace limit came first): the smallest footprint seen
        result.smallest = walk.smallest(ranked)
        if result.smallest is not None and result.smallest.used_bytes <= budget_bytes:  # a lower bound erred high
            chosen = result.chosen = result.smallest
            chosen.status, chosen.reason = "chosen", "the smallest plan found, confirmed to fit by a full trace"
        for c in ranked:
            if c.status == "not evaluated" and c.used_bytes is None:
                c.reason = c.reason or "nothing fits: a plan saving at least as much did not fit"
    result.seconds = time.perf_counter() - t0
    return result


def _retime(c: Candidate, model, steps: int | None) -> None:
    c.seconds, c.step_seconds, c.compile_seconds = model.per_step(c.plan, steps), model.predict(c.plan), \
        model.warmup(c.plan)


class _Walk:
    """Walk the candidates fastest first (a priority queue on predicted time) until one fits.

    With the calibrated model (CPU) every time is final, and each visited plan is traced once for
    its memory. With the GPU-preset model (memfit.planner.gpu_time) a visited plan is first
    *measured* (shallow traces: its own step time and a lower bound of its memory): too big, it
    is out; slower than its estimate, it goes back into the queue at its measured time. A plan that
    comes out fastest with a fitting lower bound is *confirmed* by one full trace before it is
    chosen. Pruning: a plan that saves no more memory than one that did not fit cannot fit."""

    def __init__(self, target: Target, budget: Budget, model, steps: int | None, max_traces: int) -> None:
        self.target, self.budget, self.model, self.steps, self.max_traces = target, budget, model, steps, max_traces
        self.gpu = isinstance(model, GpuStepModel)
        self.failed: list[Candidate] = []
        self.evaluated = 0
        self.maximal: list[Candidate] | None = None
        self.limited = False
        """The trace limit left a faster plan untraced."""
        self.trust_deep = True
        self.deep_rejected: list[Candidate] = []
        """Plans ruled out by :meth:`_too_big_deep` (checked against the chosen plan's full trace)."""
        self.notes: list[str] = []

    @property
    def traces(self) -> int:
        return self.model.traces if self.gpu else self.evaluated

    def measured(self, c: Candidate) -> bool:
        return self.model.is_measured(c.plan) if self.gpu else c.used_bytes is not None

    def run(self, ranked: list[Candidate]) -> Candidate | None:
        bs = self.target.batch_size
        heap = [(c.seconds, i, c) for i, c in enumerate(ranked)]
        heapq.heapify(heap)
        self.order = {id(c): i for i, c in enumerate(ranked)}
        while True:
            chosen = self._walk(heap, ranked, bs)
            if chosen is None and self.deep_rejected and self.trust_deep and not self.limited:  # (_deep_agrees)
                self.notes.append(f"nothing fitted after {len(self.deep_rejected)} plans were ruled out by their "
                                  "reserved bytes at full depth from shallow traces: they were traced instead")
                self._distrust_deep(heap, ranked, None)
                continue
            if chosen is not None or self.limited or self.maximal is not None:
                return chosen
            # Nothing fitted and the maximal plans were never traced (the estimates spared their
            # traces): trace them now, ignoring the estimates, and walk again if any may fit.
            if not self._check_feasible(heap, ranked, bs):
                return None

    def _walk(self, heap: list, ranked: list[Candidate], bs: int) -> Candidate | None:
        while heap:
            _, _, c = heapq.heappop(heap)
            if c.status != "not evaluated":
                continue
            if any(saves_no_more_than(c.plan, f.plan, bs) for f in self.failed):
                c.status, c.reason = "pruned", "saves no more memory than a plan that did not fit"
                continue
            if self.evaluated >= self.max_traces and not self.measured(c):
                # a faster plan left untraced: no choice can be called the fastest that fits
                for _, _, x in [(None, None, c), *heap]:
                    if x.status == "not evaluated":
                        x.reason = f"trace limit ({self.max_traces}) reached"
                heap.clear()
                self.limited = True
                return None
            if self.maximal is None and self.evaluated >= WALK_BEFORE_FEASIBILITY:
                if not self._check_feasible(heap, ranked, bs):
                    return None
                if c.status != "not evaluated" or any(saves_no_more_than(c.plan, f.plan, bs) for f in self.failed):
                    if c.status == "not evaluated":
                        c.status, c.reason = "pruned", "saves no more memory than a plan that did not fit"
                    continue
                if self.measured(c) and heap and c.seconds > heap[0][0]:
                    heapq.heappush(heap, (c.seconds, self.order[id(c)], c))
                    continue
            if c.used_bytes is None and self.gpu and self.model.likely_too_big(c.plan):
                c.status, c.reason = "too big", (f"estimated to need {fmt_bytes(self.model.estimated_used(c.plan))} "
                                                 f"> budget {fmt_bytes(self.budget.bytes)} (not traced)")
                continue
            if c.used_bytes is None and not self._measure(c):
                continue
            if c.status != "not evaluated":  # too big
                continue
            if self.gpu and not self.model.is_confirmed(c.plan):
                if heap and c.seconds > heap[0][0]:  # slower than measured: back in the queue at its time
                    heapq.heappush(heap, (c.seconds, self.order[id(c)], c))
                    continue
                if self._too_big_deep(c):
                    continue
                self._confirm_ahead(c, heap)
                if not self._confirm(c) or c.status == "too big":
                    continue
                if heap and c.seconds > heap[0][0]:
                    heapq.heappush(heap, (c.seconds, self.order[id(c)], c))
                    continue
            if not self._deep_agrees(c):  # then the plans it ruled out are traced
                self._distrust_deep(heap, ranked, c)
                continue
            c.status = "chosen"
            return c
        return None

    def _deep_agrees(self, c: Candidate) -> bool:
        """The check of the reserved bytes at full depth from shallow traces (:meth:`_too_big_deep`),
        when they ruled out a plan, against the full traces at hand (the chosen plan's, and those
        run alongside it): each within ``DEEP_MARGIN``, and at least one to check (else the plans
        they ruled out are traced)."""
        if not self.gpu or not self.deep_rejected or not self.trust_deep:
            return True
        checked = [(m.used_bytes, self.model.deep_used(p)) for p, m in list(self.model.measured.items()) if m.full]
        checked = [(full, deep) for full, deep in checked if deep is not None]
        missed = [(full, deep) for full, deep in checked if abs(deep - full) > DEEP_MARGIN * full]
        if checked and not missed:
            return True
        why = (f"missed a full trace ({fmt_bytes(missed[0][0])}) by more than {DEEP_MARGIN:.1%} "
               f"({fmt_bytes(missed[0][1])})") if missed else "had no full trace to be checked against"
        self.notes.append(f"reserved bytes at full depth from the shallow traces' allocations {why}: the "
                          f"{len(self.deep_rejected)} plans they ruled out were traced instead")
        return False

    def _distrust_deep(self, heap: list, ranked: list[Candidate], c: Candidate | None) -> None:
        """Put the plans ruled out by :meth:`_too_big_deep` back into the queue (and those pruned,
        which may have been pruned for them), with ``c``, and walk on without it."""
        self.trust_deep = False
        for x in [*self.deep_rejected, *(x for x in ranked if x.status == "pruned"), *([c] if c else [])]:
            if x in self.failed:
                self.failed.remove(x)
            if x is not c:
                x.status, x.reason = "not evaluated", ""
                m = self.model.measured.get(x.plan)
                x.used_bytes = None if m is None else m.used_bytes if m.full else m.used_lower
            heapq.heappush(heap, (x.seconds, self.order[id(x)], x))
        self.deep_rejected.clear()

    def _check_feasible(self, heap: list, ranked: list[Candidate], bs: int) -> bool:
        """Trace the maximal plans (none saves less than another everywhere: they dominate every
        plan). False if none of them fits (then nothing does); else they go back into the queue at
        their measured times."""
        self.maximal = _maximal(sorted(ranked, key=lambda x: x.seconds), bs)
        for m in self.maximal:
            if m.used_bytes is None:
                m.status, m.reason = "not evaluated", ""  # (an estimate may have called it too big)
                self._measure(m)
        tops = [m for m in self.maximal if m.used_bytes is not None]
        if tops and all(m.status == "too big" for m in tops):
            return False
        for m in self.maximal:
            if m.status == "not evaluated":
                heapq.heappush(heap, (m.seconds, self.order[id(m)], m))
        return True

    def _measure(self, c: Candidate) -> bool:
        """Trace ``c`` (GPU presets: measure it, unless the time model did); False (status "invalid")
        if it does not suit the workload."""
        if not self.gpu:
            self.evaluated += 1
            if not _evaluate(c, self.target, self.budget):
                return False
            if c.used_bytes > self.budget.bytes:
                self._too_big(c)
            return True
        self.evaluated += not self.measured(c)
        return self._take(c, self.model.measure)

    def _confirm(self, c: Candidate) -> bool:
        """The full trace of ``c``; False (status "invalid") if it fails there (a compile limit, the
        workload's code at full depth)."""
        return self._take(c, self.model.confirm)

    def _confirm_ahead(self, c: Candidate, heap: list) -> None:
        """Run ``c``'s full trace alongside those of the next plans that may come up for confirming
        (measured, their lower bound fits), on the workers that would otherwise wait: when ``c``'s
        reserved bytes do not fit, the next one's are ready."""
        spare = self.model.workers.count - 1
        if spare <= 0 or self.model.has_full_trace(c.plan):  # (nothing to run alongside)
            return
        ahead: dict[Plan, None] = {}
        for _, _, x in heapq.nsmallest(len(heap), heap):
            if len(ahead) == spare:
                break
            if x is not c and x.status == "not evaluated" and self.model.is_measured(x.plan) \
                    and not self.model.is_confirmed(x.plan) and not self.model.has_full_trace(x.plan) \
                    and x.used_bytes is not None and x.used_bytes <= self.budget.bytes and not self._too_big_deep(x):
                ahead[x.plan] = None
        with silenced_warnings():
            self.model.trace_full([c.plan, *ahead])

    def _too_big_deep(self, c: Candidate) -> bool:
        """A measured plan whose lower bound fits, ruled out without its full trace: its reserved
        bytes from the shallow traces' allocations at full depth are over the budget (by more than
        ``DEEP_MARGIN``)."""
        if not self.trust_deep or self.model.has_full_trace(c.plan):  # (the full trace decides)
            return False
        used = self.model.deep_used(c.plan)
        if used is None or used <= self.budget.bytes * (1 + DEEP_MARGIN):
            return False
        c.used_bytes = used
        self._too_big(c, how="reserved, from its shallow traces' allocations replayed at full depth")
        self.deep_rejected.append(c)
        return True

    def _take(self, c: Candidate, trace) -> bool:
        """``c``'s figures from ``trace`` (the GPU model's measure or confirm): its time, and its
        footprint (a lower bound until confirmed); False (status "invalid") if the plan fails."""
        try:
            with silenced_warnings():
                m = trace(c.plan)
        except UserError as e:
            c.status, c.reason = "invalid", str(e)
            return False
        _retime(c, self.model, self.steps)
        c.peak_bytes = m.peak_bytes
        c.used_bytes = m.used_bytes if m.used_bytes is not None else m.used_lower
        if c.used_bytes > self.budget.bytes if m.full else m.used_lower > self.budget.bytes:
            self._too_big(c, at_least=not m.full)
        return True

    def _too_big(self, c: Candidate, at_least: bool = False, how: str = "") -> None:
        need = f"at least {fmt_bytes(c.used_bytes)} (allocated)" if at_least else fmt_bytes(c.used_bytes)
        c.status, c.reason = "too big", f"needs {need}{f' ({how})' if how else ''} > budget {fmt_bytes(self.budget.bytes)}"
        self.failed.append(c)

    def smallest(self, ranked: list[Candidate]) -> Candidate | None:
        """The traced plan with the smallest footprint (GPU presets: confirmed by a full trace)."""
        traced = [c for c in ranked if c.used_bytes is not None and c.status != "invalid"]
        if not traced:
            return None
        for best in sorted(traced, key=lambda c: c.used_bytes):
            if not self.gpu or self.model.is_confirmed(best.plan):
                return best
            if self._confirm(best):
                return best
        return None


def _why_chosen(chosen: Candidate, ranked: list[Candidate], bs: int) -> str:
    """The alternatives the chosen plan beat and by how much: the faster plans that did not fit, the
    next fastest after it."""
    faster = [c for c in ranked if c.status == "too big" and c.seconds < chosen.seconds]
    slower = [c for c in ranked if c.status == "slower"][:2]
    parts = ["fastest predicted plan that fits"]
    traced = [c for c in faster if c.used_bytes is not None]
    if traced:
        best = traced[0]
        parts.append(f"{len(faster)} faster plan{'s' if len(faster) > 1 else ''} did not fit (fastest: "
                     f"{best.plan.short(bs)}, {best.seconds / chosen.seconds:.2f}x its time, "
                     f"{fmt_bytes(best.used_bytes)})")
    if slower:
        parts.append("next: " + ", ".join(f"{c.plan.short(bs)} {c.seconds / chosen.seconds:.2f}x" for c in slower))
    return "; ".join(parts)


def _constrain(space, fixed: dict, dev: Device, bs: int) -> tuple[dict, dict]:
    """Narrow ``space`` to the plan fields the user fixed. Returns the fields left to apply to every
    candidate (outside the space: ema, bf16_update) and the space dimensions fixed (name -> value).
    A value that leaves a choice to the planner (``Config.choices``) becomes a space dimension.
    Values the planner cannot search with are refused here, before any trace; a value that means
    something per device (``precision: auto``) is resolved for this one."""
    given = Plan().replace(**fixed)
    given.check_implemented()
    for name in list(fixed):
        technique = technique_of(name)
        config = given.config(technique.name).resolve(dev)
        choices = config.choices(dev)
        if len(choices) > 1:  # the user left this choice to the planner (ema: {device: auto})
            del fixed[name]
            space.values[name] = [c.values()[name] for c in choices]
            continue
        fixed.update(choices[0].values())
    split = {k: fixed.pop(k) for k in ("micro_batch_size", "grad_accum_steps") if k in fixed}
    if split:
        micro, _ = Plan(**split).micro_batches(bs)
        space.micro_batches = [micro]
    constrained = {}
    for name in [n for n in fixed if n in space.values]:
        constrained[name] = fixed.pop(name)
        space.values[name] = [constrained[name]]
    return fixed, constrained


def _check_suits(target: Target, constrained: dict) -> None:
    """Build the step (on fake tensors: no memory) with each value the user fixed, so that one that
    does not suit the workload (loss_chunks on a model that is no causal LM, checkpointing without
    repeated blocks) is refused before any candidate is timed or traced."""
    for name, value in constrained.items():
        config = Plan(**{name: value}).config(technique_of(name).name)
        if not config.technique.depends_on_model or config.is_default:
            continue
        try:
            with silenced_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
                build_step(target.with_plan(Plan(**{name: value})))
        except UserError as e:
            raise _unsuited(target.workload, name, value, str(e)) from None


def _unsuited(wl: Workload, name: str, value, why: str) -> UserError:
    return UserError(f"plan: the given {name}={_show_value(value)} does not suit {wl.name}: "
                     f"{why.removeprefix('plan: ')}; remove --{name.replace('_', '-')} to let the planner choose")


def _show_value(value) -> str:
    return "[" + ",".join(value) + "]" if isinstance(value, tuple) else str(value)


def _evaluate(c: Candidate, target: Target, budget: Budget) -> bool:
    """Trace ``c``'s memory; False (and status "invalid") if the plan does not suit the workload."""
    try:
        with silenced_warnings():
            report = estimate_target(target.with_plan(c.plan))
    except UserError as e:
        c.status, c.reason = "invalid", str(e)
        return False
    c.used_bytes, c.peak_bytes = budget.used_bytes(report), report.peak_bytes
    return True


def _maximal(ranked: list[Candidate], bs: int) -> list[Candidate]:
    """Plans that no other plan dominates in memory saving (fastest first). One pass that keeps the
    maximal plans so far (dominance is transitive): O(plans x maximal plans), not O(plans^2)."""
    def dominates(d: Candidate, c: Candidate) -> bool:
        return saves_no_more_than(c.plan, d.plan, bs) and not saves_no_more_than(d.plan, c.plan, bs)
    out: list[Candidate] = []
    for c in ranked:
        if not any(dominates(m, c) for m in out):
            out = [m for m in out if not dominates(c, m)] + [c]
    order = {id(c): i for i, c in enumerate(ranked)}
    return sorted(out, key=lambda c: order[id(c)])


CPU_STATE_BYTES = 16
"""Bytes per parameter of the plain fp32 AdamW step the CPU planner times for real first (weights,
gradients and two moments), before any activation."""


def _check_real_steps_fit(workload, facts) -> None:
    """The CPU planner times real steps, the plain plan's first: refuse, in one line, a model whose
    plain step cannot fit this machine's memory (the OS would kill the process)."""
    need, free = facts.n_params * CPU_STATE_BYTES, available_host_bytes()
    if need > 0.8 * free:
        raise UserError(f"memfit plan on the cpu device times real steps of each technique, the plain fp32 AdamW "
                        f"step first: {workload.name} needs {fmt_bytes(need)} for its weights, gradients and AdamW "
                        f"states alone ({facts.n_params / 1e9:.2f}B parameters), and this machine has "
                        f"{fmt_bytes(free)} free; plan for a GPU preset (e.g. --device h100-80gb; see memfit "
                        "devices), which traces on fake tensors without that memory")


def _check_budget_above_weights(budget: int, facts, dev: Device, world_size: int = 1) -> None:
    min_bytes = facts.n_params * (2 if dev.bf16 or dev.fp16 else 4) // world_size
    if budget < min_bytes:
        share = f", 1/{world_size} of them per rank" if world_size > 1 else ""
        raise UserError(f"budget {fmt_bytes(budget)} is below the model's own parameters ({fmt_bytes(min_bytes)} "
                        f"for {facts.n_params / 1e6:.1f}M parameters in 16 bits{share}); give a budget above that, or "
                        "shard the model over more ranks (--world-size)")
