"""Memory techniques and methods on a mixture of experts hold as on a dense model: each run for real
within 1% of its prediction (the profiler's allocator events, independent of memfit's tracker)."""

import pytest

from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads.small_configs import write_folder

EXPERTS = "experts.gate_up_proj+experts.down_proj"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe")
    return {name: write_folder(name, base) for name in ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")}


CASES = [
    ("mixtral", Plan()),
    ("qwen2_moe", Plan(precision="bf16", checkpointing="blocks", adapter=f"lora:r=8,params={EXPERTS}")),
    ("deepseek_v3", Plan(precision="bf16-pure", checkpointing="blocks", adapter="lora:r=8,targets=q_b_proj+kv_b_proj")),
    ("gpt_oss", Plan(checkpointing="blocks", adapter="lora:r=8,targets=q_proj+v_proj")),
    ("mixtral", Plan(base_weights="nf4", adapter=f"lora:r=8,params={EXPERTS}")),  # QLoRA
]


@pytest.mark.parametrize("name,plan", CASES, ids=[f"{n}-{p.describe()}" for n, p in CASES])
def test_runs_for_real_within_one_percent(folders, name, plan):
    r = profile(folders[name], plan, batch_size=2, seq_len=64, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, (r.predicted_peak_bytes, r.peak_bytes)


def test_lora_on_the_experts_trains_their_adapters_only(folders):
    full = estimate(folders["mixtral"], Plan(), batch_size=2, seq_len=64)
    experts = estimate(folders["mixtral"], Plan(adapter=f"lora:r=8,params={EXPERTS}"), batch_size=2, seq_len=64)
    attention = estimate(folders["mixtral"], Plan(adapter="lora:r=8"), batch_size=2, seq_len=64)
    assert attention.breakdown["optimizer_states"] < experts.breakdown["optimizer_states"] \
        < full.breakdown["optimizer_states"] / 2


def test_fsdp2_shards_the_experts(folders):
    one = estimate(folders["qwen2_moe"], Plan(precision="bf16-pure"), batch_size=2, seq_len=64, device="h100")
    two = estimate(folders["qwen2_moe"], Plan(precision="bf16-pure", world_size=2), batch_size=2, seq_len=64,
                   device="h100")
    # (each rank holds half of every weight's rows, padded to the world size: a little over half)
    assert one.breakdown["optimizer_states"] / 2 <= two.breakdown["optimizer_states"] \
        < 0.55 * one.breakdown["optimizer_states"]
