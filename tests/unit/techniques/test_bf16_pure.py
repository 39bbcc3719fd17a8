"""bf16-pure: half the bytes; stochastic rounding and Kahan keep small updates."""

import pytest
import torch

from helpers import measured, run_steps
from memfit.plans import Plan
from memfit.techniques.bf16_update import BF16Optimizer, stochastic_round_to_bf16

SPEC = "gpt2:n_layer=2,n_embd=128,n_head=4,vocab_size=1000,n_positions=128"


def test_stochastic_rounding_is_unbiased():
    x = torch.full((200_000,), 1.0 + 2**-10)  # between two bf16 neighbours (1 and 1 + 2**-7)
    r = stochastic_round_to_bf16(x).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(r.mean().item() - (1.0 + 2**-10)) < 2e-5
    exact = torch.tensor([1.5, -2.0, 0.0])
    assert torch.equal(stochastic_round_to_bf16(exact).float(), exact)


def test_small_updates_survive_with_kahan_and_stochastic_rounding():
    """SGD steps of 1e-4 on weights of 1.0: nearest rounding loses every one of them."""
    results = {}
    for rounding in ("nearest", "kahan", "stochastic"):
        w = torch.nn.Parameter(torch.ones(10_000, dtype=torch.bfloat16))
        opt = (torch.optim.SGD([w], lr=1e-4) if rounding == "nearest"
               else BF16Optimizer([w], "sgd", rounding, lr=1e-4, momentum=0.0))
        for _ in range(100):
            w.grad = torch.ones_like(w)
            opt.step()
        results[rounding] = w.float().mean().item()
    assert results["nearest"] == 1.0                         # all 100 updates lost
    # Kahan's compensation buffer is bf16 too (8 mantissa bits), so it keeps most, not all: within 25%
    assert abs(results["kahan"] - (1.0 - 1e-2)) < 2.5e-3     # 100 x 1e-4 kept
    assert abs(results["stochastic"] - (1.0 - 1e-2)) < 1e-3  # kept on average


def test_bf16_pure_halves_weights_and_states():
    base = measured(SPEC, Plan())
    pure = measured(SPEC, Plan(precision="bf16-pure", bf16_update="kahan"))
    b, p = base.measured.breakdown, pure.measured.breakdown
    assert p["parameters"] * 2 == b["parameters"]
    assert p["optimizer_states"] <= 0.76 * b["optimizer_states"]  # bf16 moments + bf16 compensation
    assert abs(pure.error_percent) <= 1.0


@pytest.mark.slow
def test_bf16_pure_tracks_fp32():
    """Lossy: over 20 steps the loss stays within 3% of fp32 with Kahan or stochastic rounding."""
    ref, _, _ = run_steps(SPEC, Plan(), steps=20)
    for rounding in ("kahan", "stochastic"):
        losses, _, _ = run_steps(SPEC, Plan(precision="bf16-pure", bf16_update=rounding), steps=20)
        rel = max(abs(a - r) / r for a, r in zip(losses, ref))
        assert rel < 0.03, (rounding, rel)


def test_float_inputs_follow_the_weights_into_bf16():
    for spec in ("cnn", "dit"):
        r = measured(spec, Plan(precision="bf16-pure"), seq_len=None)
        assert abs(r.error_percent) <= 1.0
        assert r.measured.breakdown["inputs"] > 0
