"""LyCORIS networks (memfit.techniques.lycoris_networks): trained as SimpleTuner's loop trains them, and predicted
as the profiler measures them.

The training claims are checked against a plain loop over the user's own ``create_lycoris`` network; the memory
claims against the profiler's allocator events, and against the factors' sizes counted here.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_run, peft_loop, run_steps
from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.plans import Plan

pytest.importorskip("lycoris")

LLAMA = ("llama:num_hidden_layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4,"
         "num_key_value_heads=4,vocab_size=1000")
DIT = ("dit-lumina2:num_layers=2,num_refiner_layers=1,hidden_size=64,num_attention_heads=4,num_kv_heads=2,"
       "cap_feat_dim=32,axes_dim_rope=8/4/4,multiple_of=16")


def _users_network(algo: str, dim: int, alpha: float, **kwargs):
    """SimpleTuner's: the model frozen, ``create_lycoris`` over it, ``apply_to``; the network's parameters train
    (each module registered under the layer it wraps, so that its parameters have the names memfit's have)."""
    def inject(model):
        from lycoris import create_lycoris
        model.requires_grad_(False)
        network = create_lycoris(model, 1.0, dim, alpha, algo=algo, **kwargs)
        network.apply_to()
        for module in network.loras:
            module.org_module[0].add_module("lycoris", module)
        return model
    return inject


@pytest.mark.parametrize("algo,dim,checkpointing", [("lokr", 10000, "none"), ("lokr", 4, "blocks"),
                                                    ("loha", 4, "blocks"), ("locon", 8, "none")])
def test_a_network_trains_as_the_users_lycoris_loop(algo, dim, checkpointing):
    """Same losses and weights, bit for bit, as a plain loop over the user's own network (LoKr with a full and a
    low-rank w2, LoHa through checkpointed blocks, LoCon); the network's parameters alone train."""
    plain_losses, plain_params = peft_loop(LLAMA, {}, inject=_users_network(algo, dim, 1.0, factor=4))
    plan = Plan(adapter=f"lycoris:algo={algo},dim={dim},alpha=1,factor=4", checkpointing=checkpointing)
    losses, params, step = run_steps(LLAMA, plan, batch_size=2)
    assert sorted(params[0]) == sorted(plain_params[0])
    assert_same_run(losses, params, plain_losses, plain_params)
    trained = [n for n, p in step.model.named_parameters() if p.requires_grad]
    assert trained and all(".lycoris." in n for n in trained)
    assert any(not torch.equal(params[-1][n], params[0][n]) for n in trained)


@pytest.mark.parametrize("adapter,precision,checkpointing", [
    ("lycoris:algo=lokr,dim=10000,factor=4", "fp32", "none"),
    ("lycoris:algo=lokr,dim=10000,factor=4,modules=Attention+FeedForward", "bf16-base", "blocks"),
    ("lycoris:algo=loha,dim=4", "bf16-base", "none"),
])
def test_a_network_of_a_dit_is_predicted_within_1pct_of_the_profiler(adapter, precision, checkpointing):
    """LoKr over every linear layer and over SimpleTuner's preset, LoHa."""
    from memfit.memory.measure import profile
    plan = Plan(adapter=adapter, precision=precision, checkpointing=checkpointing)
    r = profile(DIT, plan, batch_size=2, resolution=128, repeats=0)
    assert r.predicted.method == "fake"
    assert abs(r.error_percent) <= 1.0, (adapter, precision, checkpointing, r.error_percent)


def test_the_network_trains_in_fp32_over_a_16_bit_base_and_its_optimizer_states_are_its_own():
    """bf16-base: the base in bf16, the network made in fp32 (as the trainers make it); AdamW's two fp32 states of
    each of its parameters are the optimizer's bytes, counted from the factors' sizes: LoKr over Lumina's attention
    projections with dim 10000 keeps w2 full ([c, d] with w1 [a, b], each side split by 4). The report names the
    layers the network wraps and the parameters it trains."""
    from memfit.step import build_step
    from memfit.workloads import load_workload
    plan = Plan(adapter="lycoris:algo=lokr,dim=10000,factor=4,modules=Attention", precision="bf16-base")
    step = build_step(load_workload(DIT, resolution=128), plan, 2, "cpu")
    trained = [p for p in step.model.parameters() if p.requires_grad]
    assert trained and {p.dtype for p in trained} == {torch.float32}
    assert {p.dtype for p in step.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    report = estimate(DIT, plan, batch_size=2, resolution=128)
    assert report.breakdown["optimizer_states"] == pytest.approx(8 * sum(p.numel() for p in trained), abs=4096)
    wrapped = [n for n, m in step.model.named_modules() if n.endswith(".lycoris")]
    facts = [f for f in report.facts if f.startswith("adapter:")]
    assert wrapped and facts == [f"adapter: {len(wrapped)} layers adapted (" + facts[0].split(" (", 1)[1]], facts
    assert facts[0].endswith(f"; {sum(p.numel() for p in trained):,} parameters trained")


@pytest.mark.parametrize("text,problem", [
    ("lycoris:algo=lokq", "algo 'lokq' is not one of LyCORIS's"),
    ("lycoris:algo=lokr,dim=0", "dim must be a whole number >= 1"),
    ("lycoris:algo=lokr,rank=4", "option 'rank=4' is not valid; use algo="),
    ("lycoris:algo=lokr,dim=four", "dim=four is not a number"),
    ("lycoris:algo=lokr,modules=Nothing", "LyCORIS wraps no module of the model"),
    ("lycoris:algo=boft,dim=4", "LyCORIS refuses it on this model .*impossible to decompose 1000"),  # (the head)
    ("lycoris:algo=lokr;fp8", "over base_weights fp8: LyCORIS knows memfit's fp8"),  # (a real CPU run fails there)
    ("lycoris:algo=lokr;nf4", "over base_weights nf4"),
])
def test_bad_networks_get_one_line(text, problem):
    text, _, base = text.partition(";")
    with pytest.raises(UserError, match=problem) as e:
        estimate(LLAMA, Plan(adapter=text, base_weights=base or "as-is"), batch_size=2, seq_len=32)
    assert "\n" not in str(e.value)


def test_the_preset_is_put_back_and_the_text_round_trips():
    """``modules=`` sets LyCORIS's class-level preset for one network, then puts back what was there (a later
    network of the process takes LyCORIS's default again)."""
    from lycoris import LycorisNetwork
    before = list(LycorisNetwork.TARGET_REPLACE_MODULE)
    estimate(DIT, Plan(adapter="lycoris:algo=lokr,dim=4,modules=Attention"), batch_size=1, resolution=64)
    assert LycorisNetwork.TARGET_REPLACE_MODULE == before
    plan = Plan(adapter="lycoris:algo=LoKr,dim=16,alpha=2,factor=8,modules=Attention+FeedForward")
    assert plan.adapter == "lycoris:algo=lokr,dim=16,alpha=2,factor=8,modules=Attention+FeedForward"
    assert Plan.from_dict(plan.to_dict()) == plan


def test_over_8_bit_base_weights_lycoris_runs_its_bypass_form_as_measured():
    """bitsandbytes' 8-bit layers are one of LyCORIS's quantized layers: its bypass form over them, within 1%."""
    from helpers import measured
    r = measured(LLAMA, Plan(adapter="lycoris:algo=lokr,dim=4,factor=4", base_weights="int8", precision="bf16-base"),
                 batch_size=2)
    assert r.predicted.method == "fake" and abs(r.error_percent) <= 1.0, r.error_percent
