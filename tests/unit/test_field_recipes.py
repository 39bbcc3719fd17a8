"""The field's recipes (memfit.planner.field_recipes): which suit a workload, and the planner
predicting torchtune's full fine-tuning recipe with its own traces, its paged states' migration
priced, beside the plan it chooses."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from memfit.devices import get_device
from memfit.memory.estimate import estimate
from memfit.planner import field_recipes
from memfit.planner.candidate import Candidate, Status
from memfit.planner.field_recipes import RECIPES, field_plans, settle_recipes
from memfit.planner.search import plan
from memfit.plans import Plan
from memfit.workloads import load_workload

LLAMA = ("llama:num_hidden_layers=2,hidden_size=256,intermediate_size=688,num_attention_heads=4,"
         "num_key_value_heads=4,vocab_size=1000")
TEXT = SimpleNamespace(info=SimpleNamespace(seq_len=64, resolution=None))
IMAGES = SimpleNamespace(info=SimpleNamespace(seq_len=None, resolution=512))
OFFERED = {"checkpointing": ["none", "blocks"], "loss_chunks": [0, 8]}
GPU = get_device("rtx4090")


def _names(workload, given, offered=OFFERED, device=GPU) -> dict:
    plans, notes = field_plans(workload, given, offered, device)
    return {recipe.name: p for p, recipe in plans.items()}


def test_each_method_gets_the_recipes_published_for_it():
    full = _names(TEXT, {})
    assert list(full) == ["torchtune full (1 GPU)"]
    assert full["torchtune full (1 GPU)"] == Plan(precision="bf16-pure", checkpointing="blocks", optimizer="adamw8bit-paged",
                                                 optimizer_in_backward=True, compile="blocks", loss_chunks=8)
    lora = _names(TEXT, {"adapter": "lora:r=8"})
    assert list(lora) == ["torchtune LoRA (1 GPU)", "Unsloth (1 GPU)"] and lora["torchtune LoRA (1 GPU)"].adapter == "lora:r=8"
    assert lora["Unsloth (1 GPU)"] == Plan(adapter="lora:r=8", precision="bf16-pure", checkpointing="blocks",
                                          offload=["activations"], optimizer="adamw8bit", loss_chunks=8)
    qlora = _names(TEXT, {"adapter": "lora:r=8", "base_weights": "nf4"})
    assert sorted(qlora) == ["QLoRA paper (HF Trainer)", "Unsloth (1 GPU)", "torchtune QLoRA (1 GPU)"]
    assert all(p.base_weights == "nf4" for p in qlora.values())  # (the user's model and adapter stay theirs)
    assert list(_names(IMAGES, {"adapter": "lora:r=8"})) == ["kohya sd-scripts LoRA"]
    assert _names(IMAGES, {}) == {}  # (no published full fine-tuning recipe for images here)
    assert _names(TEXT, {}, device=get_device("cpu")) == {}  # (paged states and the GPU's kernels: GPU presets only)
    assert _names(TEXT, {}, offered={"checkpointing": ["none", "blocks"], "loss_chunks": [0]}) == {}  # (no causal LM)
    assert field_plans(TEXT, {}, OFFERED, GPU, n_params=124_000_000) == ({}, [])  # (published from 1B parameters)
    assert list(field_plans(TEXT, {}, OFFERED, GPU, n_params=8 * 10**9)[0].values()) == [RECIPES[0]]


def test_values_the_model_cannot_take_are_dropped_and_a_contradicted_recipe_is_left_out():
    no_blocks = _names(TEXT, {"adapter": "lora:r=8"}, offered={"checkpointing": ["none"], "loss_chunks": [0, 8]})
    assert no_blocks["torchtune LoRA (1 GPU)"] == Plan(adapter="lora:r=8", precision="bf16-pure", loss_chunks=8)
    plans, notes = field_plans(TEXT, {"precision": "fp32"}, OFFERED, GPU)
    assert plans == {} and notes == ["torchtune full (1 GPU) not planned: it sets precision, which you fixed"]
    assert all(r.source for r in RECIPES)
    budget = {"compile": "full", "checkpointing": "budget:0.5"}  # (a budget alone is no plan: it needs compile)
    plans, notes = field_plans(TEXT, budget, OFFERED, GPU)
    assert plans == {} and notes == ["torchtune full (1 GPU) not planned: it sets checkpointing, compile, which you fixed"]


def test_a_recipe_predicted_faster_that_fits_is_chosen_instead():
    """settle_recipes: the walk's chosen plan gives way to a recipe that the walk left open and that
    fits and is faster once measured; a slower one stays open."""
    class Walk:
        def settle(self, c, chosen):
            return c if c.seconds < chosen.seconds else None

    chosen = Candidate(Plan(checkpointing="blocks"), 2.0)
    chosen.choose()
    fast, slow = Candidate(Plan(precision="bf16-pure"), 1.0), Candidate(Plan(precision="bf16"), 3.0)
    assert settle_recipes(Walk(), [slow, fast], chosen) is fast
    assert fast.status is Status.CHOSEN and chosen.open and slow.open


def _large_elements() -> list[int]:
    with torch.device("meta"):
        model = load_workload(LLAMA, seq_len=64).model()
    return [p.numel() for p in model.parameters() if p.requires_grad and p.numel() >= 100_000]


@pytest.mark.slow  # (keeps the default suite under 10 minutes on 2 cores); planning the 8B recipe: ~35 s
def test_torchtune_full_recipe_is_listed_with_its_paged_states_migration_priced(monkeypatch):
    """A budget with room for the recipe's allocator side but for only half its paged 8-bit states:
    the recipe fits (the rest pages), is predicted from its own traces, and its time carries every
    managed byte in and out over the host link (NOTE [ Pages that migrate ]); the plan chosen is
    predicted no slower."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(field_recipes, "RECIPES", tuple(dataclasses.replace(r, min_params=0) for r in RECIPES))  # (a small model)
    recipe_plan = next(iter(field_plans(TEXT, {}, OFFERED, GPU)[0]))
    managed = 2 * sum(_large_elements())  # (two 8-bit moments per element, from the meta model)
    r = estimate(LLAMA, recipe_plan, batch_size=2, seq_len=64, device="rtx4090")
    assert r.managed_bytes == managed
    budget = r.reserved_bytes + r.cuda_context_bytes + managed // 2
    result = plan(LLAMA, budget=budget, device="rtx4090", batch_size=2, seq_len=64, max_traces=30)
    (recipe,) = [c for c in result.candidates if c.recipe is not None]
    assert recipe.plan == recipe_plan and recipe.managed_bytes == managed
    assert recipe.status in (Status.SLOWER, Status.CHOSEN) and recipe.used_bytes is not None
    seconds = 2 * managed / GPU.host_link_bandwidth
    assert any(f"{seconds * 1e3:.0f} ms" in note for note in recipe.time_notes), recipe.time_notes
    assert result.chosen is not None and result.chosen.seconds <= recipe.seconds
    row = result.to_json()["field_recipes"][0]
    assert row["recipe"] == "torchtune full (1 GPU)" and row["managed_bytes"] == managed


def test_a_recipe_is_traced_whatever_the_estimate_says(monkeypatch):
    """NOTE [ A recipe is never ruled out by an estimate ]: with every estimate far over the budget (as
    savings measured alone gave torchtune's recipe for Llama-3-8B sizes: 29.40 GiB, where its own traces
    fit 21.28), the plans of the space are ruled out untraced and the recipe is still traced."""
    from memfit.planner import gpu_ladder
    from memfit.planner.candidate import Evidence, Fidelity
    monkeypatch.setattr(field_recipes, "RECIPES", tuple(dataclasses.replace(r, min_params=0) for r in RECIPES))  # (a small model)
    monkeypatch.setattr(gpu_ladder.Estimate, "evaluate", lambda self, plan: Evidence(Fidelity.ESTIMATE, used_bytes=1 << 50))
    result = plan(LLAMA, budget="8GiB", device="rtx4090", batch_size=2, seq_len=64, max_traces=12)
    recipes = [c for c in result.candidates if c.recipe is not None]
    assert recipes and all(c.used_bytes is not None and "estimated to need" not in c.reason for c in recipes)
    assert any("estimated to need" in c.reason for c in result.candidates if c.recipe is None)  # (the others were)


def test_unsloths_recipe_keeps_each_checkpointed_blocks_input_on_the_host_and_is_planned_beside_the_search(monkeypatch):
    """Unsloth's offloaded gradient checkpointing is blocks with their inputs on the host: against
    torchtune's LoRA recipe (blocks on the device) the device's activations at the peak are every
    block's input (bf16, batch x seq x hidden, counted here from the model's sizes) fewer, the host
    holds at least those, and the planner traces the recipe."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(field_recipes, "RECIPES", tuple(dataclasses.replace(r, min_params=0) for r in RECIPES))  # (a small model)
    lora = _names(TEXT, {"adapter": "lora:r=8"})
    unsloth, torchtune = (estimate(LLAMA, lora[name], batch_size=2, seq_len=64, device="rtx4090")
                          for name in ("Unsloth (1 GPU)", "torchtune LoRA (1 GPU)"))
    block_inputs = 2 * (2 * 64 * 256 * 2)  # (2 blocks x batch 2 x 64 tokens x 256 wide x 2 bytes)
    assert unsloth.host_peak_bytes - torchtune.host_peak_bytes >= block_inputs
    assert torchtune.breakdown["activations"] - unsloth.breakdown["activations"] == block_inputs  # (at the peak)
    result = plan(LLAMA, budget="8GiB", device="rtx4090", batch_size=2, seq_len=64, max_traces=12,
                  fixed={"adapter": "lora:r=8"})
    (row,) = [c for c in result.candidates if c.recipe is not None and c.recipe.name == "Unsloth (1 GPU)"]
    assert row.plan == lora["Unsloth (1 GPU)"] and row.used_bytes is not None and row.seconds > 0
