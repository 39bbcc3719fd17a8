"""What the GPU-preset planner knows before tracing a plan: precisions whose weights cannot fit are
left out, estimates come from the nearest measured plan and change as the walk measures, the
maximal plans come first when nothing measured fits, and predicted compiles skip vector code."""

from types import SimpleNamespace

import pytest

from memfit.devices import get_device
from memfit.memory.budget import Budget
from memfit.planner.baseline import Baseline, adds_work
from memfit.planner.candidate import Candidate, Evidence, Fidelity, Status
from memfit.planner.gpu_time import GpuStepModel
from memfit.planner.ladder import Ladder
from memfit.planner.search import gpu_search, plan
from memfit.planner.space import SearchSpace, leave_out_weights_that_cannot_fit, model_facts, weight_bytes
from memfit.planner.time_model import StepTimeModel
from memfit.planner.traces import Measured
from memfit.planner.walk import Walk
from memfit.plans import Plan
from memfit.target import Target
from memfit.workloads import load_workload

GiB = 1 << 30


def test_a_precision_whose_weights_alone_exceed_the_budget_is_left_out():
    """NOTE [ Weights that cannot fit ]: Llama-2-7B's fp32 weights (25.1 GiB, with autocast too)
    exceed a 24 GB card's budget in every plan; its bf16 weights (12.55 GiB) may fit."""
    facts = model_facts(load_workload("llama", seq_len=2048))
    assert weight_bytes(facts.model, "bf16") == weight_bytes(facts.model, "fp32") == 2 * weight_bytes(facts.model, "bf16-pure")
    assert 12.5 * GiB < weight_bytes(facts.model, "bf16-pure") < 12.6 * GiB
    budget = Budget.resolve(None, get_device("rtx4090")).bytes
    space = SearchSpace(values={"precision": ["fp32", "bf16", "bf16-pure"]})
    leave_out_weights_that_cannot_fit(space, facts, budget)
    assert space.values["precision"] == ["bf16-pure"]
    assert sum("weights alone" in n and "exceed the budget" in n for n in space.notes) == 2
    for budget, left in ((80 * GiB, ["fp32", "bf16", "bf16-pure"]), (10 * GiB, ["fp32", "bf16", "bf16-pure"])):
        space = SearchSpace(values={"precision": ["fp32", "bf16", "bf16-pure"]})
        leave_out_weights_that_cannot_fit(space, facts, budget)  # all fit, or none (then the search says so)
        assert space.values["precision"] == left and not space.notes


def _model_with(measured: dict, ratios: dict) -> GpuStepModel:
    """The time model with ``measured`` plans in its book, each priced at the seconds given."""
    target = Target.resolve("gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256", None, 4, "h100-80gb", seq_len=32)
    space = SearchSpace(values={"checkpointing": ["none", "blocks"], "loss_chunks": [0, 8],
                                "optimizer_in_backward": [False, True]}, micro_batches=[4])
    book, model, _ = gpu_search(target, space, model_facts(target.workload), Budget.resolve(None, target.device))
    book.close()
    model.baseline.base = Plan()
    model.ratios = ratios
    seconds = {}
    model.step = lambda p: SimpleNamespace(seconds=seconds[p], cpu_seconds=0.0, migration=0.0) if p in book.measured else None

    def measure(p, s):
        book.measured[p], seconds[p] = Measured(peak_bytes=0, used_lower=0), s
    model.measure = measure
    for measured_plan, s in measured.items():
        measure(measured_plan, s)
    return model


def test_a_plan_is_estimated_from_the_measured_plans_it_contains():
    """NOTE [ Estimates from the nearest measured plan ]: a measured pair that combined 5x slower than
    its factors carries that to every plan containing it; of two largest parts the slower stands."""
    ckpt, chunks, inbw = ("checkpointing", "blocks"), ("loss_chunks", 8), ("optimizer_in_backward", True)
    ratios = {ckpt: 1.2, chunks: 1.1, inbw: 0.9}
    both = Plan(checkpointing="blocks", loss_chunks=8)
    model = _model_with({Plan(): 1.0, both: 1.2 * 1.1 * 5}, ratios)
    three = Plan(checkpointing="blocks", loss_chunks=8, optimizer_in_backward=True)
    assert model.predict(three) == pytest.approx(1.2 * 1.1 * 5 * 0.9)
    assert model.predict(Plan(checkpointing="blocks", optimizer_in_backward=True)) == pytest.approx(1.2 * 0.9)
    model.measure(Plan(loss_chunks=8, optimizer_in_backward=True), 1.0)
    assert model.predict(three) == pytest.approx(1.2 * 1.1 * 5 * 0.9)  # (the slower of the two parts)
    assert model.estimate_depends_on(three, [both]) and not model.estimate_depends_on(Plan(loss_chunks=8), [both])


class _Model(StepTimeModel):
    """Estimates from a table the test changes as plans are measured."""

    excluded: list = []

    def __init__(self, seconds: dict, after: dict) -> None:
        self.seconds, self.after, self.new = dict(seconds), after, []

    def predict(self, plan):
        return self.seconds[plan]

    def warmup(self, plan):
        return 0.0

    def is_estimate(self, plan):
        return True

    def newly_measured(self):
        new, self.new = self.new, []
        return new

    def estimate_depends_on(self, plan, measured):
        return True


class _Trace:
    """The one rung: each plan's bytes from a table; measuring ``trigger`` changes the estimates."""

    fidelity = Fidelity.FULL

    def __init__(self, used: dict, model: _Model, found: dict | None = None) -> None:
        self.used, self.model, self.found, self.order = used, model, dict(found or {}), []

    @property
    def traces(self):
        return len(self.order)

    def evaluate(self, plan):
        self.order.append(plan)
        self.found[plan] = Evidence(Fidelity.FULL, used_bytes=self.used[plan])
        self.model.new.append(plan)
        self.model.seconds.update(self.model.after.get(plan, {}))
        return self.found[plan]


def _walk(seconds, used, budget, after=None, found=None):
    model = _Model(seconds, after or {})
    trace = _Trace(used, model, found)
    ranked = [Candidate(p, s) for p, s in sorted(seconds.items(), key=lambda x: x[1])]
    walk = Walk(4, Budget(budget, get_device("h100-80gb")), model, Ladder(trace), None, 60)
    return walk.run(ranked), trace, ranked


def test_the_walk_requeues_a_plan_whose_estimate_a_measurement_changed():
    """Measuring the fastest plan shows the next one 5x slower than estimated: the walk takes the
    third, which fits, and never traces the second."""
    a, b, c = Plan(), Plan(loss_chunks=8), Plan(checkpointing="blocks")
    chosen, trace, ranked = _walk({a: 1.0, b: 2.0, c: 3.0}, {a: 20 * GiB, b: 5 * GiB, c: 5 * GiB}, 10 * GiB,
                                  after={a: {b: 10.0}})
    assert chosen.plan == c and trace.order == [a, c]
    assert next(x for x in ranked if x.plan == b).status is Status.NOT_EVALUATED


def test_the_maximal_plans_come_first_when_no_plan_measured_before_the_walk_fits():
    """NOTE [ Maximal plans first when nothing measured fits ]: the default plan, measured before the
    walk, is over the budget; the maximal plan is traced first and, too big, rules out the rest."""
    a, b, m = Plan(), Plan(loss_chunks=8), Plan(checkpointing="blocks", loss_chunks=8)
    used = {a: 30 * GiB, b: 25 * GiB, m: 20 * GiB}
    found = {a: Evidence(Fidelity.FULL, used_bytes=used[a])}
    chosen, trace, _ = _walk({a: 1.0, b: 2.0, m: 3.0}, used, 10 * GiB, found=found)
    assert chosen is None and trace.order == [m]
    # a plan measured before the walk that fits: the fastest plans first, as before
    used[a] = 5 * GiB
    chosen, trace, _ = _walk({a: 1.0, b: 2.0, m: 3.0}, used, 10 * GiB, found={a: Evidence(Fidelity.FULL, used_bytes=used[a])})
    assert chosen.plan == a and m not in trace.order


DEEP = "gpt2:n_layer=6,n_embd=256,n_head=4,vocab_size=2000,n_positions=128"


@pytest.mark.slow  # (keeps the default suite under 10 minutes on 2 cores); a planning-time saving
def test_work_adding_values_are_not_measured_when_the_fastest_simple_plan_fits(monkeypatch):
    """NOTE [ Work-adding values when the default plan fits ]: on an 80 GB card a small GPT-2's
    default plan fits; checkpointing, offload and a chunked loss can only make it slower, so they
    are not measured, and the choice is the one the whole search makes."""
    quick = plan(DEEP, device="h100-80gb", batch_size=8, seq_len=128, optimizers=("adamw",))
    assert any("only add work" in n and "checkpointing" in n for n in quick.notes), quick.notes
    assert quick.chosen is not None and quick.chosen.plan.checkpointing == "none"
    monkeypatch.setattr(Baseline, "_may_fit_alone", lambda self: False)
    whole = plan(DEEP, device="h100-80gb", batch_size=8, seq_len=128, optimizers=("adamw",))
    assert not any("only add work" in n for n in whole.notes)
    assert whole.chosen.plan == quick.chosen.plan and whole.chosen.used_bytes == quick.chosen.used_bytes
    assert quick.traces < whole.traces


def test_maximal_plans_that_split_the_batch_are_traced_only_when_no_other_may_fit():
    """NOTE [ Split maximal plans last ]: a maximal plan that does not split the batch fits, so the
    one that does (its trace runs every micro-batch) is not traced to prove that something fits."""
    a, whole, split = Plan(), Plan(checkpointing="blocks", loss_chunks=8), Plan(checkpointing="blocks", micro_batch_size=2)
    used = {a: 30 * GiB, whole: 8 * GiB, split: 6 * GiB}
    found = {a: Evidence(Fidelity.FULL, used_bytes=used[a])}
    chosen, trace, _ = _walk({a: 1.0, whole: 3.0, split: 5.0}, used, 10 * GiB, found=found)
    assert chosen.plan == whole and split not in trace.order
    used[whole] = 12 * GiB  # it does not fit: then the split one is traced, and is the answer
    chosen, trace, _ = _walk({a: 1.0, whole: 3.0, split: 5.0}, used, 10 * GiB, found=found)
    assert chosen.plan == split and trace.order.index(whole) < trace.order.index(split)


def test_a_value_that_needs_another_technique_is_judged_alone():
    """checkpointing budget:F needs a compile mode in a Plan: whether it only adds work is a question
    about the value alone (the slow compile test's plan was refused before this)."""
    assert adds_work(("checkpointing", "budget:0.5")) and adds_work(("loss_chunks", 8))
    assert not adds_work(("precision", "bf16")) and not adds_work(("compile", "blocks"))


def test_a_plan_is_estimated_to_need_at_least_the_weights_it_keeps():
    """Mixtral's LoRA on a 24 GB card: the savings of 8 of 32 blocks swapped and of the other
    values, each measured alone, added up to an estimate under the budget for plans that keep
    69 GiB of weights on the device; each was traced at full depth (46 traces, 494 s of a 543 s
    plan). NOTE [ The weights under an estimate ]: savings on activations alone summed past the
    activations too (a LoRA of Llama-2-7B at batch 16 x 2048 on a 12 GB card, none swapped). The
    estimate is at least the weights a plan keeps, plus the CUDA context: the frozen weights of all
    but its swapped blocks, and of two of those (counted here by name, in 16 bits)."""
    from memfit.planner.gpu_ladder import Estimate
    spec = "llama:num_hidden_layers=8,hidden_size=64,intermediate_size=128,num_attention_heads=4,vocab_size=500"
    meta = model_facts(load_workload(spec, seq_len=32)).model
    base, context = Plan(adapter="lora:r=4"), 3 << 20
    book = SimpleNamespace(measured={base: SimpleNamespace(used_lower=1 << 20)}, is_measured=lambda p: False, world=1,
                           target=SimpleNamespace(batch_size=2, device=SimpleNamespace(context_bytes=context)),
                           rank_batch=2, tracer=SimpleNamespace(meta_model=meta))
    baseline = SimpleNamespace(base=base, savings={**{("swap_blocks", n): -(1 << 40) for n in (2, 4, 8)},
                                                   ("checkpointing", "blocks"): -(1 << 40)},
                               technique_keys=lambda plan: [("swap_blocks", plan.swap_blocks)] if plan.swap_blocks else
                               [("checkpointing", plan.checkpointing)] if plan.checkpointing != "none" else [])
    estimate = Estimate(book, baseline)
    total = sum(p.numel() for p in meta.parameters())

    def kept(count):  # (every weight but the last ``count`` blocks', and two of those blocks)
        block = sum(p.numel() for n, p in meta.named_parameters() if n.startswith("model.layers.7."))
        return 2 * (total - (count - 2) * block)
    for count in (2, 4, 8):
        assert estimate.used(base.replace(swap_blocks=count)) == kept(count) + context
    assert estimate.used(base.replace(checkpointing="blocks")) == 2 * total + context  # (none swapped: all of them)
    assert estimate.used(base) == max(1 << 20, 2 * total + context)
    book.world = 2  # sharded: a share of the weights on each rank, no floor
    assert Estimate(book, baseline).used(base.replace(checkpointing="blocks")) == context
