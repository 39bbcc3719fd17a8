"""Optimizer variants and optimizer-in-backward."""

import builtins
import warnings

import pytest
import torch

from helpers import GPT2_DROPOUT, assert_same_training, measured, run_steps
from memfit.plans import Plan
from memfit.step import build_step
from memfit.techniques.in_backward import OptimizerInBackward
from memfit.techniques.optimizers import adamw8bit_factory

SPEC = "gpt2:n_layer=2,n_embd=128,n_head=4,vocab_size=1000,n_positions=128"


def test_in_backward_trains_exactly_like_the_optimizer_after_backward():
    base = run_steps(GPT2_DROPOUT, Plan())
    inbw = run_steps(GPT2_DROPOUT, Plan(optimizer_in_backward=True))
    assert_same_training(base, inbw, exact=True)
    assert isinstance(inbw[2].optimizer, OptimizerInBackward)


def _grads_when_backward_ends(plan):
    from memfit.workloads import load_workload
    wl = load_workload(GPT2_DROPOUT, seq_len=64)
    step = build_step(wl, plan, 4, "cpu")
    seen = {}
    orig = step.scaler.step
    step.scaler.step = lambda opt: (seen.update(n=sum(p.grad is not None for p in step.model.parameters())),
                                    orig(opt))
    step(wl.batch(4))
    return seen["n"], len(list(step.model.parameters()))


def test_in_backward_frees_gradients_during_backward():
    n_grads, n_params = _grads_when_backward_ends(Plan())
    assert n_grads == n_params
    assert _grads_when_backward_ends(Plan(optimizer_in_backward=True))[0] == 0  # each freed in backward
    heavy = "gpt2:n_layer=2,n_embd=256,n_head=4,vocab_size=8000,n_positions=64"  # weights dominate
    base = measured(heavy, Plan(), seq_len=16, batch_size=2)
    inbw = measured(heavy, Plan(optimizer_in_backward=True), seq_len=16, batch_size=2)
    assert inbw.peak_bytes < 0.95 * base.peak_bytes, (inbw.peak_bytes, base.peak_bytes)
    assert abs(inbw.error_percent) <= 1.0


@pytest.mark.parametrize("name", [pytest.param("sgd", marks=pytest.mark.slow), "adafactor", "adamw8bit"])
def test_variant_state_memory_and_training(name):
    base = measured(SPEC, Plan())
    r = measured(SPEC, Plan(optimizer=name))
    assert abs(r.error_percent) <= 1.0
    states, base_states = r.measured.breakdown["optimizer_states"], base.measured.breakdown["optimizer_states"]
    assert states < {"sgd": 0.51, "adafactor": 0.2, "adamw8bit": 0.3}[name] * base_states, (states, base_states)
    losses, _, _ = run_steps(SPEC, Plan(optimizer=name), steps=20)
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_adamw8bit_loss_curve_stays_close_to_fp32_adamw():
    """Lossy: over 25 steps the 8-bit AdamW loss stays within 2% of fp32 AdamW."""
    ref, _, _ = run_steps(SPEC, Plan(), steps=25)
    q8, _, _ = run_steps(SPEC, Plan(optimizer="adamw8bit"), steps=25)
    rel = max(abs(a - b) / abs(a) for a, b in zip(ref, q8))
    assert rel < 0.02, rel


def test_adamw8bit_falls_back_with_a_warning_without_bitsandbytes(monkeypatch):
    real_import = builtins.__import__

    def no_bnb(name, *a, **k):
        if name.startswith("bitsandbytes"):
            raise ImportError("no bitsandbytes")
        return real_import(name, *a, **k)
    from memfit.techniques.bnb_optim import bitsandbytes_available

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    bitsandbytes_available.cache_clear()  # (asked once a process: this one's install has no bitsandbytes)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            factory = adamw8bit_factory({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
    finally:
        monkeypatch.undo()
        bitsandbytes_available.cache_clear()
    assert any("bitsandbytes" in str(x.message) for x in w)
    assert isinstance(factory([torch.nn.Parameter(torch.ones(2))]), torch.optim.AdamW)
