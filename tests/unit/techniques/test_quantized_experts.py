"""``base_weights: nf4:experts=true``: a mixture of experts' 3-D expert weights quantized with bitsandbytes'
parametrization (NOTE [ Experts quantized as parametrizations ] in memfit.techniques.base_weights), predicted on
fake tensors as the profiler measures it, within NF4's stated error, and read from axolotl's
``quantize_moe_experts``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.techniques.base_weights import Quantized4bit
from memfit.techniques.quantized_experts import experts_3d_parameters
from memfit.workloads.small_configs import write_folder

bnb = pytest.importorskip("bitsandbytes")
warnings.filterwarnings("ignore", module="bitsandbytes")

LORA = "lora:r=8,targets=q_proj+v_proj"


@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_quantized_experts_are_predicted_within_1pct_of_the_profiler(checkpointing):
    """Each layer's experts dequantized whole while the layer runs and, unchecked, saved by its grouped matmul for
    backward: what the trace predicts is what the CPU's allocator events measure, with and without checkpointing.
    Under checkpointing the 4-bit codes save the experts' 16-bit bytes (independently: the parameters' category
    is the codes and scales, a quarter of the bf16 weights and a little). With checkpointing the CPU run holds a
    few KB more than predicted at its peak (8,240 B at 128, 256 and 512 rows on 2026-12-05; 4,656, 5,680-7,216 and
    7,728 B on 2026-12-06, the same configuration varying between runs: not found, a CPU run's, not on the path to a
    GPU's kernels), so the experts here are wide enough that it is under half a percent."""
    folder = write_folder("mixtral", intermediate_size=256, num_local_experts=8)
    base = dict(adapter=LORA, precision="bf16-pure", checkpointing=checkpointing)
    plan = Plan(base_weights="nf4:experts=true", **base)
    predicted = estimate(folder, plan, batch_size=2, seq_len=32)
    measured = profile(folder, plan, batch_size=2, seq_len=32, repeats=0)
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes
    plain = estimate(folder, Plan(base_weights="nf4", **base), batch_size=2, seq_len=32)
    experts = sum(p.numel() for _, p in _experts(folder))  # (bf16: 2 bytes each, 4 bits + a 64th of 4 bytes stored)
    saved = plain.breakdown["parameters"] - predicted.breakdown["parameters"]
    assert 2 * experts * (1 - 0.25 - 1 / 32) <= saved <= 2 * experts * (1 - 0.25), (saved, experts)
    if checkpointing == "blocks":
        assert predicted.peak_bytes < plain.peak_bytes


def test_an_experts_weight_reads_as_bitsandbytes_dequantizes_it_within_nf4s_error():
    """Lossy, with a stated bound: the weight a layer reads is bitsandbytes' NF4 round trip of the original, to the
    bit (the technique is bitsandbytes' own function), about 9% off in relative norm on a random weight (bound:
    12%); the layer's output, through two quantized weights (gate and up, then down), within 25% of the
    unquantized layer's (16% here)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = write_folder("mixtral")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    layer = model.model.layers[0].mlp.experts
    original = copy.deepcopy(layer)
    for module, name in experts_3d_parameters(layer):
        Quantized4bit("nf4", experts=True).quantize_expert(module, name)
    for _, name in experts_3d_parameters(original):
        full = getattr(original, name).data
        codes, state = bnb.functional.quantize_4bit(full, blocksize=64, quant_type="nf4")
        assert torch.equal(getattr(layer, name), bnb.functional.dequantize_4bit(codes, state))
        assert (getattr(layer, name) - full).norm() / full.norm() < 0.12
    hidden = torch.randn(16, model.config.hidden_size)
    top = torch.topk(torch.randn(16, layer.num_experts), 2)
    want = original(hidden, top.indices, top.values.softmax(-1))
    got = layer(hidden, top.indices, top.values.softmax(-1))
    assert (got - want).norm() / want.norm() < 0.25


def test_the_reports_count_the_experts_as_the_model_card_does_and_bad_uses_are_one_line():
    """The facts' parameter counts read the quantized experts in their own shape (they counted the packed codes:
    a 30.5B model came out at 16.0B, all active); experts=true on a model without 3-D experts, or with an adapter
    on the experts' parameters, is one line."""
    folder = write_folder("mixtral")
    plain = estimate(folder, Plan(base_weights="nf4", adapter=LORA), batch_size=2, seq_len=32)
    quantized = estimate(folder, Plan(base_weights="nf4:experts=true", adapter=LORA), batch_size=2, seq_len=32)
    assert quantized.facts[0] == plain.facts[0] and plain.facts[1].startswith("base weights: the experts' 3-D")
    assert not any(f.startswith("base weights:") for f in quantized.facts)
    with pytest.raises(UserError, match="no mixture of experts' 3-D expert weights to quantize"):
        estimate("gpt2:n_layer=1,n_embd=64,n_head=2", Plan(base_weights="nf4:experts=true"), batch_size=1, seq_len=16)
    with pytest.raises(UserError, match="params= .PEFT's target_parameters. can then not adapt"):
        Plan(base_weights="nf4:experts=true", adapter="lora:r=8,params=experts.gate_up_proj")
    assert Plan(base_weights="nf4:experts=true,double_quant=true").base_weights == "nf4:double_quant=true,experts=true"
    with pytest.raises(UserError, match="base_weights 'nf4:experts=true,experts=true' is not valid"):
        Plan(base_weights="nf4:experts=true,experts=true")


def test_axolotls_quantize_moe_experts():
    from memfit.integrations.axolotl import map_config
    card = get_device("h100-80gb")
    c = map_config({"base_model": "m", "adapter": "qlora", "load_in_4bit": True, "quantize_moe_experts": True,
                    "lora_mlp_kernel": False}, "c.yml", card)
    assert c.plan.base_weights == "nf4:double_quant=true,experts=true" and c.warnings == ()
    eight = map_config({"base_model": "m", "adapter": "lora", "load_in_8bit": True, "quantize_moe_experts": True},
                       "c.yml", card)
    assert eight.plan.base_weights == "int8" and "quantize_moe_experts without 4-bit weights" in eight.warnings[0]


def _experts(folder):
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return [(n, p) for n, p in model.named_parameters() if p.dim() >= 3]


def test_the_plan_written_for_axolotl_quantizes_the_experts_too():
    from memfit.integrations.axolotl_export import to_axolotl
    out = to_axolotl(Plan(base_weights="nf4:double_quant=true,experts=true", adapter="lora:r=16",
                          precision="bf16-base"), 1, "m", 2048)
    assert out.fields["load_in_4bit"] is True and out.fields["quantize_moe_experts"] is True
    from memfit.techniques.base import Export
    into = Export(batch_size=1)
    Plan(base_weights="nf4:experts=true").config("base_weights").export(into)
    assert "bitsandbytes.nn.parametrize.replace_parameter_4bit" in into.hf_notes[-1]


def test_a_mixture_of_experts_qlora_method_quantizes_its_experts():
    """NOTE [ A mixture of experts' QLoRA quantizes its experts ]: --methods and fit's qlora of a MoE take
    nf4:experts=true (a dense model's stays nf4), and the search counts what that adapter trains: the default
    targets adapt the experts where they are not quantized (PEFT's all-linear), not where they are (the count was
    the unquantized model's, and narrowed the search's optimizer choices on the wrong figure)."""
    from memfit.planner.methods import parse_methods, with_experts_quantized
    from memfit.planner.search import plan
    from memfit.workloads import load_workload
    folder = write_folder("mixtral")
    moe = load_workload(folder, seq_len=32)
    methods = with_experts_quantized(parse_methods("full,lora,qlora,qdora"), moe)
    assert [m.keys["base_weights"] for m in methods] == ["as-is", "as-is", "nf4:experts=true", "nf4:experts=true"]
    dense = load_workload("gpt2:n_layer=1,n_embd=64,n_head=2", seq_len=32)
    assert with_experts_quantized(parse_methods("qlora"), dense)[0].keys["base_weights"] == "nf4"
    fixed = {"adapter": "lora:r=8,targets=all-linear", "base_weights": "nf4:experts=true", "precision": "bf16-pure"}
    r = plan(folder, device="rtx4090", batch_size=2, seq_len=32, fixed=fixed, max_traces=4)
    adapted = estimate(folder, Plan(**fixed), batch_size=2, seq_len=32)
    assert f"{r.trainable:,} parameters trained" in next(f for f in adapted.facts if f.startswith("adapter:"))
