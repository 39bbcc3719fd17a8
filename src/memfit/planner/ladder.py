"""The evidence ladder: the evaluators the search climbs to learn what a plan needs.

Each rung is an :class:`Evaluator`: a plan in, frozen :class:`~memfit.planner.candidate.Evidence`
out (bytes and fidelity), or None where the rung has nothing to say about that plan. Cheap rungs
rule plans out; only the top rung (a full fake trace of the plan's own step, what ``memfit
estimate`` reports, or on GPU presets the deep stream checked at a third depth: memfit.planner.deep_figures)
lets one be chosen. The search (memfit.planner.walk) is the same for every
ladder; which rungs exist is the device's business (memfit.planner.search builds the ladder beside
the time model):

- **CPU** (:class:`Ladder`): one rung, :class:`FakeTrace`. Times come from real runs of each
  technique value (memfit.planner.cost's ``MeasuredRun``), final before the walk starts.
- **GPU presets** (memfit.planner.gpu_ladder's ``GpuLadder``, over memfit.planner.traces' book):
  an estimate (no trace), a shallow trace pair (an allocated lower bound), the deep stream (the
  pair's allocations replayed at full depth: the reserved bytes) and the full trace.

A rung rules a plan out when its figure is over the budget by more than its fidelity's margin
(:meth:`~memfit.planner.candidate.Fidelity.over`). A :class:`DeepRung` rules plans out short of the
top rung, so it is checked against the top rung before a plan is chosen, and distrusted when it missed.
"""

from __future__ import annotations

from typing import Protocol

from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate_target
from memfit.planner.candidate import Candidate, Evidence, Fidelity
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target
from memfit.units import fmt_bytes


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
        evidence = Evidence(Fidelity.FULL, used_bytes=self.budget.used_bytes(report), peak_bytes=report.peak_bytes,
                            managed_bytes=report.managed_bytes, host_bytes=report.host_peak_bytes)
        self.found[plan] = evidence
        return evidence


class Ladder:
    """The rungs of one search, and what they found so far. This base is the CPU's: a full trace
    is the first rung and the last, with no estimate and no deep stream."""

    estimate: Evaluator | None = None
    deep: DeepRung | None = None
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

    def prefetch(self, plans: list[Plan], behind: list[Plan] = ()) -> None:
        """Run the top rung of ``plans`` together (spare workers); the first rung of the plans ``behind``
        is queued after them, in the background, for a later measure to take."""

    def queue(self, plans: list[Plan]) -> None:
        """Queue the first trace of ``plans``' first rung in the background, in place of what was
        queued before: idle workers run it, a later measure takes it (NOTE [ The next round's traces
        in the background ] in memfit.planner.walk)."""

    def measure_together(self, plans: list[Plan], skip_over: bool = False) -> None:
        """Run the first rung of ``plans`` together (on the workers at once; evaluate then reads it);
        ``skip_over``: a plan that its first trace shows over the budget is not traced further (its
        evidence: that trace's lower bound)."""


class DeepRung:
    """A rung between the first and the top one that rules plans out without their full trace (the
    GPU presets' deep stream), and what it ruled out: it is trusted until a full trace shows it
    missed (NOTE [ Deep stream checked ])."""

    fidelity = Fidelity.DEEP

    def __init__(self) -> None:
        self.trusted = True
        self.rejected: list[Candidate] = []
        """Plans this rung ruled out, not yet confirmed by their full traces."""

    def evaluate(self, plan: Plan) -> Evidence | None:
        raise NotImplementedError

    def rules_out(self, plan: Plan, ladder: Ladder, budget_bytes: int) -> Evidence | None:
        """This rung's evidence that ``plan`` is over the budget (None: it says nothing, is not
        trusted, or the plan's full trace is at hand and decides)."""
        if not self.trusted or ladder.has_full_trace(plan):
            return None
        evidence = self.evaluate(plan)
        return evidence if evidence is not None and evidence.over(budget_bytes) else None

    def checked(self, ladder: Ladder) -> list[tuple[int, int]]:
        """(full trace's, this rung's) bytes of every plan that has both: its check against the top rung."""
        pairs = []
        for plan, evidence in ladder.full_evidence():
            deep = self.evaluate(plan)
            if deep is not None:
                pairs.append((evidence.used_bytes, deep.used_bytes))
        return pairs

    # NOTE [ A full trace for the deep rung's check, alongside ]
    # A plan the deep rung ruled out whose full trace fits is a miss too. And "nothing to check against"
    # is common: the deep stream has no figure for some plans (a free it cannot carry over), so when such
    # a plan comes to be chosen, the plans the rung ruled out would be traced in full after it. So where
    # nothing is at hand to check the rung against, a worker the confirmation leaves idle traces a plan it
    # ruled out, in full: when that one agrees, the rung stands, and it was checked on a plan it ruled
    # out. Measured: docs/planner-notes.md.
    def to_check_alongside(self, ladder: Ladder) -> Plan | None:
        """A plan this rung ruled out, to trace in full beside a confirmation, where nothing is at hand
        to check the rung against (None: something is, or nothing to check)."""
        if self.rejected and self.trusted and not self.checked(ladder) \
                and not any(ladder.has_full_trace(x.plan) for x in self.rejected):
            return self.rejected[0].plan
        return None

    # NOTE [ Deep stream checked ]
    # Plans ruled out by the deep stream (reserved bytes from shallow allocations, not a full trace)
    # are held against every full trace at hand when a plan is about to be chosen: a miss by more than
    # ``Fidelity.DEEP``'s margin, or nothing to check against, puts them back into the queue (with the
    # plans pruned for them) and the walk goes on without trusting that rung.
    def disagreement(self, ladder: Ladder, budget_bytes: int) -> str | None:
        """Why the plans this rung ruled out are to be traced instead (it missed a full trace at hand
        by more than its margin, or had none to be checked against); None: it agrees."""
        if not self.rejected or not self.trusted:
            return None
        fitting = []  # (ruled out, and fits by its full trace)
        for c in self.rejected:  # (traced alongside: NOTE [ A full trace for the deep rung's check, alongside ])
            if ladder.has_full_trace(c.plan):
                try:
                    with silenced_warnings():
                        full = ladder.full.evaluate(c.plan)  # (no new trace)
                except UserError:
                    continue
                if full.used_bytes <= budget_bytes:
                    fitting.append((full.used_bytes, c.used_bytes))
        margin = Fidelity.DEEP.margin
        checked = self.checked(ladder)
        missed = [(full, deep) for full, deep in checked if abs(deep - full) > margin * full] + fitting
        if checked and not missed:
            return None
        why = (f"missed a full trace ({fmt_bytes(missed[0][0])}) by more than {margin:.1%} "
               f"({fmt_bytes(missed[0][1])})") if missed else "had no full trace to be checked against"
        return (f"reserved bytes at full depth from the shallow traces' allocations {why}: the "
                f"{len(self.rejected)} plans they ruled out were traced instead")

    def rejections_hold(self, ladder: Ladder, budget_bytes: int) -> bool:
        """Nothing fitted: the full traces of the plans this rung ruled out (run together on the
        workers). True if each is over the budget by its full trace too; then what the walk pruned
        for them stays pruned, and no plan is traced again (the 7B answer for 14 GiB: 93 traces were
        99 and more when every pruned plan was reopened)."""
        ladder.prefetch([c.plan for c in self.rejected])
        for c in self.rejected:
            try:
                with silenced_warnings():
                    evidence = ladder.full.evaluate(c.plan)
            except UserError:
                return False
            if not evidence.over(budget_bytes):
                return False
            c.used_bytes = evidence.used_bytes
        return True

    def withdraw(self) -> list[Candidate]:
        """Stop trusting this rung: the plans it ruled out (to be walked again)."""
        self.trusted = False
        rejected, self.rejected = self.rejected, []
        return rejected
