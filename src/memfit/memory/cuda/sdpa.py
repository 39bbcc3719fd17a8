"""Rule: ``scaled_dot_product_attention`` picks the kernel PyTorch picks on the target card.

On the CPU, SDPA with dropout (or with a mask in some cases) takes the *math* path: it
materialises [B, H, T, T] scores, softmax and dropout mask and keeps them for backward. On CUDA
one of three fused kernels runs instead and keeps only the output, a logsumexp per query row
and the dropout RNG state:

- **cuDNN** (``_scaled_dot_product_cudnn_attention``): fp16/bf16, sm80+, head dim <= 128 (256
  on sm90/sm100 with cuDNN > 9.22), masks of shape [B|1, H|1, Tq|1, Tk|1], dropout a multiple
  of 1/16 (torch >= 2.12). PyTorch tries it *first* on sm90/sm100 with cuDNN > 9.15 (the CUDA 13 wheels ship
  9.19), last otherwise.
- **flash** (``_scaled_dot_product_flash_attention``): fp16/bf16, sm80-sm121, head dim <= 256,
  no mask, causal only for square attention.
  The mask (and q, k, v) need stride 1 in the last dimension for any fused kernel.
- **memory-efficient** (``_scaled_dot_product_efficient_attention``): fp32 too, sm50+, any
  additive mask (boolean masks become -inf/0 float masks; the mask is padded to a multiple of 16
  keys), head dim divisible by 4 (fp32) or 8 (fp16/bf16) on sm80+.
- **math** otherwise (``_scaled_dot_product_attention_math``, the same ops as on the CPU).

Source: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (``select_sdp_backend`` and the
``can_use_*`` filters) and attention.cpp (``scaled_dot_product_attention``: mask conversion,
padding of the head dim to a multiple of 8 for flash). The kernels are called as the CUDA
composite calls them, so autograd records the same nodes (``ScaledDotProductCudnnAttention
Backward0`` ...) and saves the same tensors; their meta kernels give the real output and
logsumexp shapes on fake tensors of any device. What the kernels allocate inside (not visible
to a storage tracker) is booked by :func:`kernel_buffers`:

- cuDNN backward: an fp32 dQ accumulator [B, H, Tq, D], an fp32 softmax sum [B, H, Tq] and 256
  bytes (matches ``run_cudnn_SDP_bprop`` in snap-mha-bf16 and snap-gpt2-bf16-small exactly);
  cuDNN forward: 256 bytes.
- flash backward (flash_api.cpp ``mha_bwd``): ``softmax_d`` fp32 [B, H, Tq rounded to 128] and
  ``dq_accum`` fp32 [B, Tq rounded to 128, H, D rounded to 32]; grad_out/out made contiguous.
- memory-efficient backward (attention_backward.cu): the fp32 gradQ staging area of the
  split-keys kernel (one [64 x D rounded to 64] fp32 tile plus 16 bytes per 64 queries, per
  batch and head), and for fp32 inputs ``delta`` computed as ``(grad_out * out).sum(-1)`` (an
  fp32 [B, Tq, H, D] product).
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_CHECKS_CUDNN_DROPOUT = _torch_version() >= (2, 12)
"""torch >= 2.12 refuses cuDNN attention for a dropout that is not a multiple of 1/16 (GPT-2's
0.1 then goes to flash); 2.11 took cuDNN for it (snap-gpt2-bf16-small, torch 2.11)."""

# SDPBackend values (torch.nn.attention.SDPBackend)
MATH, FLASH, EFFICIENT, CUDNN = 0, 1, 2, 3
DEFAULT_ORDER = [FLASH, EFFICIENT, MATH, CUDNN]
NAMES = {MATH: "math", FLASH: "flash", EFFICIENT: "efficient", CUDNN: "cudnn"}


def prefers_cudnn(cc: tuple[int, int], cuda: tuple[int, int], cudnn: int) -> bool:
    """sdp_utils.cpp ``check_prefer_cudnn_attention``: cuDNN first on sm90/sm100 with cuDNN >
    9.15 (with CUDA < 13 only for minor versions 0 and 3)."""
    if cudnn <= 91500 or cc[0] not in (9, 10):
        return False
    return cuda >= (13, 0) or cc[1] in (0, 3)


def priority_order(cc, cuda, cudnn) -> list[int]:
    current = [int(x) for x in torch._C._get_sdp_priority_order()][:4] if hasattr(
        torch._C, "_get_sdp_priority_order") else DEFAULT_ORDER
    if current == DEFAULT_ORDER and prefers_cudnn(cc, cuda, cudnn):
        return [CUDNN, FLASH, EFFICIENT, MATH]
    return current


def _enabled(backend: int) -> bool:
    b = torch.backends.cuda
    return {MATH: b.math_sdp_enabled, FLASH: b.flash_sdp_enabled, EFFICIENT: b.mem_efficient_sdp_enabled,
            CUDNN: b.cudnn_sdp_enabled}[backend]()


def _requires_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _common_ok(q, k, v, mask, enable_gqa: bool, supports_gqa: bool) -> bool:
    """check_tensor_shapes, check_batch_size_and_num_heads_dense<supports_gqa>,
    check_nonzero_sequence_lengths. Query heads that differ from the key/value heads pass only
    with ``enable_gqa`` on a backend built with grouped-query support (flash, cuDNN; the
    memory-efficient kernel has none, so GQA attention in fp32 takes the math path)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.is_nested:
        return False
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if not (hq == hk == hv):
        if not (enable_gqa and supports_gqa and hk == hv and hq % hk == 0):
            return False
    return q.shape[2] > 0 and k.shape[2] > 0


def _last_dim_contiguous(q, k, v, mask, ignore_singleton: bool) -> bool:
    """check_last_dim_stride_equals_1_dense: q, k, v and (on GPUs) the mask need stride 1 in
    their last dimension (a [1, H, Tq, Tk] bias permuted from [Tq, Tk, H], as T5's position bias,
    sends attention to the math path)."""
    ok = all(t.stride(-1) == 1 for t in (q, k, v)) or (ignore_singleton and q.shape[-1] == 1)
    return ok and (mask is None or mask.stride(-1) == 1)


def can_use_cudnn(cc, cudnn, q, k, v, mask, dropout_p, enable_gqa) -> bool:
    if q.dtype not in (torch.float16, torch.bfloat16) or cc < (8, 0) or cc > (12, 1):
        return False
    if dropout_p > 0 and 91100 < cudnn < 91400:
        return False
    if dropout_p * 16 != math.floor(dropout_p * 16) and TORCH_CHECKS_CUDNN_DROPOUT:
        return False  # check_cudnn_dropout: cuDNN's dropout resolution is 1/16 (pytorch#174245)
    if mask is not None:  # check_attn_mask_shape
        if mask.requires_grad or mask.shape[-2] not in (q.shape[2], 1) or mask.shape[-1] not in (k.shape[2], 1):
            return False
        if mask.dim() == 4:
            if mask.shape[0] not in (1, q.shape[0]) or mask.shape[1] not in (1, q.shape[1]):
                return False
        elif mask.dim() != 2:
            return False
    if not _common_ok(q, k, v, mask, enable_gqa, supports_gqa=True):
        return False
    if not _last_dim_contiguous(q, k, v, mask, ignore_singleton=True):
        return False
    b, h, sq, dqk = q.shape
    sk, dv = k.shape[2], v.shape[3]
    if b > 65535 or h > 65535:
        return False
    sm90_10x = (cc[0] == 9 and cc[1] == 0) or cc[0] == 10
    limit = 256 if (sm90_10x and cudnn > 92200) else 192 if (sm90_10x and cudnn >= 91100 and dqk == 192
                                                             and dv == 128) else 128
    if dqk > limit or dv > limit or dqk % 8 or dv % 8 or sk == 1 or (dropout_p > 0 and sq == 1):
        return False
    if sm90_10x and cudnn > 92200 and _requires_grad(q, k, v):  # check_cudnn_d256_bprop_head_dim
        if not ((dqk <= 128 and dv <= 128) or (dqk, dv) in ((192, 128), (256, 256))):
            return False
    return True


def can_use_flash(cc, q, k, v, mask, dropout_p, is_causal, enable_gqa) -> bool:
    if mask is not None or q.dtype not in (torch.float16, torch.bfloat16) or not ((8, 0) <= cc <= (12, 1)):
        return False
    d = q.shape[-1]
    if not (q.dim() == 4 and d == k.shape[-1] == v.shape[-1] and d <= 256):
        return False
    if _requires_grad(q, k, v) and ((8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)):
        if not (d <= 192 or (dropout_p == 0 and d > 224)):
            return False
    if is_causal and q.shape[2] != k.shape[2]:
        return False
    return _common_ok(q, k, v, mask, enable_gqa, supports_gqa=True) and _last_dim_contiguous(q, k, v, mask, ignore_singleton=True)


def can_use_efficient(cc, q, k, v, mask, enable_gqa) -> bool:
    if not ((5, 0) <= cc <= (12, 1)):
        return False
    allowed = (torch.float16, torch.float32, torch.bfloat16) if cc >= (8, 0) else (torch.float16, torch.float32)
    if q.dtype not in allowed or q.dim() != 4:
        return False
    half = q.dtype in (torch.float16, torch.bfloat16)
    align = max(4 if cc >= (8, 0) else 1, (128 // (16 if half else 32)) if (cc >= (8, 0) or (cc >= (7, 0) and half))
                else 1)
    dq, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if dq != dk or dq % align or dv % align:
        return False
    if cc >= (8, 0):  # check_data_ptr_alignment_mem_efficient (the allocator aligns bases to 512 bytes)
        if any((t.storage_offset() * t.element_size()) % (align * t.element_size()) for t in (q, k, v)):
            return False
    return _common_ok(q, k, v, mask, enable_gqa, supports_gqa=False) and _last_dim_contiguous(q, k, v, mask, ignore_singleton=False)


def select_backend(cc, cuda, cudnn, q, k, v, mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False) -> int:
    """The backend ``select_sdp_backend`` returns for these inputs on a card of compute
    capability ``cc`` with this CUDA/cuDNN (MATH when no fused kernel applies)."""
    for backend in priority_order(cc, cuda, cudnn):
        if not _enabled(backend):
            continue
        if backend == CUDNN and can_use_cudnn(cc, cudnn, q, k, v, mask, dropout_p, enable_gqa):
            return CUDNN
        if backend == FLASH and can_use_flash(cc, q, k, v, mask, dropout_p, is_causal, enable_gqa):
            return FLASH
        if backend == EFFICIENT and can_use_efficient(cc, q, k, v, mask, enable_gqa):
            return EFFICIENT
        if backend == MATH:
            return MATH
    return MATH


def _float_mask(mask, dtype):
    """attention.cpp ``convert_boolean_attn_mask``: a boolean mask becomes a float mask (0 where
    True, -inf where False) in the query's dtype; a float mask is used as is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), -math.inf, torch.zeros((), dtype=dtype, device=mask.device))


def _efficient_mask(mask, q, k):
    """attention.cpp ``preprocess_mask``: expand to [B, H, Tq, Tk]; pad the keys to a multiple of
    16 (a materialised copy) when they are not aligned."""
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    last = mask.shape[-1]
    if last % 16 or mask.stride(-1) != 1:
        pad = (16 - last % 16) % 16
        mask = torch.nn.functional.pad(mask, (0, pad))[..., :last]
    return mask


def sdpa(cc, cuda, cudnn, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False):
    """``scaled_dot_product_attention`` as the CUDA build runs it (attention.cpp)."""
    backend = select_backend(cc, cuda, cudnn, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    lse = _requires_grad(query, key, value)
    if backend == CUDNN:
        mask = _float_mask(attn_mask, query.dtype)
        return aten._scaled_dot_product_cudnn_attention(query, key, value, mask, lse, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    if backend == FLASH:
        d = query.shape[-1]
        pad = (8 - d % 8) % 8
        q, k, v = ((torch.nn.functional.pad(t, (0, pad)) if pad else t) for t in (query, key, value))
        og_scale = scale if scale is not None else 1.0 / math.sqrt(d)
        out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=og_scale)[0]
        return out[..., :d] if pad else out
    if backend == EFFICIENT:
        mask = _float_mask(attn_mask, query.dtype)
        if mask is not None:
            mask = _efficient_mask(mask, query, key)
        return aten._scaled_dot_product_efficient_attention(query, key, value, mask, lse, dropout_p, is_causal,
                                                            scale=scale)[0]
    return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, None,
                                                   scale=scale, enable_gqa=enable_gqa)[0]


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def kernel_buffers(func, args, out) -> list[tuple[str, int, bool]]:
    """Buffers the fused attention kernels allocate inside one call, in allocation order, as
    (what, bytes, held): all are freed before the call returns; one not ``held`` is freed
    before the next is allocated (see the module docstring)."""
    if func is aten._scaled_dot_product_cudnn_attention.default:
        return [("cudnn attention workspace", 256, True)]
    if func is aten._scaled_dot_product_cudnn_attention_backward.default:
        q = args[1]
        b, h, sq, d = q.shape
        return [("cudnn attention backward workspace", b * h * sq * d * 4 + b * h * sq * 4 + 256, True)]
    if func is aten._scaled_dot_product_flash_attention_backward.default:
        grad_out, q, _k, _v, o = args[:5]
        b, h, sq, d = q.shape
        sq_r, d_r = _round(sq, 128), (_round(d, 32) if d <= 192 else 256)
        bufs = _contiguous_copies(grad_out, o)
        return bufs + [("flash softmax_d", b * h * sq_r * 4, True), ("flash dq_accum", b * sq_r * h * d_r * 4, True)]
    if func is aten._scaled_dot_product_efficient_attention_backward.default:
        grad_out, q, _k, v, _bias, o = args[:6]
        b, h, sq, d = q.shape
        bufs = _contiguous_copies(grad_out)
        if q.dtype == torch.float32:  # delta = (grad_out.float() * out.float()).sum(-1): not computed in-kernel
            bufs.append(("efficient attention delta", b * sq * h * v.shape[-1] * 4, False))
        block_i = 64 if (q.dtype == torch.float32 or max(d, v.shape[-1]) <= 64) else 128
        gq = b * h * (-(-sq // block_i)) * (block_i * _round(d, 64) * 4 + 16)
        return bufs + [("efficient attention gradQ workspace", gq, True)]
    return []


def _contiguous_copies(*ts) -> list[tuple[str, int, bool]]:
    """The backward kernels read grad_out (and out) in [B, T, H, D] layout, contiguous: a copy
    when the [B, H, T, D] tensor they get is not that layout."""
    out = []
    for t in ts:
        if not t.transpose(1, 2).is_contiguous():
            out.append(("attention backward contiguous copy", t.numel() * t.element_size(), True))
    return out
