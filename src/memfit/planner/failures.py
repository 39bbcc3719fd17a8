"""The plans a walk found too big, and the plans they rule out untraced.

A plan that saves no more memory than one that did not fit cannot fit (techniques are assumed not to
*add* memory: memfit.planner.space.saves_no_more_than). Two more rules widen that here:

- a plan far over the budget also rules out its variants in the optimizer keys, where few parameters
  train (NOTE [ Failures too big for any optimizer choice ]);
- plans another search found too big join the failures before the walk (``known``: memfit.planner.
  search_max's NOTE [ Plans too big at a larger batch ]).
"""

from __future__ import annotations

from memfit.planner.candidate import Candidate
from memfit.planner.space import saves_no_more_than
from memfit.units import fmt_bytes

SAVES_NO_MORE = "saves no more memory than a plan that did not fit"


# NOTE [ Failures too big for any optimizer choice ]
# Where few parameters train (an adapter), what the optimizer keys do (low-bit or offloaded states,
# the step in backward) changes a plan's need by little: at most the trained parameters' gradients and
# states (``states_bytes``: memfit.planner.space.STATE_BYTES_AT_MOST a parameter, twice over: once
# for what the pruned plan's choices may save, once for what the failed plan's may add). So a plan
# that failed by more than that rules out, untraced, every plan that saves no more than it but for
# those keys: the walk no longer traces each optimizer variant of a plan far over the budget. A LoRA
# of Llama-2-7B at batch 16 x 2048 on a 12 GB card, where every plan faster than those that fit is
# 1.2-5x over it, measured 16 plans and their optimizer variants, 61 in all, before its trace limit. Nor is a variant measured
# alongside the plan it varies (NOTE [ The next plan measured alongside ] in memfit.planner.walk):
# were that plan to fail, it would most likely fail by more than the bound. Measured:
# docs/planner-notes.md.
class Failures:
    """The candidates a walk found too big (or was told were), and what they rule out."""

    def __init__(self, batch_size: int, budget_bytes: int) -> None:
        self.bs, self.budget_bytes = batch_size, budget_bytes
        self.plans: list[Candidate] = []
        self.states_bytes: int | None = None
        """What the trained parameters' gradients and optimizer states can change a plan's need by, at
        most (None: not bounded): NOTE [ Failures too big for any optimizer choice ]."""

    def __contains__(self, c: Candidate) -> bool:
        return c in self.plans

    def add(self, c: Candidate) -> None:
        self.plans.append(c)

    def remove(self, c: Candidate) -> None:
        self.plans.remove(c)

    def known(self, ranked: list[Candidate], known: dict) -> None:
        """Plans known not to fit (plan -> (a lower bound of its need, why)) fail untraced, and rule out
        others as the walk's failures do."""
        by_plan = {c.plan: c for c in ranked}
        for plan, (need, why) in known.items():
            c = by_plan.get(plan) or Candidate(plan, 0.0)  # (outside this search: it rules out others only)
            if c.open:
                c.used_bytes = need
                c.reject(why)
                self.add(c)

    def rule_out(self, c: Candidate) -> str | None:
        """Why ``c`` cannot fit, from the failures (None: they do not rule it out)."""
        if any(saves_no_more_than(c.plan, f.plan, self.bs) for f in self.plans):
            return SAVES_NO_MORE
        if any(self._far_over(f) and saves_no_more_than(c.plan, f.plan, self.bs, states_aside=True) for f in self.plans):
            return (f"saves no more memory, but for its optimizer keys (at most {fmt_bytes(self.states_bytes)}), than "
                    "a plan that did not fit by more than that")
        return None

    def would_rule_out(self, c: Candidate, others: tuple[Candidate, ...]) -> bool:
        """``c`` saves no more than one of ``others`` (or, with a bound on the optimizer keys, varies one
        in them only): were they to fail, it would most likely fail too."""
        return any(saves_no_more_than(c.plan, y.plan, self.bs) or self.states_bytes is not None
                   and saves_no_more_than(c.plan, y.plan, self.bs, states_aside=True) for y in others)

    def _far_over(self, f: Candidate) -> bool:
        """``f`` failed by more than the optimizer keys can change."""
        return self.states_bytes is not None and f.used_bytes is not None and \
            f.used_bytes - self.budget_bytes > self.states_bytes
