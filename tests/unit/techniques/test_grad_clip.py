"""max_grad_norm: the same training as a hand-written loop with clip_grad_norm_; refused with the
optimizer in backward; exported to Hugging Face and Lightning; memory predicted and measured."""

import copy

import pytest
import torch
from torch import nn

from helpers import measured
from memfit.errors import UserError
from memfit.integrations.export import to_hf, to_lightning
from memfit.plans import Plan
from memfit.step import build_step
from memfit.workload import Workload

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"


def _mlp() -> Workload:
    torch.manual_seed(0)
    init = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    return Workload(model=lambda: copy.deepcopy(init), batch=lambda n: torch.randn(n, 16) * 50,
                    loss=lambda m, x: m(x).pow(2).mean(), optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))


def test_clipping_equals_a_hand_written_loop_and_really_clips():
    """Twin runs: memfit's step with max_grad_norm 0.5 and 2 micro-batches, against the same model
    trained by hand (accumulate, clip_grad_norm_, step). Large inputs make every step clip."""
    wl = _mlp()
    step = build_step(wl, Plan(max_grad_norm=0.5, micro_batch_size=4), 8, "cpu")
    ref = wl.model()
    opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    torch.manual_seed(1)
    batches = [wl.batch(8) for _ in range(4)]
    for batch in batches:
        loss = step(batch)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for part in batch.chunk(2):
            part_loss = wl.loss(ref, part) / 2
            part_loss.backward()
            total += part_loss.item()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert norm > 0.5  # the clip was active
        opt.step()
        assert loss == pytest.approx(total, rel=1e-6)
        for a, b in zip(step.model.parameters(), ref.parameters()):
            assert torch.equal(a, b)


def test_without_clipping_the_training_differs():
    """The check above can fail: without max_grad_norm the same steps give other weights."""
    wl = _mlp()
    clipped = build_step(wl, Plan(max_grad_norm=0.5), 8, "cpu")
    plain = build_step(wl, Plan(), 8, "cpu")
    batch = wl.batch(8)
    clipped(batch), plain(batch)
    assert not all(torch.equal(a, b) for a, b in zip(clipped.model.parameters(), plain.model.parameters()))


def test_fp16_gradients_are_unscaled_before_clipping():
    """With fp16 the GradScaler's scale must come off before the norm is taken: the clipped weights
    match the fp32-scaled twin's closely, not a clip of scaled gradients (which would be ~scale x off)."""
    wl = _mlp()
    fp16 = build_step(wl, Plan(precision="fp16", max_grad_norm=0.5), 8, "cpu")
    fp32 = build_step(wl, Plan(max_grad_norm=0.5), 8, "cpu")
    batch = wl.batch(8)
    fp16(batch), fp32(batch)
    for a, b in zip(fp16.model.parameters(), fp32.model.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-4)


def test_bad_values_and_combinations_are_plan_errors():
    with pytest.raises(UserError, match="max_grad_norm must be null or a number > 0"):
        Plan(max_grad_norm=0)
    with pytest.raises(UserError, match="max_grad_norm needs every gradient at once"):
        Plan(max_grad_norm=1.0, optimizer_in_backward=True)
    assert Plan.from_dict({"max_grad_norm": 1}).max_grad_norm == 1.0


def test_exports():
    """(The command line's flag: tests/integration/test_cli_estimate.py.)"""
    assert to_hf(Plan(max_grad_norm=1.0), 8).kwargs["max_grad_norm"] == 1.0
    assert to_hf(Plan(), 8).kwargs["max_grad_norm"] == 0.0  # no clipping: the Trainer's default clips at 1.0
    lightning = to_lightning(Plan(max_grad_norm=1.0), 8).kwargs
    assert lightning["gradient_clip_val"] == 1.0 and lightning["gradient_clip_algorithm"] == "norm"
    assert "gradient_clip_val" not in to_lightning(Plan(), 8).kwargs
    assert Plan(max_grad_norm=1.0).short() == "fp32 clip=1"


def test_memory_predicted_and_measured():
    """Clipping reads every gradient after backward; its few small buffers barely move the peak,
    and the prediction matches the profiler's measurement (independent of memfit's tracker)."""
    base = measured(SPEC, Plan())
    clip = measured(SPEC, Plan(max_grad_norm=1.0))
    assert abs(clip.error_percent) <= 1.0
    assert abs(clip.peak_bytes - base.peak_bytes) <= 0.02 * base.peak_bytes
