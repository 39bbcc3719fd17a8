"""Which ``scaled_dot_product_attention`` kernel PyTorch's CUDA build selects, from tensor metadata.

``select_sdp_backend`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, restated: the
priority order of the card (cuDNN first on sm90/sm100 with cuDNN > 9.15), then each backend's
``can_use_*`` filters on dtype, head dim, mask, dropout, strides and grouped-query heads; MATH when
no fused kernel applies. Pure functions of shapes, dtypes, strides and the card's compute
capability and library versions: they read no data, so meta and fake tensors answer as real ones.

Two users: the CUDA kernel model of GPU-preset traces (:mod:`memfit.memory.cuda.sdpa`, which then
calls the chosen kernel and books its buffers), and ``attention: auto``
(:mod:`memfit.techniques.attention`), which sends a MultiheadAttention call to SDPA only where the
kernel selected here is a fused one. This module sits beside :mod:`memfit.devices` (what a device
runs) so that both may use it.
"""

from __future__ import annotations

import math

import torch


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_release() -> str:
    """The installed torch's release (``2.14.1``), whose kernel choices the CUDA model follows: a GPU run with another
    torch may choose otherwise (``TORCH_EFFICIENT_GQA``, ``TORCH_CHECKS_CUDNN_DROPOUT``)."""
    return torch.__version__.split("+")[0]


RULES_SINCE = {"TORCH_CHECKS_CUDNN_DROPOUT": (2, 12), "TORCH_EFFICIENT_GQA": (2, 14)}
"""The switches below by the torch release that brought them: on for the installed torch from that release (a
prediction of a GPU row recorded with an older torch sets them as that torch had them: tools/gpu/rows.py)."""

TORCH_CHECKS_CUDNN_DROPOUT = _torch_version() >= RULES_SINCE["TORCH_CHECKS_CUDNN_DROPOUT"]
"""torch >= 2.12 refuses cuDNN attention for a dropout that is not a multiple of 1/16 (GPT-2's
0.1 then goes to flash); 2.11 took cuDNN for it (snap-gpt2-bf16-small, torch 2.11)."""

TORCH_EFFICIENT_GQA = _torch_version() >= RULES_SINCE["TORCH_EFFICIENT_GQA"]
"""torch >= 2.14's memory-efficient kernel runs grouped-query attention itself (pytorch#191085: K/V read per
group in forward, dK and dV per query head in backward, summed into the K/V heads after), and every fused
kernel takes a single K/V head without ``enable_gqa``. 2.14.1's libtorch_cuda has it (its backward's
``grad_k_expanded``); 2.13.0's and 2.11's do not, and send such attention in fp32, or in half precision
before sm80, to the math path and its [B, H, Tq, Tk] scores. GPU rows recorded with an earlier torch are
predicted with this off (tools/gpu/rows.py, ``recorded_environment``)."""


def rules() -> tuple[bool, ...]:
    """The switches' values now, in ``RULES_SINCE``'s order (what a cache of predicted kernels is keyed by)."""
    return tuple(globals()[name] for name in RULES_SINCE)


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


def needs_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _common_ok(q, k, v, mask, enable_gqa: bool, supports_gqa: bool) -> bool:
    """check_tensor_shapes, check_batch_size_and_num_heads_dense<supports_gqa>,
    check_nonzero_sequence_lengths. Query heads that differ from the key/value heads pass only
    with ``enable_gqa`` on a backend built with grouped-query support (flash, cuDNN, and the
    memory-efficient kernel from torch 2.14: before, GQA attention in fp32 takes the math path), or,
    from torch 2.14, as one K/V head broadcast over them (``TORCH_EFFICIENT_GQA``)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.is_nested:
        return False
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if not (hq == hk == hv):
        grouped = enable_gqa and supports_gqa and hk == hv and hq % hk == 0
        if not (grouped or (TORCH_EFFICIENT_GQA and hk == hv == 1)):
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
    if sm90_10x and cudnn > 92200 and needs_grad(q, k, v):  # check_cudnn_d256_bprop_head_dim
        if not ((dqk <= 128 and dv <= 128) or (dqk, dv) in ((192, 128), (256, 256))):
            return False
    return True


def can_use_flash(cc, q, k, v, mask, dropout_p, is_causal, enable_gqa) -> bool:
    if mask is not None or q.dtype not in (torch.float16, torch.bfloat16) or not ((8, 0) <= cc <= (12, 1)):
        return False
    d = q.shape[-1]
    if not (q.dim() == 4 and d == k.shape[-1] == v.shape[-1] and d <= 256):
        return False
    if needs_grad(q, k, v) and ((8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)):
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
    return (_common_ok(q, k, v, mask, enable_gqa, supports_gqa=TORCH_EFFICIENT_GQA)
            and _last_dim_contiguous(q, k, v, mask, ignore_singleton=False))


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
