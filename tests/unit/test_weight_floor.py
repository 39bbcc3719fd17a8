"""NOTE [ Plans whose weights alone exceed the budget ]: each candidate is weighed by the weights it keeps on
the device before it is traced; the weight is never above what the plan's trace allocates at its peak, and a
search leaves out the plans over the budget by it, choosing what it chose before."""

import pytest

from memfit.memory.estimate import estimate
from memfit.planner.space import model_facts
from memfit.planner.weight_floor import WeightFloor
from memfit.plans import Plan
from memfit.workloads import load_workload

LLAMA = ("llama:hidden_size=256,intermediate_size=512,num_hidden_layers=4,num_attention_heads=4,"
         "num_key_value_heads=4,vocab_size=512,max_position_embeddings=128")
LORA = "lora:r=4"


@pytest.mark.parametrize("fields", [
    dict(precision="bf16"), dict(precision="bf16-pure"), dict(precision="fp32"),
    dict(adapter=LORA, precision="bf16"), dict(adapter=LORA, precision="bf16-pure", swap_blocks=2),
    dict(adapter=LORA, precision="bf16", swap_blocks=4), dict(adapter=LORA, base_weights="nf4", precision="bf16-pure"),
    dict(adapter=LORA, base_weights="fp8", precision="bf16", swap_blocks=2),
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_the_weight_of_a_plan_is_at_most_its_traced_peak(fields):
    wl = load_workload(LLAMA, seq_len=32)
    plan = Plan(**fields)
    floor = WeightFloor(model_facts(wl).model).bytes(plan)
    r = estimate(LLAMA, plan, batch_size=2, seq_len=32, device="rtx4090")
    assert 0.5 * r.breakdown["parameters"] <= floor <= r.peak_bytes, (floor, r.breakdown["parameters"], r.peak_bytes)
    if not fields.get("swap_blocks") and fields.get("base_weights") is None:  # (all on the device, no scales)
        assert floor == r.breakdown["parameters"] if "adapter" not in fields else floor < r.breakdown["parameters"]


def test_a_search_leaves_out_the_plans_its_weights_rule_out_and_chooses_as_before(monkeypatch):
    """LoRA of a Llama of 1024 wide in 120 MiB beside the CUDA context: its weights take 82 MiB in 16 bits and
    164 in fp32, so the plans that keep fp32 weights (autocast, fp32) are not traced; the search chooses what it
    chose with them traced."""
    from memfit.devices import get_device
    from memfit.planner import search as search_module
    from memfit.planner.search import plan
    spec = LLAMA.replace("hidden_size=256,intermediate_size=512", "hidden_size=1024,intermediate_size=2048")
    room = 120 * 2**20
    kw = dict(budget=get_device("rtx4090").context_bytes + room, device="rtx4090", batch_size=2, seq_len=32,
              fixed={"adapter": LORA, "swap_blocks": 0, "offload": []}, optimizers=("adamw",), compile_modes=("none",))
    floor = WeightFloor(model_facts(load_workload(spec, seq_len=32)).model)
    pruned = plan(spec, **kw)
    assert any("plans left out: their weights alone" in n for n in pruned.notes), pruned.notes
    assert all(floor.bytes(c.plan) <= room for c in pruned.candidates)
    monkeypatch.setattr(search_module, "leave_out_heavier_than", lambda plans, *a: plans)
    whole = plan(spec, **kw)
    assert any(floor.bytes(c.plan) > room for c in whole.candidates)
    assert pruned.chosen is not None and pruned.chosen.plan == whole.chosen.plan
