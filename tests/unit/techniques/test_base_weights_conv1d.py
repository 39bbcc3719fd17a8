"""base_weights on GPT-2, whose projections are transformers' ``Conv1D`` (NOTE [ GPT-2's Conv1D ] in
memfit.techniques.base_weights): quantized as transformers' bitsandbytes integration quantizes them."""

from __future__ import annotations

import warnings

import pytest
import torch

from memfit.memory.faketrace import run_tracked
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.target import Target
from memfit.workloads import load_workload

bnb = pytest.importorskip("bitsandbytes")
warnings.filterwarnings("ignore", module="bitsandbytes")

GPT2 = "gpt2:n_layer=2,n_embd=128,n_head=4,vocab_size=256,n_positions=64"


def _layers(model) -> dict[str, tuple[int, int]]:
    return {n.replace(".base_layer", ""): (m.out_features, m.in_features) for n, m in model.named_modules()
            if isinstance(m, bnb.nn.Linear4bit)}


def test_gpt2s_conv1d_layers_are_the_layers_transformers_quantizes():
    """Every Conv1D (c_attn, c_proj, c_fc, mlp.c_proj), as a 4-bit layer of the same features; the output
    layer stays. transformers' replace_with_bnb_linear on the same model makes the same layers. Before,
    ``--base-weights nf4`` on GPT-2 was refused ("found no nn.Linear layer")."""
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    theirs = replace_with_bnb_linear(load_workload(GPT2).model(), modules_to_not_convert=["lm_head"],
                                     quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    for fake in (True, False):
        model = run_tracked(Target.resolve(GPT2, Plan(base_weights="nf4"), 1, seq_len=32), fake=fake, steps=0).step.model
        assert _layers(model) == _layers(theirs) and len(_layers(model)) == 8
        assert type(model.lm_head) is torch.nn.Linear


def test_a_quantized_conv1d_computes_what_the_conv1d_computes_within_nf4s_error():
    """Each 4-bit layer's output against the Conv1D it replaced, the same weights (relative L2 error; nf4
    gives 0.09 on a 128 -> 256 linear, test_base_weights): the weight went in transposed, not reshaped."""
    torch.manual_seed(0)
    original = load_workload(GPT2).model()
    convs = {n: m for n, m in original.named_modules() if type(m).__name__ == "Conv1D"}
    from memfit.techniques.base_weights import _quantize_linears, parse
    quantized = load_workload(GPT2).model()
    quantized.load_state_dict(original.state_dict())
    _quantize_linears(quantized, parse({"base_weights": "nf4"}), "nf4")
    for name, conv in convs.items():
        layer = quantized.get_submodule(name)
        x = torch.randn(3, conv.weight.shape[0])
        want = conv(x)
        error = ((layer(x) - want).norm() / want.norm()).item()
        assert 0 < error < 0.12, (name, error)


def test_a_gpt2_qlora_is_predicted_within_1_percent_of_the_profiler():
    """LoRA on c_attn over 4-bit Conv1D layers, a step on this CPU: the profiler's peak against the
    prediction."""
    r = profile(GPT2, Plan(base_weights="nf4", adapter="lora:r=8"), batch_size=2, repeats=0, seq_len=32)
    assert abs(r.error_percent) < 1.0, (r.predicted_peak_bytes, r.peak_bytes)
