"""The evidence ladder: the evaluators the search climbs to learn what a plan needs.

Each rung is an :class:`Evaluator`: a plan in, frozen :class:`~memfit.planner.candidate.Evidence`
out (bytes, time, fidelity), or None where the rung has nothing to say about that plan. Cheap
rungs rule plans out; only the top rung (a full fake trace of the plan's own step, what
``memfit estimate`` reports) lets one be chosen. The search (memfit.planner.walk) is the same
for every ladder; which rungs exist is the time model's business:

- **CPU** (:class:`Ladder`): one rung, :class:`FakeTrace`. Times come from real runs of each
  technique value (memfit.planner.cost's ``MeasuredRun``), final before the walk starts.
- **GPU presets** (:class:`GpuLadder`, over memfit.planner.gpu_time's model): ``Estimate`` (the
  default's footprint plus each value's saving alone; no trace), ``ShallowTrace`` (a 2- and
  3-block trace pair extrapolated: an allocated lower bound, and the plan's own time),
  ``DeepStream`` (the pair's allocations replayed at full depth: the reserved bytes,
  memfit.memory.deep_stream), ``FullTrace`` (confirms the plan chosen).

A rung rules a plan out when its figure is over the budget by more than its fidelity's margin
(:meth:`~memfit.planner.candidate.Fidelity.over`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate_target
from memfit.planner.candidate import Evidence, Fidelity
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target

if TYPE_CHECKING:
    from memfit.planner.gpu_time import GpuStepModel, Measured


class Evaluator(Protocol):
    fidelity: Fidelity

    def evaluate(self, plan: Plan) -> Evidence | None:
        """What this rung finds about ``plan`` (None: nothing here); raises UserError when the
        plan does not suit the workload."""


class FakeTrace:
    """A full fake-tensor trace of the plan's own step (the CPU's only rung)."""

    fidelity = Fidelity.FULL

    def __init__(self, target: Target, budget: Budget) -> None:
        self.target, self.budget = target, budget
        self.found: dict[Plan, Evidence] = {}
        self.traces = 0

    def evaluate(self, plan: Plan) -> Evidence:
        self.traces += 1
        with silenced_warnings():
            report = estimate_target(self.target.with_plan(plan))
        evidence = Evidence(Fidelity.FULL, used_bytes=self.budget.used_bytes(report), peak_bytes=report.peak_bytes)
        self.found[plan] = evidence
        return evidence


class Ladder:
    """The rungs of one search, and what they found so far. This base is the CPU's: a full trace
    is the first rung and the last, with no estimate and no deep stream."""

    estimate: Evaluator | None = None
    deep: Evaluator | None = None
    spare_workers = 0
    """Workers idle while the top rung runs (they run the next plans' top rungs alongside)."""

    def __init__(self, full: FakeTrace) -> None:
        self.first = self.full = full

    @property
    def traces(self) -> int:
        return self.full.traces

    def evidence(self, plan: Plan) -> Evidence | None:
        """The best evidence about ``plan`` so far."""
        return self.full.found.get(plan)

    def full_evidence(self) -> list[tuple[Plan, Evidence]]:
        return list(self.full.found.items())

    def has_evidence(self, plan: Plan) -> bool:
        return self.evidence(plan) is not None

    def is_final(self, plan: Plan) -> bool:
        """The plan's figures come from the top rung (it may be chosen)."""
        evidence = self.evidence(plan)
        return evidence is not None and evidence.fidelity is Fidelity.FULL

    def has_full_trace(self, plan: Plan) -> bool:
        """A full trace of ``plan`` ran (or failed), so the top rung is at hand."""
        return plan in self.full.found

    def traced(self, plan: Plan) -> bool:
        """The first rung's traces of ``plan`` ran (or failed): measuring it costs no trace."""
        return self.has_evidence(plan)

    def prefetch(self, plans: list[Plan]) -> None:
        """Run the top rung of ``plans`` together (spare workers)."""

    def queue(self, plans: list[Plan]) -> None:
        """Queue the first trace of ``plans``' first rung in the background, in place of what was
        queued before: idle workers run it, a later measure takes it (NOTE [ The next round's traces
        in the background ] in memfit.planner.walk)."""

    def measure_together(self, plans: list[Plan], skip_over: bool = False) -> None:
        """Run the first rung of ``plans`` together (on the workers at once; evaluate then reads it);
        ``skip_over``: a plan that its first trace shows over the budget is not traced further (its
        evidence: that trace's lower bound)."""

    def full_and_deep(self) -> list[tuple[int, int]]:
        """(full trace's, deep stream's) bytes of every plan that has both: the check of the deep
        rung against the top one."""
        if self.deep is None:
            return []
        pairs = []
        for plan, evidence in self.full_evidence():
            deep = self.deep.evaluate(plan)
            if deep is not None:
                pairs.append((evidence.used_bytes, deep.used_bytes))
        return pairs


# -- the GPU presets' rungs, over memfit.planner.gpu_time.GpuStepModel ------------------------------
def _of(m: Measured) -> Evidence:
    if m.full:
        return Evidence(Fidelity.FULL, used_bytes=m.used_bytes, peak_bytes=m.peak_bytes, seconds=m.seconds)
    return Evidence(Fidelity.LOWER_BOUND, used_bytes=m.used_lower, peak_bytes=m.peak_bytes, seconds=m.seconds)


class Estimate:
    fidelity = Fidelity.ESTIMATE

    def __init__(self, model: GpuStepModel) -> None:
        self.model = model

    def evaluate(self, plan: Plan) -> Evidence | None:
        if self.model.is_measured(plan):
            return None
        return Evidence(Fidelity.ESTIMATE, used_bytes=self.model.estimated_used(plan))

    def free(self, plan: Plan) -> bool:
        """The estimate needs no trace (a micro-batch size's saving is traced when first asked for)."""
        return self.model.can_estimate_used(plan)


class ShallowTrace:
    """A shallow trace pair (full depth when the model is shallow, or a shallow trace failed)."""

    fidelity = Fidelity.LOWER_BOUND

    def __init__(self, model: GpuStepModel) -> None:
        self.model = model

    def evaluate(self, plan: Plan) -> Evidence:
        return _of(self.model.measure(plan))


class DeepStream:
    fidelity = Fidelity.DEEP

    def __init__(self, model: GpuStepModel) -> None:
        self.model = model

    def evaluate(self, plan: Plan) -> Evidence | None:
        used = self.model.deep_used(plan)
        return None if used is None else Evidence(Fidelity.DEEP, used_bytes=used)


class FullTrace:
    fidelity = Fidelity.FULL

    def __init__(self, model: GpuStepModel) -> None:
        self.model = model

    def evaluate(self, plan: Plan) -> Evidence:
        return _of(self.model.confirm(plan))


class GpuLadder(Ladder):
    """Estimate, shallow trace, deep stream, full trace (the module docstring)."""

    def __init__(self, model: GpuStepModel) -> None:
        self.model = model
        self.estimate, self.first, self.deep, self.full = Estimate(model), ShallowTrace(model), DeepStream(model), \
            FullTrace(model)
        self.spare_workers = model.workers.count - 1

    @property
    def traces(self) -> int:
        return self.model.traces

    def evidence(self, plan: Plan) -> Evidence | None:
        m = self.model.measured.get(plan)
        return None if m is None else _of(m)

    def full_evidence(self) -> list[tuple[Plan, Evidence]]:
        return [(p, _of(m)) for p, m in list(self.model.measured.items()) if m.full]

    def has_full_trace(self, plan: Plan) -> bool:
        return self.model.has_full_trace(plan)

    def traced(self, plan: Plan) -> bool:
        return self.model.is_measured(plan) or self.model.has_shallow_traces(plan)

    def prefetch(self, plans: list[Plan]) -> None:
        with silenced_warnings():
            self.model.trace_full(plans)

    def queue(self, plans: list[Plan]) -> None:
        self.model.queue_shallowest(plans)

    def measure_together(self, plans: list[Plan], skip_over: bool = False) -> None:
        if plans:
            self.model.trace_shallow(plans, skip_over=skip_over)
