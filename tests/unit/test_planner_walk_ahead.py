"""NOTE [ The next plan measured alongside ]: where workers are spare, the walk measures the plan it
visits together with the one it would measure next were this one too big."""

from memfit.devices import get_device
from memfit.memory.budget import Budget
from memfit.planner.candidate import Candidate, Evidence, Fidelity, Status
from memfit.planner.ladder import DeepRung, Ladder
from memfit.planner.time_model import StepTimeModel
from memfit.planner.walk import Walk
from memfit.plans import Plan
from memfit.quiet import silenced_warnings

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
        self.estimate, self.together, self.queued = _Estimate(estimated), [], []

    def traced(self, plan):
        return plan in self.full.found

    def queue(self, plans):
        self.queued.append(list(plans))

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


def test_each_round_queues_the_next_rounds_plans_in_the_background():
    """NOTE [ The next round's traces in the background ]: with the two plans it measures, a round
    queues the two the walk would measure next were both to fail: not the default plan (it saves no
    more than the fastest), and not plans measured already."""
    fast, ckpt, plain, bf16, mb2, both = Plan(loss_chunks=8), Plan(checkpointing="blocks"), Plan(), \
        Plan(precision="bf16"), Plan(micro_batch_size=2), Plan(checkpointing="blocks", loss_chunks=8)
    seconds = {fast: 1.0, ckpt: 2.0, plain: 2.5, bf16: 3.0, mb2: 4.0, both: 5.0}
    used = {fast: 20 * GiB, ckpt: 25 * GiB, plain: 30 * GiB, bf16: 12 * GiB, mb2: 8 * GiB, both: 8 * GiB}
    for alongside, together, queued in ((True, [[fast, ckpt], [bf16, mb2]], [[bf16, mb2], [both]]), (False, [], [])):
        ladder = _Ladder(_Trace(used), {p: 5 * GiB for p in seconds})
        ranked = [Candidate(p, s) for p, s in seconds.items()]
        walk = Walk(4, Budget(10 * GiB, get_device("h100-80gb")), _Model(seconds), ladder, None, 60,
                    alongside=alongside)
        assert walk.run(ranked).plan == mb2
        assert ladder.together == together and ladder.queued == queued


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


class _Rung:
    def __init__(self, fidelity: Fidelity, used: dict, ladder) -> None:
        self.fidelity, self.used, self.ladder = fidelity, used, ladder

    def evaluate(self, plan):
        evidence = Evidence(self.fidelity, used_bytes=self.used[plan])
        if self.fidelity is Fidelity.FULL:
            assert plan in self.ladder.full_traced, plan  # (a full trace is run by prefetch, or here)
        self.ladder.found[plan] = evidence
        return evidence


class _Deep(DeepRung):
    def __init__(self, used: dict) -> None:
        super().__init__()
        self.used = used

    def evaluate(self, plan):
        return None if self.used.get(plan) is None else Evidence(Fidelity.DEEP, used_bytes=self.used[plan])


class _DeepLadder(Ladder):
    """A shallow rung (lower bounds), the deep rung and full traces, with one spare worker; the
    full traces run together (``prefetch``) are recorded."""

    spare_workers = 1
    estimate = None

    def __init__(self, lower: dict, deep: dict, full: dict) -> None:
        self.first, self.deep = _Rung(Fidelity.LOWER_BOUND, lower, self), _Deep(deep)
        self.full = _FullRung(full, self)
        self.found, self.full_traced, self.prefetched, self.behind = {}, set(), [], []

    @property
    def traces(self):
        return len(self.found) + len(self.full_traced)

    def evidence(self, plan):
        return self.found.get(plan)

    def full_evidence(self):
        return [(p, e) for p, e in self.found.items() if e.fidelity is Fidelity.FULL]

    def has_full_trace(self, plan):
        return plan in self.full_traced

    def traced(self, plan):
        return plan in self.found

    def prefetch(self, plans, behind=()):
        self.prefetched.append(list(plans))
        self.behind.append(list(behind))
        self.full_traced.update(plans)


class _FullRung(_Rung):
    def __init__(self, used: dict, ladder) -> None:
        super().__init__(Fidelity.FULL, used, ladder)

    def evaluate(self, plan):
        self.ladder.full_traced.add(plan)
        return super().evaluate(plan)


def _deep_walk(full_of_ruled_out: int):
    """The fastest plan fits by its lower bound but its deep figure (12 GiB) rules it out; the next
    is too big; the third has no deep figure and fits by its full trace."""
    ruled, big, chosen = Plan(loss_chunks=8), Plan(), Plan(checkpointing="blocks")
    seconds = {ruled: 1.0, big: 2.0, chosen: 3.0}
    ladder = _DeepLadder(lower={ruled: 8 * GiB, big: 15 * GiB, chosen: 9 * GiB}, deep={ruled: 12 * GiB},
                         full={ruled: full_of_ruled_out, chosen: int(9.5 * GiB)})
    ranked = [Candidate(p, s) for p, s in seconds.items()]
    walk = Walk(4, Budget(10 * GiB, get_device("h100-80gb")), _Model(seconds), ladder, None, 60)
    return walk.run(ranked), walk, ladder, (ruled, big, chosen)


def test_a_plan_the_deep_rung_ruled_out_is_traced_in_full_alongside_the_confirmation_to_check_it():
    """NOTE [ A full trace for the deep rung's check, alongside ]: the plan about to be chosen has no
    deep figure, so nothing would check the deep rung; the idle worker traces the plan it ruled out
    in full, alongside the confirmation. It agrees: the rung stands, with no trace after the choice.
    Where that full trace fits, the rung missed: the plan it ruled out is chosen (it is faster)."""
    chosen, walk, ladder, (ruled, big, plan) = _deep_walk(full_of_ruled_out=12 * GiB)
    assert chosen.plan == plan and ladder.prefetched == [[plan, ruled]]
    assert not walk.notes and ladder.full_traced == {plan, ruled}
    chosen, walk, ladder, (ruled, big, plan) = _deep_walk(full_of_ruled_out=int(9.8 * GiB))
    assert chosen.plan == ruled and ladder.prefetched[0] == [plan, ruled]
    assert walk.notes and "missed a full trace" in walk.notes[0]


def test_a_compiled_plan_is_not_traced_in_full_beside_an_eager_confirmation():
    """The plan confirmed is eager; the next that may come up (measured, its lower bound fits) is
    compiled: its full trace would compile for many times the confirmation's seconds, which waits for
    it, so it is not run alongside. An eager one in its place is."""
    for nxt, alongside in ((Plan(compile="blocks", checkpointing="blocks"), False), (Plan(checkpointing="blocks"), True)):
        first = Plan(loss_chunks=8)
        seconds = {first: 1.0, nxt: 2.0}
        ladder = _DeepLadder(lower={first: 8 * GiB, nxt: 8 * GiB}, deep={}, full={first: 9 * GiB, nxt: 9 * GiB})
        ranked = [Candidate(p, s) for p, s in seconds.items()]
        walk = Walk(4, Budget(10 * GiB, get_device("h100-80gb")), _Model(seconds), ladder, None, 60)
        walk._measure(ranked[1])  # (the next plan measured: its lower bound fits)
        assert walk.run(ranked).plan == first
        assert ladder.prefetched == [[first, nxt] if alongside else [first]], nxt


def test_the_recipes_left_to_measure_are_traced_alongside_the_confirmation_in_place_of_the_next_plan():
    """NOTE [ The recipes' traces alongside ]: a field recipe the walk has not measured is measured after
    it whatever it chooses, so the worker the confirmation leaves idle runs the recipe's first rung (queued
    behind the confirmation), not the next plan's full trace, which is of use only if the confirmation fails.
    With no recipe left, the next plan's full trace runs alongside, as before."""
    first, nxt, recipe = Plan(loss_chunks=8), Plan(checkpointing="blocks"), Plan(checkpointing="blocks", loss_chunks=8)
    for with_recipe in (True, False):
        seconds = {first: 1.0, nxt: 2.0, **({recipe: 3.0} if with_recipe else {})}
        ladder = _DeepLadder(lower={p: 8 * GiB for p in seconds}, deep={}, full={p: 9 * GiB for p in seconds})
        ranked = [Candidate(p, s) for p, s in seconds.items()]
        if with_recipe:
            ranked[2].recipe = "torchtune"
        walk = Walk(4, Budget(10 * GiB, get_device("h100-80gb")), _Model(seconds), ladder, None, 60)
        walk._measure(ranked[0])  # (both measured before the walk: their lower bounds fit)
        walk._measure(ranked[1])
        assert walk.run(ranked).plan == first
        if with_recipe:
            assert ladder.prefetched == [[first]] and ladder.behind == [[recipe]]
        else:
            assert ladder.prefetched == [[first, nxt]] and ladder.behind == [[]]


def test_nothing_fits_names_the_smallest_footprint_confirmed_not_the_smallest_bound():
    """Llama-2-7B at 14 GiB said "at least 14.55 GiB" (the plan with the smallest lower bound,
    13.99, confirmed) while another, bounded at 14.00, needed 14.20. Plans are confirmed in the order
    of their bounds until no bound left is below the smallest footprint confirmed."""
    low, mid, high, far = Plan(loss_chunks=8), Plan(checkpointing="blocks"), Plan(), Plan(precision="bf16")
    lower = {low: 14 * GiB, mid: int(14.1 * GiB), high: int(14.15 * GiB), far: int(14.3 * GiB)}
    ladder = _DeepLadder(lower=lower, deep={}, full={low: int(14.6 * GiB), mid: int(14.2 * GiB),
                                                     high: 15 * GiB, far: 20 * GiB})
    ranked = [Candidate(p, 1.0 + i) for i, p in enumerate(lower)]
    walk = Walk(4, Budget(13 * GiB, get_device("h100-80gb")), _Model({c.plan: c.seconds for c in ranked}), ladder,
                None, 60)
    for c in ranked:
        c.take(ladder.first.evaluate(c.plan))
    smallest = walk.smallest(ranked)
    assert smallest.plan == mid and smallest.used_bytes == int(14.2 * GiB)
    assert ladder.full_traced == {low, mid, high}  # (far's bound is above 14.2 GiB: not confirmed)


def test_a_plan_far_over_the_budget_rules_out_its_optimizer_variants_untraced():
    """NOTE [ Failures too big for any optimizer choice ]: where the optimizer keys can change a plan's need by
    at most ``states_bytes``, a plan over the budget by more rules out its variants in those keys untraced
    (8-bit states, states on the host, the step in backward); by less, or unbounded, each is traced."""
    plain, low_bit, on_host, in_backward = Plan(), Plan(optimizer="adamw8bit"), Plan(offload=("optimizer_states",)), \
        Plan(optimizer_in_backward=True)
    ckpt = Plan(checkpointing="blocks")
    seconds = {plain: 1.0, low_bit: 1.1, on_host: 1.2, in_backward: 1.3, ckpt: 5.0}
    for over, bound, traced in ((20 * GiB, GiB, [plain, ckpt]), (GiB // 2, GiB, [plain, low_bit, on_host, in_backward, ckpt]),
                                (20 * GiB, None, [plain, low_bit, on_host, in_backward, ckpt])):
        used = {p: 10 * GiB + over for p in seconds} | {ckpt: 5 * GiB}
        ladder = _Ladder(_Trace(used), {p: 5 * GiB for p in seconds})
        ranked = [Candidate(p, s) for p, s in seconds.items()]
        walk = Walk(4, Budget(10 * GiB, get_device("h100-80gb")), _Model(seconds), ladder, None, 60, alongside=False)
        walk.failed.states_bytes = bound
        assert walk.run(ranked).plan == ckpt
        assert ladder.full.order == traced
        if len(traced) == 2:
            assert all(c.status is Status.PRUNED and "optimizer keys" in c.reason for c in ranked[1:4])


def test_a_recipes_pair_queued_behind_a_full_trace_runs_once_in_the_background_and_its_measure_takes_it():
    """NOTE [ The recipes' traces alongside ], on a real trace book and its worker processes: the recipe's shallow
    pair queued behind a full trace is handed to the worker the full trace leaves idle; the recipe's measure then
    takes it (each trace counted once, none run again) and finds what a book tracing the recipe alone finds. A
    full-depth job is not queued behind (it would hold a worker the walk may need next)."""
    from memfit.planner.space import model_facts
    from memfit.planner.traces import TraceBook
    from memfit.target import Target
    from memfit.workloads import load_workload
    workload = load_workload("llama:num_hidden_layers=6,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
                             "num_key_value_heads=2,vocab_size=512", seq_len=256)
    facts, card = model_facts(workload), get_device("h100-80gb")
    chosen, recipe, other = Plan(precision="bf16-pure"), Plan(precision="bf16-pure", checkpointing="blocks"), Plan()
    book, alone = (TraceBook(Target(workload, Plan(), 1, card), facts, Budget.of_device(card)) for _ in range(2))
    try:
        with silenced_warnings():
            book.trace_full([chosen], behind=[*book.jobs([recipe]), (other, None, None)])
            forked = book.workers.count > 1  # (one process where this one ran a backward pass: nothing in the background)
            handed = [j for j in book.jobs([recipe]) if j in book.workers._background or j in book.workers._queued]
            assert handed == (book.jobs([recipe]) if forked else handed)
            assert (other, None, None) not in book.workers._queued + list(book.workers._background)
            m, a = book.measure(recipe), alone.measure(recipe)
        assert (book.traces, book.full_traces) == (3, 1)
        assert (m.peak_bytes, m.used_lower, len(m.ops)) == (a.peak_bytes, a.used_lower, len(a.ops))
        assert not forked or not book.workers._queued and not book.workers._background
    finally:
        book.close()
        alone.close()
