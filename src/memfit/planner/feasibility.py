"""Whether anything fits: the maximal plans, whose failures prune every plan they dominate.

A plan that saves no more memory than one that did not fit cannot fit (techniques are assumed not to
*add* memory). The maximal plans (none saves less than another everywhere) dominate every plan, so
when none of them fits, nothing does, and the smallest of their footprints is the budget to ask for.
The walk (memfit.planner.walk) traces them after its first plans, or first of all when nothing
measured before it fits.
"""

from __future__ import annotations

from collections.abc import Callable

from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.planner.candidate import Candidate, Status
from memfit.planner.ladder import Ladder
from memfit.planner.space import saves_no_more_than
from memfit.plans import Plan
from memfit.quiet import silenced_warnings

NEAR_BUDGET = 0.85
"""How near the budget every maximal plan whose lower bound fits is for their full traces to decide
at once (NOTE [ A borderline answer decided by the maximal plans' full traces ])."""


# NOTE [ Split maximal plans last ]
# A plan that splits the batch into n micro-batches runs forward and backward n times: its trace
# takes n times the ops, and proves nothing the maximal plans that do not split it have not. So those
# are traced first (together, on the workers), and the split ones only when none of them may fit;
# until then they wait in the queue at their estimates like any plan. Measured: docs/planner-notes.md.
def splits(plan: Plan, bs: int) -> bool:
    """The plan splits the batch into micro-batches (NOTE [ Split maximal plans last ])."""
    return plan.micro_batches(bs)[1] > 1


def maximal(ranked: list[Candidate], bs: int) -> list[Candidate]:
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


class MaximalPlans:
    """The maximal plans of one walk, traced once (:meth:`check`)."""

    def __init__(self, bs: int, budget: Budget, ladder: Ladder) -> None:
        self.bs, self.budget, self.ladder = bs, budget, ladder
        self.plans: list[Candidate] | None = None
        """The maximal plans, once traced (None: not yet)."""
        self.witnesses: list[Candidate] = []
        """Eager plans the compiled maximal plans save at least as much as, traced in their place
        (NOTE [ Eager witnesses of compiled maximal plans ])."""

    def check(self, ranked: list[Candidate], measure: Callable[[Candidate], bool],
              confirm: Callable[[Candidate], bool]) -> bool:
        """Trace the maximal plans (``measure``: the walk's first rung for one; ``confirm``: its top
        rung). False if none of them fits (then nothing does); else the open ones are for the walk's
        queue, at their measured times. Those that split the batch are traced only when none of the
        others may fit (NOTE [ Split maximal plans last ])."""
        self.plans = maximal(sorted(ranked, key=lambda x: x.seconds), self.bs)
        whole = [m for m in self.plans if not splits(m.plan, self.bs)]
        split = [m for m in self.plans if splits(m.plan, self.bs)]
        if self._a_witness_fits(ranked, whole, measure):
            return True
        for group in (whole, split):
            todo = [m for m in group if m.used_bytes is None]
            for m in todo:
                m.reopen()  # (an estimate may have called it too big)
            with silenced_warnings():
                self.ladder.measure_together([m.plan for m in todo])  # (on the workers at once)
            for m in todo:
                measure(m)
            if any(m.used_bytes is not None for m in group) and self._some_may_fit(confirm):
                return True
        return not any(m.used_bytes is not None for m in self.plans)

    # NOTE [ Eager witnesses of compiled maximal plans ]
    # Where compile modes are searched, the maximal plans compile: in the memory order a compiled plan saves
    # at least what the same plan saves eager (memfit.techniques.compile), so none of the eager plans is
    # maximal. Their shallow pairs compile a whole-model graph per depth and budget: GPT-2 124M's README
    # example (``--steps 1000``, 32 loss chunks) traced 18 compiled maximal plans in 180 s of its 324 s,
    # 27-37 s of a worker for each whole-model graph. The question they answer, whether anything may fit,
    # an eager plan answers as well where its own trace says it fits: each compiled maximal plan that has
    # an eager twin (the same plan with ``compile: none``; an activation budget has none) saves at least
    # what the twin saves, so the twins are traced first (eager pairs, a second or two each), and one of
    # them clearly under the budget (``NEAR_BUDGET``) answers yes; the maximal plans then wait in the
    # queue at their estimates like any plan. Otherwise the maximal plans are traced as before, so every
    # "nothing fits" is still theirs. Measured: docs/planner.md (P2).
    def _a_witness_fits(self, ranked: list[Candidate], whole: list[Candidate],
                        measure: Callable[[Candidate], bool]) -> bool:
        by_plan = {c.plan: c for c in ranked}
        self.witnesses = []
        for m in whole:
            if m.plan.config("compile").compiles:
                try:
                    twin = by_plan.get(m.plan.replace(compile="none"))
                except UserError:  # (an activation budget needs compile)
                    continue
                if twin is not None and twin not in self.witnesses and saves_no_more_than(twin.plan, m.plan, self.bs):
                    self.witnesses.append(twin)
        todo = [w for w in self.witnesses if w.used_bytes is None and w.status is not Status.INVALID]
        for w in todo:
            w.reopen()  # (an estimate may have called it too big)
        with silenced_warnings():
            self.ladder.measure_together([w.plan for w in todo])
        for w in todo:
            measure(w)
        limit = NEAR_BUDGET * self.budget.bytes
        return any(w.open and w.used_bytes is not None and w.used_bytes < limit for w in self.witnesses)

    # NOTE [ A borderline answer decided by the maximal plans' full traces ]
    # When every maximal plan whose lower bound fits is within ``NEAR_BUDGET`` of the budget, their
    # full traces decide at once whether anything fits: else a budget just under the smallest plan walks
    # every plan the lower bounds let through to say that nothing fits. Measured: docs/planner-notes.md.
    def _some_may_fit(self, confirm: Callable[[Candidate], bool]) -> bool:
        tops = [m for m in self.plans if m.used_bytes is not None]
        if all(m.status is Status.TOO_BIG for m in tops):
            return False
        near = [m for m in tops if m.status is not Status.TOO_BIG and not self.ladder.is_final(m.plan)]
        if near and all(m.used_bytes >= NEAR_BUDGET * self.budget.bytes for m in near):
            deep = self.ladder.deep
            cheap = [m for m in near if deep is not None and deep.evaluate(m.plan) is not None]
            for group in (cheap, [m for m in near if m not in cheap]):  # NOTE [ The cheap confirmations first ]
                self.ladder.prefetch([m.plan for m in group])
                for m in group:
                    confirm(m)
                if any(m.open for m in group):
                    return True
            if all(m.status is Status.TOO_BIG for m in tops):
                return False
        return True

    # NOTE [ The cheap confirmations first ]
    # The maximal plans near the budget whose shallow pairs line up at full depth are confirmed at a third
    # depth (NOTE [ The deep stream checked at a third depth ] in memfit.planner.deep_figures), a few blocks'
    # trace; the others by a full trace, every block's. One that fits answers the question, so those are
    # confirmed first, and the others only when none of them fits. Qwen2.5-7B's full fine-tuning on a 24 GB
    # card: two of its three maximal plans near the budget confirmed at 4 blocks, one of them fitting, and the
    # third's full trace (12-15 s of a worker, its activations offloaded) was not run.
