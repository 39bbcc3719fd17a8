"""Chunked cross-entropy: equal loss and gradients, no full logits, less memory."""

import pytest
import torch

from helpers import OpShapes, measured
from memfit.errors import UserError
from memfit.plans import Plan
from memfit.step import build_step
from memfit.workloads import load_workload

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=2000,n_positions=256,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"


def _loss_and_grads(plan, batch):
    wl = load_workload(SPEC, seq_len=128)
    torch.manual_seed(0)
    step = build_step(wl, plan, 4, "cpu")
    loss = step.loss_fn(step.model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in step.model.named_parameters()}


def test_equal_loss_and_gradients_with_ignored_labels():
    wl = load_workload(SPEC, seq_len=128)
    torch.manual_seed(1)
    batch = wl.batch(4)
    batch["labels"][:, :10] = -100  # e.g. a prompt that is not trained on
    ref_loss, ref = _loss_and_grads(Plan(), batch)
    for k in (3, 8):
        loss, grads = _loss_and_grads(Plan(loss_chunks=k), batch)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-6)


def test_full_logits_never_exist():
    wl = load_workload(SPEC, seq_len=128)
    step = build_step(wl, Plan(loss_chunks=4), 4, "cpu")
    with OpShapes() as ops:
        step(wl.batch(4))
    vocab_rows = [s for op, s in ops.seen if s and s[-1] == 2000]
    assert vocab_rows and max(s[0] for s in vocab_rows if len(s) == 2) <= 4 * 127 // 4 + 1


def test_memory_saved_and_predicted():
    base = measured(SPEC, Plan(), seq_len=128)
    chunked = measured(SPEC, Plan(loss_chunks=8), seq_len=128)
    assert chunked.peak_bytes < 0.7 * base.peak_bytes
    assert abs(chunked.error_percent) <= 1.0


def test_refused_for_models_that_are_not_causal_lms():
    with pytest.raises(UserError, match="causal language model"):
        build_step(load_workload("bert:num_hidden_layers=1,hidden_size=64,num_attention_heads=2,intermediate_size=64"),
                   Plan(loss_chunks=4), 2, "cpu")
