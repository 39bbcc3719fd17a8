"""LoKr adapters (memfit.techniques.lokr): PEFT's LoKr layer, and ai-toolkit's factored forward over it.

The training claims are checked against a plain loop over the user's own PEFT model; the memory claims against the
profiler's allocator events (``measured``), and against the sizes of the layers adapted, counted here.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_run, measured, peft_loop, run_steps
from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.step import build_step
from memfit.techniques.lokr import factored_forward
from memfit.workloads import load_workload

pytest.importorskip("peft")

LLAMA = ("llama:num_hidden_layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4,"
         "num_key_value_heads=4,vocab_size=1000")


@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_lokr_trains_as_the_users_peft_loop(checkpointing):
    """Same losses and weights, bit for bit, as a plain loop over ``inject_adapter_in_model(LoKrConfig(...))``."""
    from peft import LoKrConfig
    kwargs = dict(r=4, alpha=8, decompose_factor=4, target_modules=["q_proj", "v_proj", "down_proj"])
    plain_losses, plain_params = peft_loop(LLAMA, kwargs, config=LoKrConfig)
    plan = Plan(adapter="lokr:r=4,alpha=8,factor=4,targets=q_proj+v_proj+down_proj", checkpointing=checkpointing)
    losses, params, step = run_steps(LLAMA, plan, batch_size=2)
    assert_same_run(losses, params, plain_losses, plain_params)
    trained = {n for n, p in step.model.named_parameters() if p.requires_grad}
    assert trained and all("lokr_w" in n for n in trained)
    assert any(not torch.equal(params[-1][n], params[0][n]) for n in trained)


@pytest.mark.parametrize("r,decompose_both", [(4, False), ("full", False), (2, True)])
def test_the_factored_forward_is_peft_layers_function(r, decompose_both):
    """ai-toolkit's forward (``factored=1``) computes PEFT's layer's output and gradients (float64: to rounding),
    for a low-rank w2, a full w2, and both factors low-rank."""
    from peft import LoKrConfig, inject_adapter_in_model
    torch.manual_seed(0)
    rank = 10**6 if r == "full" else r
    model = torch.nn.Sequential(torch.nn.Linear(96, 48)).double()
    model = inject_adapter_in_model(LoKrConfig(r=rank, alpha=rank, target_modules=["0"], decompose_both=decompose_both,
                                               init_weights=False), model).double()
    layer, x = model[0], torch.randn(3, 5, 96, dtype=torch.float64)
    trained = [p for p in model.parameters() if p.requires_grad]
    peft_out, ours = layer(x), factored_forward(layer, x)
    assert torch.allclose(peft_out, ours, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(peft_out.square().sum(), trained),
                    torch.autograd.grad(ours.square().sum(), trained)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_factored_training_follows_peft_layers_within_rounding():
    """Three AdamW steps of ``factored=1`` against PEFT's layer, fp32: losses within 1e-5 relative (another order of
    the same sums), and the factored step's layers call ai-toolkit's forward."""
    adapter = "lokr:r=4,alpha=8,factor=4,targets=q_proj+v_proj+down_proj"
    peft_losses, _, _ = run_steps(LLAMA, Plan(adapter=adapter), batch_size=2)
    losses, _, step = run_steps(LLAMA, Plan(adapter=adapter + ",factored=1"), batch_size=2)
    assert losses == pytest.approx(peft_losses, rel=1e-5)
    layers = [m for m in step.model.modules() if hasattr(m, "lokr_w1")]
    assert len(layers) == 6 and all(m.forward.__func__ is factored_forward for m in layers)


@pytest.mark.parametrize("adapter,precision,checkpointing", [
    ("lokr:r=8,factor=4", "fp32", "none"),
    ("lokr:r=full,factor=8,targets=all-linear", "bf16-base-noautocast", "none"),
    ("lokr:r=full,factor=8,targets=all-linear,factored=1", "bf16-base-noautocast", "none"),
    pytest.param("lokr:r=4,decompose_both=1,targets=all-linear,factored=1", "bf16-base", "blocks",
                 marks=pytest.mark.slow),  # (6 s: the nf4 case checkpoints the factored forward in the default suite)
    ("lokr:r=full,factor=8,targets=all-linear,factored=1;nf4", "bf16-base-noautocast", "blocks"),
])
def test_lokr_prediction_within_1pct_of_the_profiler(adapter, precision, checkpointing):
    """PEFT's and the factored forward, each over bf16 base weights; the factored one also over 4-bit base weights
    (ai-toolkit's 4-bit qtypes: its forward never shapes the update as the packed weight)."""
    adapter, _, base = adapter.partition(";")
    plan = Plan(adapter=adapter, precision=precision, checkpointing=checkpointing, base_weights=base or "as-is")
    r = measured(LLAMA, plan, batch_size=2)
    assert r.predicted.method == "fake"
    assert abs(r.error_percent) <= 1.0, (adapter, precision, checkpointing, r.error_percent)


def test_peft_layers_keep_a_weight_sized_update_for_the_backward_and_the_factored_forward_does_not():
    """PEFT's LoKr multiplies the input by the whole update, which autograd keeps per adapted layer (fp32 beside a
    bf16 base): the factored forward's activations are smaller by the adapted layers' weights in fp32, counted here
    from the layers' sizes, within 2% (what each keeps of its own besides: PEFT's fp32 copy of the input, the
    factored forward's [tokens, in_m, out_k] intermediates)."""
    plan = dict(precision="bf16-base-noautocast", checkpointing="none")
    adapter = "lokr:r=full,factor=8,targets=all-linear"
    peft = estimate(LLAMA, Plan(adapter=adapter, **plan), batch_size=2, seq_len=64)
    factored = estimate(LLAMA, Plan(adapter=adapter + ",factored=1", **plan), batch_size=2, seq_len=64)
    step = build_step(load_workload(LLAMA, seq_len=64), Plan(adapter=adapter), 2, "cpu")
    weights = sum(m.get_base_layer().weight.numel() for m in step.model.modules() if hasattr(m, "lokr_w1"))
    kept = peft.breakdown["activations"] - factored.breakdown["activations"]
    assert abs(kept - 4 * weights) <= 0.02 * 4 * weights, (kept, weights)


def test_lokr_text_round_trips_and_the_report_names_its_layers():
    plan = Plan(adapter="lokr:r=full,factor=16,decompose_both=1,factored=1,targets=q_proj+v_proj,skip=layers.1.")
    assert plan.adapter == "lokr:r=full,targets=q_proj+v_proj,skip=layers.1.,factor=16,decompose_both=1,factored=1"
    assert Plan.from_dict(plan.to_dict()) == plan
    report = estimate(LLAMA, Plan(adapter="lokr:r=4"), batch_size=1, seq_len=16)
    # (Llama's q_proj and v_proj [128, 128]: factors 8 x 16 each side; w1 [8, 8], w2 low-rank: [16, 4] and [4, 16])
    assert "adapter: 4 layers adapted (self_attn.q_proj x2, self_attn.v_proj x2); 768 parameters trained" in report.facts


def test_peft_layers_over_4_bit_base_weights_are_one_line():
    """PEFT's LoKr layer reshapes its update to the base weight's shape, which bitsandbytes packs two to a byte (a
    user's PEFT model fails there too): one line naming the factored forward, 8-bit base weights and LoRA."""
    from memfit.errors import UserError
    with pytest.raises(UserError, match="use lokr:...,factored=1") as e:
        estimate(LLAMA, Plan(adapter="lokr:r=4", base_weights="nf4"), batch_size=2, seq_len=32)
    assert "\n" not in str(e.value)


def test_a_workload_that_adds_a_peft_loha_itself_is_traced_as_written(tmp_workload_file):
    """diffusers' ``add_adapter`` of a PEFT LoHa (no plan key): its layers apply their update where ``torch.rand(1) >
    module_dropout``, which a fake trace knows is true (before, the update was assumed skipped and the loss had no
    gradient); predicted within 1% of the profiler."""
    pytest.importorskip("diffusers")
    from memfit.memory.measure import profile
    dit = ("dit-lumina2:num_layers=2,num_refiner_layers=1,hidden_size=64,num_attention_heads=4,num_kv_heads=2,"
           "cap_feat_dim=32,axes_dim_rope=8/4/4,multiple_of=16")
    body = f'''
from peft import LoHaConfig
from memfit.workload import Workload
from memfit.workloads import load_workload

base = load_workload({dit!r}, resolution=128)

def model():
    m = base.model()
    m.requires_grad_(False)
    m.add_adapter(LoHaConfig(r=4, alpha=4, target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    return m

wl = Workload(model=model, batch=base.batch, loss=lambda m, b: base.loss(m, b))
'''
    r = profile(f"{tmp_workload_file(body)}:wl", Plan(), batch_size=2, repeats=0)
    assert r.predicted.method == "fake" and r.predicted.breakdown["optimizer_states"] > 0
    assert abs(r.error_percent) <= 1.0, r.error_percent
