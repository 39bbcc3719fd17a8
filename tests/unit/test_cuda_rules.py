"""The CUDA kernel model (memfit.memory.cuda): each rule on its own, on toy shapes, on this CPU."""

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.devices import get_device
from memfit.memory.cuda import autocast as autocast_rule
from memfit.memory.cuda import conv as conv_rule
from memfit.memory.cuda import cuda_kernel_model
from memfit.memory.cuda import reduce as reduce_rule
from memfit.memory.cuda import rnn as rnn_rule
from memfit.memory.cuda import sdpa as sdpa_rule
from memfit.memory.cuda.composites import cuda_composites
from memfit.memory.cuda.optim import cuda_optimizer_defaults
from memfit.memory.tracker import MemoryTracker

aten = torch.ops.aten
H100, A100, T4, V100 = (get_device(n) for n in ("h100-80gb", "a100-80gb", "t4", "v100-16gb"))
DATA = Path(__file__).resolve().parent.parent / "data"


class Ops(TorchDispatchMode):
    """Records the ATen ops that run (and their output dtypes)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, out.dtype if isinstance(out, torch.Tensor) else None))
        return out

    def called(self, func) -> bool:
        return any(f is func for f, _ in self.ops)


def _qkv(b=2, h=4, t=64, d=32, dtype=torch.bfloat16, grad=True):
    return [torch.randn(b, h, t, d, dtype=dtype, requires_grad=grad) for _ in range(3)]


def _backend(dev, *args, **kw):
    return sdpa_rule.NAMES[sdpa_rule.select_backend(dev.compute_capability, dev.cuda_version, dev.cudnn_version,
                                                    *args, **kw)]


# -- SDPA backend selection ----------------------------------------------------------------------

def test_sdpa_backend_follows_card_dtype_dropout_and_mask():
    q, k, v = _qkv()
    assert _backend(H100, q, k, v) == "cudnn"                     # sm90 + cuDNN 9.19: cuDNN first
    assert _backend(A100, q, k, v) == "flash"                     # sm80: flash first
    q32, k32, v32 = _qkv(dtype=torch.float32)
    assert _backend(H100, q32, k32, v32) == "efficient"           # fp32: neither cuDNN nor flash
    q16, k16, v16 = _qkv(dtype=torch.float16)
    assert _backend(V100, q16, k16, v16) == "efficient"           # flash and cuDNN need sm80+
    assert _backend(T4, q16, k16, v16) == "efficient"
    mask = torch.zeros(2, 4, 64, 64, dtype=torch.bfloat16)
    assert _backend(A100, q, k, v, mask) == "efficient"           # flash takes no mask
    assert _backend(H100, q, k, v, mask) == "cudnn"               # cuDNN takes [B, H, T, T] masks
    permuted = torch.zeros(1, 64, 64, 4, dtype=torch.bfloat16).permute(0, 3, 1, 2)  # stride(-1) != 1
    assert _backend(H100, q, k, v, permuted) == "math"            # no fused kernel takes it (T5's bias)
    assert _backend(H100, q, k, v, None, 0.125) == "cudnn"        # dropout on cuDNN's 1/16 grid
    expected = "flash" if sdpa_rule.TORCH_CHECKS_CUDNN_DROPOUT else "cudnn"
    assert _backend(H100, q, k, v, None, 0.1) == expected         # GPT-2's 0.1 is not


@pytest.mark.parametrize("efficient_gqa", [False, True], ids=["torch-2.13", "torch-2.14"])
def test_grouped_query_attention_needs_a_backend_built_for_it(monkeypatch, efficient_gqa):
    """Qwen2/Llama GQA (12 query heads, 2 key/value heads, enable_gqa=True as transformers calls it
    on CUDA without a mask): flash and cuDNN take it. The memory-efficient kernel takes it from torch
    2.14 (pytorch#191085); before, fp32 and pre-sm80 half precision take the math path, which
    materialises the scores (qwen2-4l-fp32 on the H100, torch 2.11: 28.07 GiB measured, 3 GiB above
    the efficient-kernel prediction). From 2.14 a single K/V head passes any fused kernel without
    enable_gqa."""
    from memfit import sdpa_backends
    monkeypatch.setattr(sdpa_backends, "TORCH_EFFICIENT_GQA", efficient_gqa)
    q = torch.randn(2, 12, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 64, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    assert _backend(A100, q, k, v, None, 0.0, True, True) == "flash"
    assert _backend(H100, q, k, v, None, 0.0, True, True) == "cudnn"
    grouped = "efficient" if efficient_gqa else "math"
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    assert _backend(H100, q32, k32, v32, None, 0.0, True, True) == grouped
    assert _backend(H100, q32, k32, v32, None, 0.0, True, False) == "math"  # heads differ, no enable_gqa
    q16, k16, v16 = (t.detach().half().requires_grad_() for t in (q, k, v))
    assert _backend(T4, q16, k16, v16, None, 0.0, True, True) == grouped   # sm75: no flash, no cuDNN
    k1, v1 = (t[:, :1].detach().float().requires_grad_() for t in (k, v))  # one K/V head (multi-query)
    assert _backend(H100, q32, k1, v1, None, 0.0, True, False) == grouped
    assert _backend(A100, q, k[:, :1], v[:, :1], None, 0.0, True, False) == ("flash" if efficient_gqa else "math")
    same = [torch.randn(2, 12, 64, 32, requires_grad=True) for _ in range(3)]
    assert _backend(H100, *same, None, 0.0, True, True) == "efficient"    # enable_gqa with equal heads


def test_the_efficient_kernels_grouped_query_backward_books_dk_and_dv_per_query_head(monkeypatch):
    """torch 2.14's memory-efficient backward of grouped-query heads writes dK and dV per query head
    (``grad_k_expanded``, ``grad_v_expanded``: [B, Tk, Hq, D] in the inputs' dtype) and sums them into the
    K/V heads' gradients; its forward reads K/V per group (no copy). No [B, H, T, T] score is kept."""
    from memfit import sdpa_backends
    monkeypatch.setattr(sdpa_backends, "TORCH_EFFICIENT_GQA", True)
    b, hq, hk, t, d = 2, 12, 2, 128, 32
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker()
        with tracker, cuda_kernel_model(H100, tracker):
            q = torch.randn(b, hq, t, d, requires_grad=True)
            k, v = (torch.randn(b, hk, t, d, requires_grad=True) for _ in range(2))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            assert type(out.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
            out.sum().backward()
            assert k.grad.shape == k.shape and q.grad.shape == q.shape
    records = tracker.state.records
    assert not [r for r in records if r.nbytes >= b * hq * t * t * 4]
    expanded = [(r.op, r.nbytes) for r in records if "expanded" in r.op]
    assert expanded == [("efficient grad_k_expanded", b * t * hq * d * 4), ("efficient grad_v_expanded", b * t * hq * d * 4)]


def test_sdpa_backend_respects_sdpa_kernel_flags():
    q, k, v = _qkv()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        assert _backend(H100, q, k, v) == "math"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert _backend(H100, q, k, v) == "efficient"


def test_cuda_sdpa_keeps_no_scores_and_books_kernel_buffers():
    """On fake tensors the CUDA path saves output + logsumexp only (no [B,H,T,T]) and the cuDNN
    backward books its fp32 scratch: 4*B*H*T*D + 4*B*H*T + 256 bytes (snap-mha-bf16)."""
    b, h, t, d = 2, 4, 256, 32
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker()
        with tracker, cuda_kernel_model(H100, tracker):
            q, k, v = _qkv(b, h, t, d)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert type(out.grad_fn).__name__ == "ScaledDotProductCudnnAttentionBackward0"
            out.sum().backward()
            assert q.grad.shape == q.shape and q.grad.dtype == torch.bfloat16
    sizes = [r.nbytes for r in tracker.state.records]
    assert b * h * t * t * 2 not in sizes and b * h * t * t * 4 not in sizes
    ws = [r.nbytes for r in tracker.state.records if r.op == "cudnn attention backward workspace"]
    assert ws == [4 * b * h * t * d + 4 * b * h * t + 256]


def test_the_efficient_kernels_mask_is_padded_as_given_and_broadcast_as_a_view():
    """attention.cpp ``preprocess_mask``: a [B, 1, 1, Tk] key mask with Tk not a multiple of 8 (HunyuanVideo's:
    18,616 tokens) is padded as it is, [B, 1, 1, Tk + 8 - Tk % 8], and then expanded over heads and queries (a view).
    Expanding first and padding the expanded mask (the model before) booked B x H x Tq x Tk bytes: 16.6 GB a call
    at HunyuanVideo's size. An aligned mask is not copied."""
    b, h, t, d = 2, 4, 300, 32  # (300 keys: not a multiple of 8)
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker()
        with tracker, cuda_kernel_model(A100, tracker):
            q, k, v = _qkv(b, h, t, d)
            mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            assert type(out.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
            out.sum().backward()
            aligned = torch.ones(b, 1, 1, 304, dtype=torch.bfloat16)
            q2, k2, v2 = _qkv(b, h, 304, d)
            n = len(tracker.state.records)
            F.scaled_dot_product_attention(q2, k2, v2, attn_mask=aligned)
            fresh = [r.nbytes for r in tracker.state.records[n:]]
    sizes = [r.nbytes for r in tracker.state.records]
    assert max(sizes) < b * h * t * t * 2, max(sizes)  # (nothing of [B, H, Tq, Tk])
    assert b * (t + 8 - t % 8) * 2 in sizes  # (the padded bf16 mask, as given: [B, 1, 1, 304])
    assert b * 304 * 2 not in fresh  # (aligned: no copy)


def test_a_boolean_mask_becomes_an_additive_one_without_an_inverted_copy():
    """``convert_boolean_attn_mask`` is ``where(mask, 0, -inf)`` since torch 2.6 (pytorch#139784): an expanded
    [B, H, T, T] boolean view (kohya's T5 mask) becomes one bf16 tensor of that shape, with no bool copy of it
    (``logical_not`` first, before, booked B x H x T x T bytes more)."""
    b, h, t, d = 2, 4, 96, 32  # (the mask's bytes unlike any other tensor's here)
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker()
        with tracker, cuda_kernel_model(A100, tracker):
            q, k, v = _qkv(b, h, t, d)
            mask = torch.ones(b, 1, 1, t, dtype=torch.bool).expand(b, h, t, t)
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    sizes = [r.nbytes for r in tracker.state.records]
    assert b * h * t * t * 2 in sizes and b * h * t * t not in sizes


def test_cuda_sdpa_reaches_calls_inside_multihead_attention_and_is_removed_after():
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True, dropout=0.1)
    x = torch.randn(2, 16, 64)
    with FakeTensorMode(allow_non_fake_inputs=True):
        mha_f = torch.nn.MultiheadAttention(64, 4, batch_first=True, dropout=0.1)
        xf = torch.randn(2, 16, 64)
        with cuda_composites(A100), Ops() as ops:
            mha_f(xf, xf, xf, need_weights=False)[0].sum().backward()
    assert ops.called(aten._scaled_dot_product_efficient_attention.default)  # fp32 + dropout on an A100
    with Ops() as ops:  # registrations removed: the CPU picks its own path again
        mha(x, x, x, need_weights=False)[0].sum().backward()
    assert not ops.called(aten._scaled_dot_product_efficient_attention.default)


def test_math_fallback_gives_the_same_values_and_gradients_as_plain_sdpa():
    """Real tensors through the CUDA composite, math backend (runs on CPU): identical results."""
    torch.manual_seed(0)
    q, k, v = _qkv(dtype=torch.float32)
    mask = torch.randn(2, 4, 64, 64).permute(0, 1, 3, 2)  # non-contiguous: math on any card
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref.square().sum().backward()
    ref_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    with cuda_composites(H100):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for x, g in zip((q, k, v), ref_grads):
        torch.testing.assert_close(x.grad, g)


# -- dropout, autocast, optimizers ---------------------------------------------------------------

def test_dropout_uses_the_fused_kernel_with_a_boolean_mask():
    x = torch.randn(64, 64, requires_grad=True)
    with cuda_composites(H100):
        y = F.dropout(x, 0.25, training=True)
        assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
        assert F.dropout(x, 0.25, training=False) is x
    y.sum().backward()
    kept = y != 0
    torch.testing.assert_close(x.grad, kept.float() / 0.75)  # grad = mask * scale
    torch.testing.assert_close(y[kept], x.detach()[kept] / 0.75)


def test_autocast_follows_cudas_op_lists():
    x = torch.randn(8, 16)
    w = torch.randn(16, 16)
    with cuda_autocast_cpu():
        h = x @ w
        assert h.dtype == torch.bfloat16                          # matmuls: 16 bits on both
        assert torch.pow(h, 3.0).dtype == torch.float32           # CUDA: fp32 list
        assert F.layer_norm(h, (16,)).dtype == torch.float32
        assert F.softmax(h, -1).dtype == torch.float32            # fp32_set_opt_dtype
        assert h.sum().dtype == torch.float32
        assert torch.addcmul(h, x, x).dtype == torch.float32      # promote
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(h), torch.zeros(8, 16, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # removed again: the CPU's own lists
        assert torch.pow(x @ w, 3.0).dtype == torch.bfloat16


def cuda_autocast_cpu():
    import contextlib
    stack = contextlib.ExitStack()
    stack.enter_context(autocast_rule.cuda_autocast())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    return stack


def test_autocast_policy_table_covers_exactly_cudas_autocast_kernels():
    """Every op the installed torch registers for AutocastCUDA has a policy here, and no other:
    a new torch that changes the list fails this test instead of silently mispredicting."""
    assert set(autocast_rule.CUDA_POLICY) == autocast_rule.registered("AutocastCUDA")


def test_optimizers_default_to_foreach_as_on_cuda_parameters():
    with FakeTensorMode(allow_non_fake_inputs=True):
        p = torch.nn.Parameter(torch.randn(32, 32))
        p.grad = torch.randn(32, 32)
        for ctx, expect in ((cuda_optimizer_defaults(), True), (None, False)):
            opt = torch.optim.AdamW([p], lr=1e-3)
            with (ctx or warnings.catch_warnings()), Ops() as ops:
                opt.step()
            assert ops.called(aten._foreach_sqrt.default) is expect
        explicit = torch.optim.AdamW([p], lr=1e-3, foreach=False)
        with cuda_optimizer_defaults(), Ops() as ops:
            explicit.step()
        assert not ops.called(aten._foreach_sqrt.default)  # an explicit choice is kept


# -- kernel memory: cuBLAS, reductions, cuDNN ------------------------------------------------------

def _traced(fn, dev=H100):
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker()
        with tracker, cuda_kernel_model(dev, tracker) as km:
            fn()
    return tracker, km


def test_one_cublas_workspace_per_thread_that_runs_matmuls():
    def step():
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        for _ in range(2):  # a second step allocates no more workspaces
            model(torch.randn(16, 64)).sum().backward()
    tracker, _ = _traced(step)
    ws = sorted((r.op, r.nbytes) for r in tracker.state.records if "workspace (" in r.op)
    assert ws == [("cublas workspace (autograd thread)", 32 << 20), ("cublas workspace (main thread)", 32 << 20),
                  ("cublaslt workspace (main thread)", 1 << 20)]  # biased Linear forward: cuBLASLt
    assert all(tracker.category_of(r) == "other" for r in tracker.state.records if "workspace (" in r.op)
    tracker, _ = _traced(step, A100)
    assert {r.nbytes for r in tracker.state.records if r.op.startswith("cublas workspace")} == {8519680}


def test_layer_norm_keeps_fp32_statistics_for_a_half_precision_input_as_cuda_does():
    """layer_norm_cuda allocates mean and rstd in the input's accumulate type (fp32 for bf16 and fp16); the
    reference kernel of a trace on CPU tensors gives them the input's dtype. A bf16 LayerNorm of 64 rows on a GPU
    preset holds 2 x 64 fp32 statistics for backward; an fp32 one is as it was."""
    kept = {}

    def step(dtype):
        norm = torch.nn.LayerNorm(32, dtype=dtype)
        y, mean, rstd = aten.native_layer_norm(torch.randn(4, 16, 32, dtype=dtype), [32], norm.weight, norm.bias, 1e-5)
        kept[dtype] = (mean.dtype, rstd.dtype, tuple(mean.shape))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tracker, _ = _traced(lambda dtype=dtype: step(dtype))
        booked = [r for r in tracker.state.records if r.op == "layer_norm fp32 mean/rstd"]
        assert kept[dtype] == (torch.float32, torch.float32, (4, 16, 1))
        assert [r.nbytes for r in booked] == ([64 * 4, 64 * 4] if dtype != torch.float32 else [])


def test_workspaces_stay_held_when_a_compiled_region_enters_the_model_again():
    """A compiled region's wrapper runs under the modes of its call, entering the kernel model again
    (memfit.techniques.fake_wrapper); the workspaces booked before stay held. They were dropped on
    that inner exit, and every torchao optimizer's step on a GPU preset lost its two cuBLAS
    workspaces (64 MiB under the H100's peak: tests/data/h100.jsonl llama1b-full-*)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker()
        with tracker, cuda_kernel_model(H100, tracker) as km:
            torch.nn.Linear(64, 64, bias=False)(torch.randn(16, 64)).sum()
            held = tracker.live_bytes()
            with km:  # the wrapper's re-entry
                pass
            assert tracker.live_bytes() == held >= 32 << 20


def test_linear_on_a_non_contiguous_input_adds_its_bias_in_place():
    """Linear.cpp adds the bias in place after matmul for a non-contiguous input, except for tensor
    subclasses such as fake tensors; the CUDA composite takes the real branch: one output-sized
    allocation, not two. Values and gradients are those of F.linear."""
    x = torch.randn(6, 4, 32).transpose(0, 1)  # [4, 6, 32], not contiguous
    w, b = torch.randn(16, 32, requires_grad=True), torch.randn(16, requires_grad=True)
    out_bytes = 4 * 6 * 16 * 4

    def step():
        F.linear(x, w, b).sum().backward()
    tracker, _ = _traced(step)
    assert sum(r.nbytes == out_bytes for r in tracker.state.records) == 1
    w, b = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()  # real leaves again
    with cuda_composites(H100):
        got = F.linear(x, w, b)
        got.square().sum().backward()
    grads = (w.grad.clone(), b.grad.clone())
    w.grad = b.grad = None
    want = F.linear(x, w, b)
    want.square().sum().backward()
    assert torch.allclose(got, want) and torch.allclose(grads[0], w.grad) and torch.allclose(grads[1], b.grad)
    for shape in ((5, 32), (2, 3, 32), (2, 3, 5, 32)):  # contiguous inputs: the fused addmm paths
        xi = torch.randn(*shape)
        with cuda_composites(H100):
            got = F.linear(xi, w, b)
        assert torch.allclose(got, F.linear(xi, w, b))


def test_reduction_staging_buffer_matches_the_h100_snapshots():
    # bias gradient of a [1024, 1000] bf16 gradient (snap-mha-bf16): 8,192,000 bytes + 32 of semaphores
    assert reduce_rule.global_buffer_bytes([1024, 1000], [1000, 1], {0}, 2, 4, 132, input_vec_size=8) == (
        8_192_000, 32)
    # [3072, 1024] bf16 (snap-gpt2-bf16-small): 25,165,824 bytes
    assert reduce_rule.global_buffer_bytes([3072, 1024], [1024, 1], {0}, 2, 4, 132, input_vec_size=8)[0] == 25_165_824
    # a row-wise mean (many outputs, few inputs each) needs no staging buffer
    assert reduce_rule.global_buffer_bytes([4096, 768], [768, 1], {1}, 4, 4, 132) == (0, 0)


def test_reduction_staging_buffer_sizes_its_grid_by_the_cards_threads_per_sm():
    """Reduce.cuh: ``blocks_per_sm = maxThreadsPerMultiProcessor / threads``: 1536 on an RTX 4090 (sm89) and 1024 on a
    T4, not the H100's 2048, so fewer blocks split a reduction there and its staging buffer is smaller."""
    from memfit.techniques.cuda_facts import threads_per_sm
    assert threads_per_sm(get_device("rtx4090")) == 1536 and threads_per_sm(T4) == 1024 and threads_per_sm(H100) == 2048
    args = ([16384, 4096], [4096, 1], {0}, 2, 4, 128)  # (a bias gradient over 16,384 tokens of width 4096, bf16)
    wide, ada = (reduce_rule.global_buffer_bytes(*args, input_vec_size=8, threads_per_sm=t)[0] for t in (2048, 1536))
    assert (wide, ada) == (128 * 2**20, 96 * 2**20)
    g = reduce_rule.geometry(aten.sum.dim_IntList, (torch.empty(16384, 4096, dtype=torch.bfloat16), [0]), {}, 128, 1536)
    assert reduce_rule.sized(g)[0] == ada


def test_cudnn_convolution_workspace_matches_the_cnn_snapshot():
    """snap-cnn-fp32 (H100, fp32 NCHW): the 128->256 stride-2 conv on 16x16 inputs held 13,762,576
    bytes forward and 17,302,111 in backward-weight; the 3-channel stem none."""
    with FakeTensorMode():
        x, w = torch.randn(64, 128, 16, 16), torch.randn(256, 128, 3, 3)
        out = torch.ops.aten.convolution(x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1)
        fwd = conv_rule.workspace(aten.convolution.default, (x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1),
                                  out)[0][1]
        bwd = conv_rule.backward_workspace(
            1, (out, x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False]))[0][1]
        stem_x, stem_w = torch.randn(64, 3, 32, 32), torch.randn(32, 3, 3, 3)
        stem = torch.ops.aten.convolution(stem_x, stem_w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        assert conv_rule.workspace(aten.convolution.default,
                                   (stem_x, stem_w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), stem) == []
    assert abs(fwd - 13_762_576) / 13_762_576 < 0.001
    assert abs(bwd - 17_302_111) / 17_302_111 < 0.04


def test_lstm_runs_cudnn_rnn_with_a_weight_buffer_and_reserve():
    """The meta kernel returns weight_buf=None, which broke backward on fake CUDA tensors; the rule
    returns the flat buffer the CUDA kernel makes, books the reserve, and backward runs."""
    def step():
        lstm = torch.nn.LSTM(8, 16, 2, batch_first=True)
        y, _ = lstm(torch.randn(4, 5, 8))
        assert type(y.grad_fn).__name__ == "CudnnRnnBackward0"
        n_weights = sum(p.numel() for p in lstm.parameters())
        assert y.grad_fn._saved_result4.shape == (n_weights,)
        assert not y.is_contiguous()  # a transposed view of [T, B, H], as the kernel returns it
        y.sum().backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in lstm.parameters())
    tracker, km = _traced(step)
    reserve = (6 * 2 - 1) * 5 * 4 * 16 * 4 + 256  # (6 x layers - 1) x steps x batch x hidden x fp32 + 256
    assert reserve in [r.nbytes for r in tracker.state.records]
    assert km.booked["cudnn rnn backward workspace"] == 2  # data and weight passes


def _rnn_args(row):
    dtype = getattr(torch, row["rnn_dtype"])
    t, b = row["steps"], row["batch"]
    x = torch.empty((b, t, row["input"]) if row["batch_first"] else (t, b, row["input"]), dtype=dtype)
    return (x, [], 4, None, None, None, rnn_rule.MODES[row["cell"].lower()], row["hidden"], 0, row["layers"],
            row["batch_first"], row["dropout"], True, row["bidirectional"], [])


def test_cudnn_rnn_reserve_matches_every_measured_shape():
    """The reserve law against 120 LSTM/GRU shapes measured on an H200 (tests/data/cudnn_rnn_h200.json:
    fp32, fp16 and autocast, 1-4 layers, bidirectional, dropout); cuDNN's dropout state is the
    first dropout call's only lasting allocation."""
    data = json.loads((DATA / "cudnn_rnn_h200.json").read_text())
    checked = 0
    for row in data["rows"]:
        assert rnn_rule.reserve_bytes(_rnn_args(row)) == row["reserve"], row
        checked += 1
    assert checked == 120
    first = next(r for r in data["rows"] if r["dropout"] > 0)
    assert first["persist_after_first_call"] == rnn_rule.dropout_state_bytes(
        (None,) * 11 + (first["dropout"], True), data["sm_count"])


def test_cudnn_rnn_workspace_fit_holds_its_stated_bounds():
    """The workspace is a fit (cuDNN picks its algorithm by shape): over the 276 measured fp32/fp16
    shapes its median error is at most 12% and 90% of shapes are within 40%. The workspace is the
    largest allocation forward frees (besides a batch-first input copy)."""
    import statistics
    rows = [r for name in ("cudnn_rnn_h200.json", "cudnn_rnn_h200_wide.json")
            for r in json.loads((DATA / name).read_text())["rows"] if not r["dtype"].startswith("autocast")]
    errors = []
    for row in rows:
        args = _rnn_args(row)
        x = args[0]
        copy = x.numel() * x.element_size() if row["batch_first"] else -1
        measured = max(int(a[:-1]) for a in row["fwd_allocs"] if a.endswith("f") and int(a[:-1]) != copy)
        errors.append(abs(rnn_rule.workspace_bytes(args) / measured - 1))
    errors.sort()
    assert len(errors) == 276
    assert statistics.median(errors) <= 0.12 and errors[int(0.9 * len(errors))] <= 0.40, (
        statistics.median(errors), errors[int(0.9 * len(errors))])


def test_lstm_on_fake_cuda_tensors_keeps_its_weight_buffer():
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("cuda"):
            lstm = torch.nn.GRU(8, 16, batch_first=True)
            x = torch.randn(4, 5, 8)
        with cuda_kernel_model(H100):
            y, _ = lstm(x)
    assert y.device.type == "cuda" and y.grad_fn._saved_result4 is not None


def test_bitsandbytes_8bit_update_has_no_cpu_scratch_on_a_gpu_target():
    """bitsandbytes' CPU 8-bit update holds fp32 copies of both states, the gradient and the weight
    (~6x the parameter; probed on the CPU device); its CUDA kernel updates in place. A GPU target
    books nothing in the optimizer phase."""
    pytest.importorskip("bitsandbytes")
    from memfit.memory.faketrace import run_tracked
    from memfit.plans import Plan
    from memfit.target import Target
    target = Target.resolve("mha:layers=1", Plan(optimizer="adamw8bit"), 2, H100)
    gpu = run_tracked(target, fake=True).tracker
    cpu = run_tracked(target.on(get_device("cpu")), fake=True).tracker
    assert not [r for r in gpu.state.records if r.phase == "optimizer" and r.step == 2]
    assert any(r.op.endswith(":workspace") for r in cpu.state.records if r.step == 2 and r.nbytes > 1 << 20)


def test_autocast_reaches_ops_inside_a_composite_that_only_the_cpu_list_casts():
    """CPU autocast casts cross_entropy's input to fp32 itself; CUDA has no policy for it, so its
    log_softmax (dtype given: bf16 stays bf16) and nll_loss (fp32: casts) decide (T5's loss)."""
    logits = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 32, (8,))
    with cuda_autocast_cpu(), Ops() as ops:
        F.cross_entropy(logits, target)
    dtypes = {f: d for f, d in ops.ops}
    assert dtypes[aten._log_softmax.default] == torch.bfloat16
    assert (aten._to_copy.default, torch.float32) in ops.ops  # nll_loss's fp32 cast of the log-probs


def test_the_local_card_gets_the_facts_kernel_choices_depend_on(monkeypatch):
    """--device cuda: compute capability, SMs, CUDA/cuDNN versions and the workspace size come from
    the card and the installed torch, so it and its preset make the same kernel choices."""
    from types import SimpleNamespace

    from memfit.devices import local_cuda_device
    props = SimpleNamespace(name="NVIDIA A100-SXM4-40GB", total_memory=42_505_273_344, major=8, minor=0,
                            multi_processor_count=108)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    dev = local_cuda_device()
    preset = get_device("a100-40gb")
    assert (dev.compute_capability, dev.sm_count, dev.workspace_bytes) == (
        preset.compute_capability, preset.sm_count, preset.workspace_bytes)
    assert dev.cuda_version == (12, 8) and dev.cudnn_version == 91002
    q, k, v = _qkv()
    assert _backend(dev, q, k, v) == _backend(preset, q, k, v) == "flash"


def test_cuda_autocast_steps_aside_only_while_a_compiled_region_is_captured(monkeypatch):
    """NOTE [ Paused only while a region is captured ]: torchao's update is a compiled call per
    parameter and step; once compiled, its calls step the CUDA autocast lists aside no more (they
    did for every call), and the prediction is the same, with the approximation still listed."""
    from memfit.memory import estimate as estimate_mod
    from memfit.memory.cuda import autocast
    from memfit.plans import Plan
    from memfit.target import Target
    registered = []
    real = autocast._register
    monkeypatch.setattr(autocast, "_register", lambda: registered.append(1) or real())
    target = Target.resolve("gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256",
                            Plan(precision="bf16", optimizer="adamw8bit-ao"), 4, H100, seq_len=32)
    first = estimate_mod.estimate_target(target)
    compiling = len(registered)
    registered.clear()
    again = estimate_mod.estimate_target(target)
    assert len(registered) == 1 < compiling  # (the trace's own registration: every graph was compiled)
    assert again.peak_bytes == first.peak_bytes and again.reserved_bytes == first.reserved_bytes
    assert any("compiled regions follows the CPU's op lists" in a for a in map(str, again.approximations))


def _attention_records(card, q, k, v, mask=None):
    """The tracker's (op, bytes) records of one SDPA forward and backward on ``card`` (fake tensors)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker()
        with tracker, cuda_kernel_model(card, tracker):
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
            out.sum().backward()
    return [(r.op, r.nbytes) for r in tracker.state.records]


def test_flash_backward_of_grouped_query_heads_books_dk_and_dv_per_query_head():
    """flash_api.cpp ``mha_bwd``: with fewer K/V heads than query heads it computes dK and dV per query head,
    [B, Tk, Hq, D] each in the input's dtype, and sums them into the K/V heads at the end (Llama-3-8B's 32 query
    and 8 K/V heads at batch 4 x 2048: 128 MiB each a layer). Equal heads: none."""
    b, t, d = 2, 256, 64
    q = torch.randn(b, 8, t, d, dtype=torch.bfloat16)
    k, v = (torch.randn(b, 2, t, d, dtype=torch.bfloat16) for _ in range(2))
    records = _attention_records(A100, q, k, v)
    assert ("flash dk_expanded", b * t * 8 * d * 2) in records and ("flash dv_expanded", b * t * 8 * d * 2) in records
    assert not any(op.startswith("flash dk") for op, _ in _attention_records(A100, q, q.clone(), q.clone()))


def test_efficient_forward_of_heads_over_128_books_its_fp32_output_accumulator():
    """attention.cu: the memory-efficient kernels for half-precision heads wider than 128 (Gemma's 256, with a mask)
    accumulate the output in an fp32 [B, Tq, H, Dv] buffer; heads of 128 keep it in registers; fp32 needs none."""
    b, h, t = 2, 4, 64
    mask = torch.zeros(b, 1, t, t, dtype=torch.bfloat16)
    wide = [torch.randn(b, h, t, 256, dtype=torch.bfloat16) for _ in range(3)]
    assert ("efficient attention output accumulator", b * t * h * 256 * 4) in _attention_records(A100, *wide, mask)
    narrow = [torch.randn(b, h, t, 128, dtype=torch.bfloat16) for _ in range(3)]
    assert not any("accumulator" in op for op, _ in _attention_records(A100, *narrow, mask))


def test_the_math_path_gets_the_boolean_mask_as_an_additive_one():
    """attention.cpp converts a boolean mask before choosing a backend, so the math path (a permuted mask: no fused
    kernel takes it) adds a float mask to its scores, which the conversion makes first."""
    b, h, t, d = 2, 4, 48, 32
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    mask = torch.ones(b, h, t, t, dtype=torch.bool).transpose(-1, -2)  # (stride(-1) != 1: math on any card)
    assert ("where", b * h * t * t * 4) in _attention_records(H100, q, k, v, mask)
