"""Planner: search space, pruning rule, budgets, exports, and plans that really fit."""

import pytest

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.export import to_hf, to_lightning
from memfit.memory.measure import profile
from memfit.planner.cost import TimeModel
from memfit.planner.search import plan, resolve_budget
from memfit.planner.space import candidates, default_space, model_facts, saves_no_more_than
from memfit.plans import Plan
from memfit.workloads import load_workload

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128"


def _fixed_time_model(batch_size, space):
    """A deterministic time model (the calibrated one is measured): penalties per technique."""
    m = TimeModel("fixed", batch_size, base_seconds={mb: 1.0 + 0.1 * (batch_size // mb - 1)
                                                     for mb in space.micro_batches})
    m.factors = {("precision", "bf16"): 0.6, ("precision", "bf16-pure"): 0.55, ("checkpointing", "blocks"): 1.3,
                 ("checkpointing", "blocks:every=2"): 1.15, ("checkpointing", "selective"): 1.1,
                 ("optimizer", "adamw8bit"): 1.05, ("optimizer_in_backward", True): 1.02,
                 ("loss_chunks", 8): 1.05, ("attention", "chunked"): 1.1}
    return m


def test_space_is_valid_plans_only_and_fits_the_model():
    wl = load_workload(SPEC, seq_len=64)
    facts = model_facts(wl)
    space = default_space(facts, get_device("cpu"), 8)
    # the model has repeated blocks, is a causal LM and has attention: each technique searches its values
    assert "blocks" in space.values["checkpointing"] and 8 in space.values["loss_chunks"]
    assert "chunked" in space.values["attention"]
    plans = candidates(space, 8)
    assert plans and all(not (p.optimizer_in_backward and p.micro_batch_size) for p in plans)
    assert all(p.offload == () for p in plans)  # no offload on the CPU: the host is the device
    gpu = default_space(facts, get_device("t4"), 8)
    assert "bf16" not in gpu.values["precision"] and ("optimizer_states",) in gpu.values["offload"]
    assert space.size() >= len(plans)


def test_pruning_rule():
    assert saves_no_more_than(Plan(precision="bf16"), Plan(precision="bf16-pure", checkpointing="blocks"), 8)
    assert not saves_no_more_than(Plan(checkpointing="selective"), Plan(checkpointing="blocks:every=2"), 8)
    assert not saves_no_more_than(Plan(micro_batch_size=2), Plan(), 8)
    assert saves_no_more_than(Plan(), Plan(micro_batch_size=2), 8)


def test_budget_forms_and_errors():
    assert resolve_budget("80%", get_device("a100-40gb")) == int(0.8 * 42_505_273_344)
    assert resolve_budget(None, get_device("a100-40gb")) == int(0.9 * 42_505_273_344)
    with pytest.raises(UserError, match="malformed budget"):
        resolve_budget("lots", get_device("cpu"))
    with pytest.raises(UserError, match="below the model's own parameters"):
        plan("llama", budget="1GiB", device="a100-40gb", batch_size=1)


def test_chosen_plan_fits_when_measured_and_is_the_fastest_that_fits():
    wl = load_workload(SPEC, seq_len=64)
    space = default_space(model_facts(wl), get_device("cpu"), 8)
    base = profile(wl, Plan(), batch_size=8, repeats=0).peak_bytes
    budget = int(0.5 * base)
    result = plan(wl, budget=budget, batch_size=8, time_model=_fixed_time_model(8, space))
    assert result.chosen is not None
    measured = profile(wl, result.chosen.plan, batch_size=8, repeats=0).peak_bytes
    assert measured <= budget
    # every plan predicted faster than the chosen one was traced and did not fit, or was pruned
    faster = [c for c in result.candidates if c.seconds < result.chosen.seconds]
    assert all(c.status in ("too big", "pruned") for c in faster)
    assert all(c.used_bytes > budget for c in faster if c.status == "too big")


def test_the_walk_reports_its_traces_to_a_progress_bar():
    """Each plan the walk measures is reported (traced so far, the trace limit, candidates open); on
    a terminal the bar draws it, elsewhere nothing is written."""
    import io

    from memfit.planner.progress import PlanProgress
    from memfit.planner.search import plan

    class Recorder(PlanProgress):
        def __init__(self, stream):
            super().__init__(stream)
            self.calls, self.stages = [], []

        def stage(self, text):
            self.stages.append(text)
            super().stage(text)

        def walk(self, traced, limit, open_plans):
            self.calls.append((traced, limit, open_plans))
            super().walk(traced, limit, open_plans)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    with Recorder(terminal) as progress:
        result = plan("mha", budget="4MiB", batch_size=4, max_traces=7, progress=progress)
    timing = progress.stages[1:]  # (the CPU planner names each value it times: NOTE [ Real steps that fit this machine ])
    assert progress.stages[:2] == ["timing techniques", "timing the plain step at batch 4"] and progress.calls
    assert all(t.startswith("timing ") and t.endswith("at batch 4)") for t in timing[1:]) and len(timing) > 3
    traced = [c[0] for c in progress.calls]
    assert traced == sorted(traced) and all(c[1] == 7 for c in progress.calls)
    assert progress.calls[0][2] == len(result.candidates) and "traces" in terminal.getvalue()
    log = io.StringIO()
    with PlanProgress(log) as quiet:
        quiet.stage("timing techniques")
        quiet.walk(1, 7, 10)
    assert log.getvalue() == ""


def test_exports():
    p = Plan(precision="bf16", micro_batch_size=2, checkpointing="blocks", optimizer="adamw8bit", loss_chunks=8)
    hf = to_hf(p, 8)  # (the chunked loss changes the step: MemfitTrainer runs it, and the rest of memfit's step)
    assert hf.kwargs == {"output_dir": "trainer_output", "per_device_train_batch_size": 8, "optim": "adamw_bnb_8bit",
                         "max_grad_norm": 0.0}
    assert hf.unmapped == ("loss_chunks: 8", "micro_batch_size: 2", "precision: bf16", "checkpointing: blocks")
    lt = to_lightning(p, 8)  # (the callback's step splits the batch itself)
    assert lt.kwargs == {"precision": "bf16-mixed"}
    assert lt.notes == ("DataLoader(batch_size=8): the plan's whole batch (memfit's step splits it into 4 "
                        "micro-batches of 2)",)
    assert lt.unmapped == ("checkpointing: blocks", "optimizer: adamw8bit", "loss_chunks: 8", "micro_batch_size: 2")


def test_the_cpu_planner_refuses_a_model_whose_plain_step_cannot_fit_this_machine(monkeypatch):
    """It times real steps: a model whose fp32 AdamW states alone pass the free memory would be
    killed by the OS; one line instead, naming the GPU presets that trace without that memory."""
    import memfit.planner.cost as cost
    from memfit.errors import UserError
    from memfit.planner.search import plan as plan_for
    monkeypatch.setattr(cost, "available_host_bytes", lambda: 1 << 20)
    with pytest.raises(UserError, match=r"this machine has 1.00 MiB free; plan for a GPU preset"):
        plan_for("gpt2:n_layer=1,n_embd=64,n_head=2,vocab_size=256,n_positions=32", budget="1GiB", device="cpu",
                 batch_size=2, seq_len=32)


def test_offloaded_states_take_the_optimizer_out_of_the_memory_order():
    """Issue 29: a low-bit optimizer whose states are offloaded saves no device memory over AdamW
    offloaded (its own temporaries can cost more), so a too-big low-bit offloaded plan must not rule
    out the AdamW one (Llama-2-7B on a 24 GB card: adamw4bit-ao offloaded 28.4 GiB, adamw 13.9 GiB)."""
    from memfit.planner.space import saves_no_more_than
    on_device = saves_no_more_than(Plan(optimizer="adamw"), Plan(optimizer="adamw8bit"), 1)
    offloaded = saves_no_more_than(Plan(optimizer="adamw", offload=["optimizer_states"]),
                                   Plan(optimizer="adamw8bit", offload=["optimizer_states"]), 1)
    assert on_device and not offloaded
    assert saves_no_more_than(Plan(optimizer="adamw8bit", offload=["optimizer_states"]),
                              Plan(optimizer="adamw8bit", offload=["optimizer_states"], checkpointing="blocks"), 1)


def test_the_default_optimizer_search_is_the_adamw_class_on_gpus(monkeypatch):
    """GPU presets: AdamW at every state precision (8-bit bitsandbytes, torchao 4-bit; torchao's 8-bit
    and fp8 only without bitsandbytes or when named: NOTE [ Same states, a slower update ]), and
    bitsandbytes' paged AdamW (8-bit and fp32: torchtune's recipe is in the default search); the
    CPU (real steps, torchao compiles its update first): adamw and adamw8bit. A torchao that cannot
    run here is left out with a note, never planned."""
    from memfit.devices import get_device
    from memfit.techniques import optimizers
    from memfit.techniques.base import SearchContext

    gpu, cpu = get_device("rtx4090"), get_device("cpu")
    ctx = SearchContext(model=None, device=gpu, batch_size=1)
    assert optimizers.search(ctx) == ["adamw", "adamw8bit", "adamw4bit-ao", "adamw8bit-paged", "adamw-paged"]
    assert ctx.notes == ["adamw8bit-ao, adamwfp8-ao left out: the same state bytes as adamw8bit (bitsandbytes) and a "
                         "slower update (a compiled call per parameter; measured on an H100); name them with "
                         "--optimizers to search them"]
    named = SearchContext(model=None, device=gpu, batch_size=1, options={"optimizers": optimizers.ADAMW_CLASS})
    assert optimizers.search(named) == list(optimizers.ADAMW_CLASS) and not named.notes
    assert optimizers.search(SearchContext(model=None, device=cpu, batch_size=1)) == ["adamw", "adamw8bit"]
    monkeypatch.setattr(optimizers, "bitsandbytes_available", lambda: False)
    with pytest.warns(UserWarning, match="adamw8bit, adamw8bit-paged, adamw-paged left out"):
        assert optimizers.search(SearchContext(model=None, device=gpu, batch_size=1)) == \
            ["adamw", "adamw8bit-ao", "adamw4bit-ao", "adamwfp8-ao"]  # (without bitsandbytes: torchao's are the 8-bit ones)
    monkeypatch.setattr(optimizers, "torchao_problem", lambda name: f"optimizer {name} needs torchao")
    with pytest.warns(UserWarning, match="adamw8bit, adamw8bit-paged, adamw-paged left out"):
        ctx = SearchContext(model=None, device=gpu, batch_size=1)
        assert optimizers.search(ctx) == ["adamw"]
    assert ctx.notes[1:] == [f"{n} left out: optimizer {n} needs torchao" for n in ("adamw8bit-ao", "adamw4bit-ao",
                                                                                   "adamwfp8-ao")]


def test_low_bit_states_are_not_searched_on_the_host_but_a_plan_may_fix_them():
    """NOTE [ Low-bit states on the host ]: torchao's update on host tensors is a slow compiled CPU
    kernel and its states save no device memory there, so the search leaves that combination out
    (low-bit states on the device stay); flags that fix exactly that combination still get it."""
    facts = model_facts(load_workload(SPEC, seq_len=64))
    space = default_space(facts, get_device("rtx4090"), 2, optimizers=("adamw", "adamw8bit-ao"))
    plans = candidates(space, 2)
    host = [p for p in plans if p.config("offload").states == "optimizer_states"]
    assert host and {p.optimizer for p in host} == {"adamw"}
    assert any(p.optimizer == "adamw8bit-ao" and p.config("offload").states is None for p in plans)
    assert any("adamw8bit-ao with offload: [optimizer_states] left out" in n for n in space.notes)
    space.values["optimizer"] = ["adamw8bit-ao"]
    space.values["offload"] = [("optimizer_states",)]
    fixed = candidates(space, 2)
    assert fixed and all(p.optimizer == "adamw8bit-ao" for p in fixed)
