"""Attention: MultiheadAttention without weights, chunked SDPA; same results, less memory."""

import torch
import torch.nn.functional as F

from helpers import OpShapes, assert_same_training, measured, run_steps
from memfit.plans import Plan
from memfit.step import build_step
from memfit.techniques.attention import chunked_sdpa
from memfit.workloads import load_workload

MHA = "mha:layers=2,seq_len=80"


def test_mha_weights_are_not_materialised():
    """With attention: auto the [B, H, T, T] / [B, T, T] weights of nn.MultiheadAttention never exist."""
    wl = load_workload(MHA)
    b, t = 4, 80
    for mode, expect_weights in (("math", True), ("auto", False)):
        step = build_step(wl, Plan(attention=mode), b, "cpu")
        with OpShapes() as ops:
            step(wl.batch(b))
        square = [(op, s) for op, s in ops.seen if len(s) >= 3 and s[-1] == t and s[-2] == t]
        assert bool(square) == expect_weights, square[:3]


def test_mha_without_weights_trains_the_same():
    base, auto = run_steps(MHA, Plan(attention="math"), seq_len=None), run_steps(MHA, Plan(attention="auto"), seq_len=None)
    assert_same_training(base, auto, exact=False, rtol=1e-4, atol=1e-5)


def test_mha_memory_saved_and_predicted():
    base = measured(MHA, Plan(attention="math"), seq_len=None)
    auto = measured(MHA, Plan(attention="auto"), seq_len=None)
    assert auto.peak_bytes < base.peak_bytes and abs(auto.error_percent) <= 1.0


def test_chunked_sdpa_equals_sdpa():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 70, 16, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 70, 70) > 0.2
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}):
        ref = F.scaled_dot_product_attention(q, k, v, **kwargs)
        out = chunked_sdpa(q, k, v, chunk_size=16, **kwargs)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        g_ref = torch.autograd.grad(ref.sum(), (q, k, v))
        g_out = torch.autograd.grad(out.sum(), (q, k, v))
        for a, b in zip(g_out, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_attention_on_gpt2_same_training_less_memory():
    # dropout off: attention dropout drawn per chunk cannot reproduce the unchunked mask
    spec = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=512,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"
    base = run_steps(spec, Plan(), seq_len=512, batch_size=2)
    chunked = run_steps(spec, Plan(attention="chunked"), seq_len=512, batch_size=2)
    assert_same_training(base, chunked, exact=False, rtol=1e-4, atol=1e-5)
    # memory: with attention dropout on, CPU SDPA takes the math path that materialises T x T
    spec = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=512"
    m_base, m_chunked = measured(spec, Plan(), seq_len=512), measured(spec, Plan(attention="chunked"), seq_len=512)
    assert m_chunked.peak_bytes < 0.7 * m_base.peak_bytes
    assert abs(m_chunked.error_percent) <= 1.0


def test_chunked_attention_with_block_checkpointing():
    spec = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=512,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"
    base = run_steps(spec, Plan(), seq_len=512, batch_size=2, steps=2)
    both = run_steps(spec, Plan(attention="chunked", checkpointing="blocks"), seq_len=512, batch_size=2, steps=2)
    assert_same_training(base, both, exact=False, rtol=1e-4, atol=1e-5)
