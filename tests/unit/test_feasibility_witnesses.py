"""NOTE [ Eager witnesses of compiled maximal plans ] (memfit.planner.feasibility): where compile modes are
searched, an eager twin of a compiled maximal plan that its own trace puts clearly under the budget says that
something may fit, and none of the compiled maximal plans (a whole-model compile per depth each) is traced;
otherwise they are traced as before, and "nothing fits" is still theirs."""

import functools
from types import SimpleNamespace

from memfit.devices import get_device
from memfit.planner.candidate import Candidate
from memfit.planner.feasibility import MaximalPlans, maximal
from memfit.planner.space import candidates, default_space, model_facts
from memfit.workloads import load_workload

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128"
BUDGET = 1000


class _Ladder:
    """The rungs, stood in for: what a plan's first rung measures is ``sizes(plan)``."""

    deep = None

    def __init__(self) -> None:
        self.traced: list = []

    def measure_together(self, plans) -> None:
        self.traced += [p for p in plans if p not in self.traced]

    def is_final(self, plan) -> bool:
        return False


@functools.cache
def _plans() -> tuple:
    space = default_space(model_facts(load_workload(SPEC, seq_len=64)), get_device("a100-40gb"), 8,
                          optimizers=("adamw",), compile_modes=("none", "blocks", "full"))
    return tuple(candidates(space, 8))


def _check(sizes) -> tuple[bool, list, list[Candidate]]:
    ranked = [Candidate(p, float(i)) for i, p in enumerate(_plans())]
    ladder = _Ladder()

    def measure(c: Candidate) -> bool:
        c.used_bytes = sizes(c.plan)
        if c.used_bytes > BUDGET:
            c.reject("too big")
        return True
    check = MaximalPlans(8, SimpleNamespace(bytes=BUDGET), ladder)
    fits = check.check(ranked, measure, confirm=lambda c: c.used_bytes <= BUDGET)
    return fits, ladder.traced, ranked


def _compiled(plan) -> bool:
    return plan.compile != "none"


def test_an_eager_twin_clearly_under_the_budget_answers_and_no_compiled_maximal_plan_is_traced():
    fits, traced, ranked = _check(lambda p: 500)
    whole = [m for m in maximal(sorted(ranked, key=lambda c: c.seconds), 8) if m.plan.micro_batches(8)[1] == 1]
    assert whole and all(_compiled(m.plan) for m in whole)  # (the case: every maximal plan compiles)
    assert fits and traced and not any(_compiled(p) for p in traced)
    twins = {m.plan.replace(compile="none") for m in whole if not m.plan.checkpointing.startswith("budget")}
    assert set(traced) == twins  # (an activation budget has no eager twin)


def test_twins_near_or_over_the_budget_leave_the_answer_to_the_compiled_maximal_plans():
    for eager in (900, 2000):  # (near: within NEAR_BUDGET of it; over)
        fits, traced, _ = _check(lambda p, eager=eager: 500 if _compiled(p) else eager)
        assert fits and any(_compiled(p) for p in traced)
    fits, traced, _ = _check(lambda p: 2000)  # nothing fits: the maximal plans' own traces say so
    assert not fits and any(_compiled(p) for p in traced)
