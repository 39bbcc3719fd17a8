"""NOTE [ The next plan measured alongside ]: where workers are spare, the walk measures the plan it
visits together with the one it would measure next were this one too big."""

from memfit.devices import get_device
from memfit.memory.budget import Budget
from memfit.planner.candidate import Candidate, Evidence, Fidelity, Status
from memfit.planner.ladder import Ladder
from memfit.planner.time_model import StepTimeModel
from memfit.planner.walk import Walk
from memfit.plans import Plan

GiB = 1 << 30


class _Model(StepTimeModel):
    excluded: list = []

    def __init__(self, seconds: dict) -> None:
        self.seconds = seconds

    def predict(self, plan):
        return self.seconds[plan]

    def warmup(self, plan):
        return 0.0


class _Trace:
    fidelity = Fidelity.FULL

    def __init__(self, used: dict) -> None:
        self.used, self.found, self.order = used, {}, []

    @property
    def traces(self):
        return len(self.order)

    def evaluate(self, plan):
        if plan not in self.found:
            self.order.append(plan)
            self.found[plan] = Evidence(Fidelity.FULL, used_bytes=self.used[plan])
        return self.found[plan]


class _Estimate:
    fidelity = Fidelity.ESTIMATE

    def __init__(self, used: dict) -> None:
        self.used = used

    def evaluate(self, plan):
        return Evidence(Fidelity.ESTIMATE, used_bytes=self.used[plan])

    def free(self, plan):
        return True


class _Ladder(Ladder):
    """One rung, an estimate, a spare worker; plans measured together are recorded."""

    spare_workers = 1

    def __init__(self, trace: _Trace, estimated: dict) -> None:
        super().__init__(trace)
        self.estimate, self.together = _Estimate(estimated), []

    def traced(self, plan):
        return plan in self.full.found

    def measure_together(self, plans, skip_over=False):
        self.together.append(list(plans))
        for p in plans:
            self.full.evaluate(p)


def _walk(alongside: bool):
    fast, plain, ckpt, both = Plan(loss_chunks=8), Plan(), Plan(checkpointing="blocks"), \
        Plan(checkpointing="blocks", loss_chunks=8)
    seconds = {fast: 1.0, plain: 2.0, ckpt: 3.0, both: 4.0}
    used = {fast: 20 * GiB, plain: 30 * GiB, ckpt: 25 * GiB, both: 8 * GiB}
    estimated = {fast: 5 * GiB, plain: 5 * GiB, ckpt: 15 * GiB, both: 5 * GiB}
    ladder = _Ladder(_Trace(used), estimated)
    ranked = [Candidate(p, s) for p, s in seconds.items()]
    walk = Walk(4, Budget(10 * GiB, get_device("h100-80gb")), _Model(seconds), ladder, None, 60, alongside=alongside)
    return walk.run(ranked), ladder, {c.plan: c for c in ranked}, (fast, plain, ckpt, both)


def test_the_next_plan_the_walk_would_measure_is_measured_with_the_one_it_visits():
    """The fastest plan (too big) is measured with the one after it that neither it (were it to fail)
    nor the estimate rules out: the default plan saves no more than the fastest, and checkpointing
    alone is estimated too big. That one fits, and no trace is wasted."""
    chosen, ladder, by_plan, (fast, plain, ckpt, both) = _walk(alongside=True)
    assert ladder.together == [[fast, both]]
    assert chosen.plan == both and ladder.full.order == [fast, both]
    assert by_plan[plain].status is Status.PRUNED and by_plan[ckpt].status is Status.TOO_BIG
    chosen, ladder, _, _ = _walk(alongside=False)  # (--methods: the searches share the cores)
    assert ladder.together == [] and chosen.plan == both and ladder.full.order == [fast, both]


class _Measuring(_Trace):
    """Each plan's measured time replaces its estimate when it is traced."""

    def __init__(self, used: dict, model: _Model, measured: dict) -> None:
        super().__init__(used)
        self.model, self.measured = model, measured

    def evaluate(self, plan):
        self.model.seconds[plan] = self.measured[plan]
        return super().evaluate(plan)


def test_a_plan_measured_alongside_that_came_out_slower_waits_for_the_faster_estimates():
    """The plan measured alongside fits by its final evidence but takes 5 s, over the next plan's
    estimate (3 s): it is queued again at its time, and the faster plan is chosen."""
    fast, slow, next_ = Plan(loss_chunks=8), Plan(checkpointing="blocks", loss_chunks=8), Plan(checkpointing="blocks")
    seconds = {fast: 1.0, slow: 2.0, next_: 3.0}
    model = _Model(dict(seconds))
    trace = _Measuring({fast: 20 * GiB, slow: 5 * GiB, next_: 8 * GiB}, model, {fast: 1.0, slow: 5.0, next_: 3.0})
    ladder = _Ladder(trace, {p: 5 * GiB for p in seconds})
    ranked = [Candidate(p, s) for p, s in seconds.items()]
    chosen = Walk(4, Budget(10 * GiB, get_device("h100-80gb")), model, ladder, None, 60).run(ranked)
    assert ladder.together[0] == [fast, slow] and chosen.plan == next_
