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
- **memory-efficient** (``_scaled_dot_product_efficient_attention``): fp32 too, sm50+, grouped-query
  heads from torch 2.14 (``TORCH_EFFICIENT_GQA``), any
  additive mask (boolean masks become -inf/0 float masks; an unaligned mask is padded to a multiple of 8
  keys as given, then broadcast as a view), head dim divisible by 4 (fp32) or 8 (fp16/bf16) on sm80+.
- **math** otherwise (``_scaled_dot_product_attention_math``, the same ops as on the CPU).

Source: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (``select_sdp_backend`` and the
``can_use_*`` filters, restated in :mod:`memfit.sdpa_backends`) and attention.cpp
(``scaled_dot_product_attention``: mask conversion, padding of the head dim to a multiple of 8 for flash). The kernels are called as the CUDA
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
  fp32 [B, Tq, H, D] product); with grouped-query heads (torch >= 2.14), ``grad_k_expanded`` and
  ``grad_v_expanded`` [B, Tk, H, D] in the inputs' dtype, summed into the K/V heads' gradients.
"""

from __future__ import annotations

import math

import torch

from memfit.sdpa_backends import (  # noqa: F401 - NAMES, MATH, TORCH_CHECKS_CUDNN_DROPOUT: this rule's vocabulary
    CUDNN,
    EFFICIENT,
    FLASH,
    MATH,
    NAMES,
    TORCH_CHECKS_CUDNN_DROPOUT,
    needs_grad,
    select_backend,
)

aten = torch.ops.aten


def _float_mask(mask, dtype):
    """attention.cpp ``convert_boolean_attn_mask``: a boolean mask becomes a float mask (0 where
    True, -inf where False) in the query's dtype, ``at::where(mask, 0.0, -inf)`` (since torch 2.6, pytorch#139784:
    no inverted boolean copy of the mask first); a float mask is used as is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.full((), -math.inf, dtype=dtype, device=mask.device))


def _efficient_mask(mask, q, k):
    """attention.cpp ``preprocess_mask``: a mask whose strides are not multiples of 8 elements (or whose last
    stride is not 1) is padded on its last dimension (``pad_bias``: by ``8 - Tk % 8``, 8 where already a
    multiple) and sliced back: a copy of the mask as given, before it is broadcast. Then it is expanded to
    [B, H, Tq, Tk], a view: a [B, 1, 1, Tk] key mask (HunyuanVideo's) stays [B, 1, 1, Tk] bytes, not H x Tq
    times that."""
    if any(s % EFFICIENT_MASK_ALIGNMENT for s in mask.stride()[:-1]) or mask.stride(-1) != 1:
        last = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, (0, EFFICIENT_MASK_ALIGNMENT - last % EFFICIENT_MASK_ALIGNMENT))
        mask = mask[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


EFFICIENT_MASK_ALIGNMENT = 8
"""``mem_eff_alignment`` in attention.cpp's ``preprocess_mask``."""
EFFICIENT_RF_HEAD_DIM = 128
"""The widest head the memory-efficient forward keeps its output in registers for (kernel_forward.h's
``kKeepOutputInRF``); wider half-precision heads run the ``gmem`` kernels, which accumulate the output in an fp32
``output_accum`` buffer of [B, Tq, H, Dv] (attention.cu), freed when the call returns."""


def sdpa(cc, cuda, cudnn, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False):
    """``scaled_dot_product_attention`` as the CUDA build runs it (attention.cpp)."""
    backend = select_backend(cc, cuda, cudnn, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    lse = needs_grad(query, key, value)
    mask = _float_mask(attn_mask, query.dtype)  # (chosen on the mask as given, converted before any backend runs)
    if backend == CUDNN:
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
        if mask is not None:
            mask = _efficient_mask(mask, query, key)
        return aten._scaled_dot_product_efficient_attention(query, key, value, mask, lse, dropout_p, is_causal,
                                                            scale=scale)[0]
    return aten._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal, None,
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
        grad_out, q, k, _v, o = args[:5]
        b, h, sq, d = q.shape
        sq_r, d_r = _round(sq, 128), (_round(d, 32) if d <= 192 else 256)
        bufs = _contiguous_copies(grad_out, o)
        bufs += [("flash softmax_d", b * h * sq_r * 4, True), ("flash dq_accum", b * sq_r * h * d_r * 4, True)]
        if k.shape[1] != h:  # (grouped-query heads: dK and dV per query head, summed into the K/V heads at the end)
            expanded = b * k.shape[2] * h * d * q.element_size()
            bufs += [("flash dk_expanded", expanded, True), ("flash dv_expanded", expanded, True)]
        return bufs
    if func is aten._scaled_dot_product_efficient_attention.default:
        q, v = args[0], args[2]
        if q.dtype in (torch.float16, torch.bfloat16) and max(q.shape[-1], v.shape[-1]) > EFFICIENT_RF_HEAD_DIM:
            b, h, sq, _ = q.shape  # (its output accumulates in an fp32 buffer: the kernels for heads over 128 wide)
            return [("efficient attention output accumulator", b * sq * h * v.shape[-1] * 4, True)]
        return []
    if func is aten._scaled_dot_product_efficient_attention_backward.default:
        grad_out, q, k, v, _bias, o = args[:6]
        b, h, sq, d = q.shape
        bufs = _contiguous_copies(grad_out)
        if k.shape[1] != h:  # (grouped-query heads, torch >= 2.14: dK and dV per query head, summed after)
            sk = k.shape[2]
            bufs += [("efficient grad_k_expanded", b * sk * h * d * k.element_size(), True),
                     ("efficient grad_v_expanded", b * sk * h * v.shape[-1] * v.element_size(), True)]
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
