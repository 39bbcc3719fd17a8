"""The planner and compile: which compile modes and activation budgets it searches, their compile
time shown and counted per step over a short run, the GPU-preset model's compile time, and the
calibrated model's measured compile time (slow: it compiles for real)."""


import pytest
import torch

from memfit.devices import get_device
from memfit.errors import CompileFailed
from memfit.memory.budget import Budget
from memfit.planner import cost
from memfit.planner.candidate import Candidate
from memfit.planner.cost import TimeModel
from memfit.planner.feasibility import maximal
from memfit.planner.search import gpu_search, plan
from memfit.planner.space import candidates, default_space, model_facts, saves_no_more_than
from memfit.plans import Plan
from memfit.target import Target
from memfit.techniques.compile import COMPILE_SECONDS_PER_OP
from memfit.workload import Workload
from memfit.workloads import load_workload

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128"
BUDGETS = ["budget:0.5", "budget:0.1"]


def _space(device, **kw):
    return default_space(model_facts(load_workload(SPEC, seq_len=64)), get_device(device), 8, **kw)


def test_compile_modes_searched_by_device_and_on_request():
    cpu, gpu = _space("cpu"), _space("a100-40gb", compile_modes=("none", "blocks"))
    assert cpu.values["compile"] == _space("a100-40gb").values["compile"] == ["none"]  # asked for only
    assert gpu.values["compile"] == ["none", "blocks"]
    assert _space("cpu", compile_modes=("none", "blocks", "full")).values["compile"] == ["none", "blocks", "full"]
    assert cpu.values["checkpointing"][-2:] == gpu.values["checkpointing"][-2:] == BUDGETS
    plans = candidates(gpu, 8)
    budgeted = [p for p in plans if p.checkpointing in BUDGETS]
    assert budgeted and all(p.compile == "blocks" for p in budgeted)  # a budget needs compile
    assert not [p for p in candidates(cpu, 8) if p.checkpointing in BUDGETS]


def test_no_repeated_blocks_leaves_compile_blocks_out_with_a_note():
    space = default_space(model_facts(load_workload("cnn")), get_device("a100-40gb"), 8,
                          compile_modes=("none", "blocks", "full"))
    assert space.values["compile"] == ["none", "full"]
    assert any("compile: blocks left out" in n for n in space.notes)


def test_memory_order_compiled_saves_at_least_eager_budgets_unordered():
    assert saves_no_more_than(Plan(), Plan(compile="blocks"), 8)
    assert saves_no_more_than(Plan(checkpointing="blocks"), Plan(compile="full", checkpointing="blocks"), 8)
    assert not saves_no_more_than(Plan(compile="blocks"), Plan(), 8)
    assert not saves_no_more_than(Plan(compile="blocks"), Plan(compile="full"), 8)
    assert not saves_no_more_than(Plan(compile="full"), Plan(compile="blocks"), 8)
    # peak is not monotone in F for whole-model graphs (NOTE [ Activation budget ladder ])
    assert not saves_no_more_than(Plan(compile="full", checkpointing="budget:0.5"),
                                  Plan(compile="full", checkpointing="budget:0.1"), 8)


@pytest.mark.slow  # (keeps the default suite near 10 minutes)
def test_maximal_plans_are_those_no_plan_dominates():
    """The one-pass skyline (O(plans x maximal)) equals the definition (O(plans^2))."""
    cands = [Candidate(p, 0) for p in candidates(_space("a100-40gb", compile_modes=("none", "blocks")), 8)]
    by_definition = [c for c in cands if not any(
        d is not c and saves_no_more_than(c.plan, d.plan, 8) and not saves_no_more_than(d.plan, c.plan, 8)
        for d in cands)]
    assert [c.plan for c in maximal(cands, 8)] == [c.plan for c in by_definition]


def test_gpu_preset_compile_time_from_the_graph_size():
    """Compiled plans on a GPU preset: compile time from the compiled graph's op count (the whole
    forward for full, one block for blocks) and the budget's extra partitioner time, at the H100
    recording's rate (the step time of compiled plans: tests/unit/test_timing.py)."""
    target = Target.resolve(SPEC, None, 8, "a100-40gb", seq_len=64)
    space = _space("a100-40gb", compile_modes=("none", "blocks", "full"))
    book, model, _ = gpu_search(target, space, model_facts(target.workload), Budget.resolve(None, target.device))
    try:
        model.baseline.base = Plan(precision="bf16")
        graph = book.measure(model.base).graph
    finally:
        book.close()
    assert 0 < graph.block_ops < graph.forward_ops
    full, blocks = Plan(compile="full"), Plan(compile="blocks")
    assert model.warmup(Plan()) == 0 < model.warmup(blocks) < model.warmup(full)
    assert model.warmup(full) == pytest.approx(COMPILE_SECONDS_PER_OP * graph.forward_ops)
    assert model.warmup(full) / model.warmup(blocks) == pytest.approx(graph.forward_ops / graph.block_ops)
    half = Plan(compile="full", checkpointing="budget:0.5")
    assert model.warmup(half) / model.warmup(full) == pytest.approx(129.5 / 45.6)
    assert model.per_step(full, 100) == pytest.approx(model.predict(full) + model.warmup(full) / 100)
    assert model.per_step(full, None) == model.predict(full)


def _model(space, compile_seconds):
    m = TimeModel("fixed", 8, base_seconds={mb: 1.0 for mb in space.micro_batches})
    m.factors = {("compile", "blocks"): 0.5}
    m.warmups = {("compile", "blocks"): compile_seconds}
    return m


@pytest.mark.slow  # (a compiled trace: keeps the default suite under 10 minutes)
def test_compile_time_counts_per_step_only_over_a_short_run():
    """1 s eager, 0.5 s compiled after 30 s of compiling: compiled wins a long run, and a run of 100
    steps (0.8 s a step); over 20 steps (2 s a step) eager wins."""
    wl = load_workload(SPEC, seq_len=64)
    space = default_space(model_facts(wl), get_device("cpu"), 8, compile_modes=("none", "blocks"))
    for steps, compiled in ((None, True), (100, True), (20, False)):
        r = plan(wl, budget="4GiB", batch_size=8, compile_modes=("none", "blocks"), steps=steps,
                 time_model=_model(space, 30.0), max_traces=2)
        assert (r.chosen.plan.compile == "blocks") is compiled, steps
        row = r.to_json()["chosen"]
        assert row["compile_seconds"] == (30.0 if compiled else 0.0) and r.to_json()["run_steps"] == steps
        assert row["predicted_step_seconds"] == pytest.approx(0.5 + 30 / steps if compiled and steps else
                                                               0.5 if compiled else 1.0)
        assert row["steady_step_seconds"] == (0.5 if compiled else 1.0)


@pytest.mark.slow
def test_calibration_measures_compile_time_and_times_budgets_with_compile():
    """On this CPU, compiled for real: compile blocks' first step pays its compile time (measured,
    shown); budget:F cannot run alone, so it is timed with compile: blocks against compile: blocks."""
    wl = load_workload(SPEC, seq_len=32)
    target = Target.resolve(wl, None, 4, "cpu")
    space = default_space(model_facts(wl), get_device("cpu"), 4, compile_modes=("none", "blocks"))
    space.values = {"compile": ["none", "blocks"], "checkpointing": ["none", "budget:0.5"]}
    space.micro_batches = [4]
    model = cost.calibrate(target, space)
    assert set(model.warmups) == {("compile", "blocks"), ("checkpointing", "budget:0.5")}
    assert model.warmups[("compile", "blocks")] > 1.0  # Inductor's C++ compile: seconds
    assert ("checkpointing", "budget:0.5") in model.factors and not model.excluded
    assert model.warmup(Plan(compile="blocks", checkpointing="budget:0.5")) == pytest.approx(
        sum(model.warmups.values()))


def test_a_given_budget_is_checked_with_the_given_compile_mode():
    """``--compile full --checkpointing budget:0.5`` (a budget needs compile): each given value is checked
    against the model with the given fields it needs, not refused as if compile were off."""
    from memfit.errors import UserError
    from memfit.planner.given_fields import check_suits
    target = Target.resolve(SPEC, None, 8, "h100-80gb", seq_len=64)
    given = {"compile": "full", "checkpointing": "budget:0.5"}
    check_suits(target, {"checkpointing": "budget:0.5"}, given)  # (raised "needs compile" before)
    with pytest.raises(UserError, match="needs compile"):
        check_suits(target, {"checkpointing": "budget:0.5"}, {"checkpointing": "budget:0.5"})
    with_8bit = {**given, "checkpointing": "budget:0.1", "optimizer_in_backward": True, "optimizer": "adamw8bit"}
    check_suits(target, {"checkpointing": "budget:0.1"}, with_8bit)  # (built with compile, not the 8-bit update)


class _BreakingBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        torch._dynamo.graph_break()  # (no block is one graph: compile: blocks cannot capture any)
        return torch.relu(self.lin(x))


def _breaking_workload() -> Workload:
    model = lambda: torch.nn.Sequential(*(_BreakingBlock() for _ in range(4)))  # noqa: E731
    return Workload(model=model, batch=lambda n: torch.randn(n, 64), loss=lambda m, b: m(b).square().mean(),
                    name="breaks")


def test_a_searched_compile_mode_the_model_cannot_take_is_left_out_and_the_note_says_what_broke(monkeypatch):
    """NOTE [ A searched compile mode the model cannot take ]: ``--compile-modes blocks`` on blocks that
    break the graph ended the search in the error; now the plan is eager, and the first note says why.
    Given as a plan field, the mode is the user's step: its failure stays one line naming the cause. The
    traces run in this process, one after another (as on one core): ``compile: blocks`` after a broken
    ``compile: full`` ran the pieces Dynamo had cached (NOTE [ Pieces of a broken graph left in Dynamo's
    cache ] in memfit.planner.trace_job)."""
    monkeypatch.setenv("MEMFIT_PLAN_WORKERS", "1")
    result = plan(_breaking_workload(), device="rtx4090", batch_size=4, compile_modes=("blocks",))
    assert result.chosen is not None and result.chosen.plan.compile == "none"
    assert result.notes[0] == ("compile: blocks left out: torch.compile cannot capture the block _BreakingBlock as one "
                               "graph (Call to `torch._dynamo.graph_break()`: Called `torch._dynamo.graph_break()` "
                               "with args `[]`, kwargs `{}`); planned without compile")
    assert all(c.plan.compile == "none" for c in result.candidates)
    # ``full`` may break the graph, but a broken graph is not predicted as compiled: it raised in a trace worker,
    # whose error (GraphBreaks) did not unpickle in the planner's process
    both = plan(_breaking_workload(), device="rtx4090", batch_size=4, compile_modes=("full", "blocks"))
    assert both.chosen.plan.compile == "none" and both.notes[1] == result.notes[0]
    assert both.notes[0].startswith("compile: full left out: torch.compile broke the model and loss into pieces at 3 "
                                    "graph break(s) (first: Call to `torch._dynamo.graph_break()`); planned with "
                                    "compile: blocks")
    with pytest.raises(CompileFailed, match=r"^compile: torch.compile cannot capture the block _BreakingBlock as one "
                                            r"graph \(Call to `torch._dynamo.graph_break\(\)`.*\); use compile: none"):
        plan(_breaking_workload(), device="rtx4090", batch_size=4, fixed={"compile": "blocks"})
