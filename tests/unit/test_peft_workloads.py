"""PEFT models as users build them, inside the workload's own model(): predicted exactly (measured
by the profiler), with the frozen base weights' gradients absent, and checkpointed with frozen
inputs through Hugging Face's reentrant and non-reentrant paths."""

from __future__ import annotations

import pytest

from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.step import build_step
from memfit.workloads import load_workload

pytest.importorskip("peft")

HEADER = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model, inject_adapter_in_model
from memfit.workload import Workload

cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])

def batch(bs):
    return torch.randint(0, 1000, (bs, 32))

def loss(m, b):
    return m(input_ids=b, labels=b).loss
"""

BUILDS = {
    "get_peft_model": "m = get_peft_model(LlamaForCausalLM(cfg), lora)",
    "inject_adapter_in_model": "m = inject_adapter_in_model(lora, LlamaForCausalLM(cfg))",
    "reentrant-checkpointing": (
        "m = get_peft_model(LlamaForCausalLM(cfg), lora)\n"
        "    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': True})\n"
        "    m.enable_input_require_grads()"),
    "non-reentrant-checkpointing": (
        "m = get_peft_model(LlamaForCausalLM(cfg), lora)\n"
        "    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})"),
}


def _workload(tmp_workload_file, build: str):
    body = HEADER + f"\ndef model():\n    {BUILDS[build]}\n    return m\n\nwl = Workload(model=model, batch=batch, loss=loss)\n"
    return f"{tmp_workload_file(body)}:wl"


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_user_built_peft_models_are_predicted_within_1pct(tmp_workload_file, build):
    r = profile(_workload(tmp_workload_file, build), Plan(), batch_size=2, repeats=0)
    assert abs(r.error_percent) <= 1.0, (build, r.error_percent)
    assert r.predicted.breakdown["optimizer_states"] < 200_000  # adapters only (16k parameters: 128 KiB)


@pytest.mark.parametrize("build", ["reentrant-checkpointing", "non-reentrant-checkpointing"])
def test_checkpointing_with_frozen_inputs_still_trains_the_adapter(tmp_workload_file, build):
    """Frozen embeddings give the first block an input that needs no grad: reentrant checkpointing
    then drops the adapters' gradients unless PEFT's enable_input_require_grads is on."""
    plain = build_step(load_workload(_workload(tmp_workload_file, "get_peft_model")), Plan(), 2, "cpu")
    ckpt = build_step(load_workload(_workload(tmp_workload_file, build)), Plan(), 2, "cpu")
    ckpt.model.load_state_dict(plain.model.state_dict())
    import torch
    torch.manual_seed(3)
    batch = torch.randint(0, 1000, (2, 32))
    for step in (plain, ckpt):
        step.model.eval()  # no dropout: the two runs see the same function
        step.zero_grad()
        step.forward_backward(batch)
    grads = {n: p.grad for n, p in plain.model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    for n, p in ckpt.model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7, msg=n)
        else:
            assert p.grad is None, n
