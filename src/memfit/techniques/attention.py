"""Attention without the T x T matrix, where the device's kernel has one that saves memory.

``nn.MultiheadAttention`` returns attention weights by default (``need_weights=True``), which
forces its own unfused path: a [batch x heads, T, T] softmax (and dropout) kept for backward,
the single largest activation of many models, even when the caller throws the weights away
(``out, _ = attn(...)``). Called with ``need_weights=False`` it returns ``None`` for the weights
and calls ``scaled_dot_product_attention`` instead, which saves memory *only if* SDPA takes a
fused kernel for that call: its math path is no saving (NOTE [ Attention auto follows the
kernel ]). So ``auto``, the default, switches a call to SDPA only where the target device's
kernel for *that call* is fused (:func:`fused_kernel_saves`); elsewhere the call runs as the
user wrote it, so the empty plan never costs memory. ``sdpa`` switches every call (and Hugging
Face models to their SDPA implementation).

``chunked`` computes every ``scaled_dot_product_attention`` call in query chunks of
``chunk_size`` rows, each under a checkpoint: only one chunk's T x T slice exists at a time and
backward recomputes it (memory O(chunk x T) instead of O(T x T) for kernels without a fused
path, at one extra attention forward). ``math`` forces the unfused kernel (the reference).

Plan key ``attention``: ``auto`` (:class:`AutoAttention`), ``sdpa`` (:class:`SDPAttention`),
``math`` (:class:`MathAttention`), ``chunked`` (:class:`ChunkedAttention`). On CUDA, SDPA's fused
kernels never hold the T x T matrix, so the planner tries chunking on the CPU only, where the math
path (e.g. with attention dropout) does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from memfit.sdpa_backends import MATH, select_backend
from memfit.techniques.base import Config, Export, Key, SearchContext, Technique, choice, register
from memfit.techniques.checkpoint_call import checkpoint
from memfit.techniques.forwards import forward_of

CHUNK_SIZE = 256
MODES = ("auto", "sdpa", "math", "chunked")


def _forward_without_weights(original, *args, **kwargs):
    if len(args) > 4:  # need_weights given positionally
        args = (*args[:4], False, *args[5:])
    else:
        kwargs["need_weights"] = False
    out, _ = original(*args, **kwargs)
    return out, None


def _causal_rows(start: int, rows: int, cols: int, device) -> torch.Tensor:
    """Boolean mask (True = attend) of SDPA's is_causal for query rows start..start+rows."""
    r = torch.arange(start, start + rows, device=device)[:, None]
    return torch.arange(cols, device=device)[None, :] <= r


def chunked_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, chunk_size: int = CHUNK_SIZE):
    q_len, k_len = query.shape[-2], key.shape[-2]
    if q_len <= chunk_size:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    outs = []
    for start in range(0, q_len, chunk_size):
        rows = min(chunk_size, q_len - start)
        mask = attn_mask
        if mask is not None and mask.dim() >= 2 and mask.shape[-2] == q_len:
            mask = mask[..., start:start + rows, :]
        if is_causal:
            causal = _causal_rows(start, rows, k_len, query.device)
            if mask is None:
                mask = causal
            elif mask.dtype == torch.bool:
                mask = mask & causal
            else:
                mask = mask.masked_fill(~causal, float("-inf"))
        fn = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout_p, scale=scale,
                               enable_gqa=enable_gqa)
        q = query[..., start:start + rows, :]
        outs.append(checkpoint(fn, q, key, value, mask, use_reentrant=False, preserve_rng_state=True)
                    if torch.is_grad_enabled() else fn(q, key, value, mask))
    return torch.cat(outs, dim=-2)


class ChunkedSDPA(TorchFunctionMode):
    def __init__(self, chunk_size: int = CHUNK_SIZE):
        super().__init__()
        self.chunk_size = chunk_size

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return chunked_sdpa(*args, **kwargs, chunk_size=self.chunk_size)
        return func(*args, **kwargs)


def _mha_call(original, args, kwargs) -> dict:
    """The arguments of one ``nn.MultiheadAttention.forward`` call by name, defaults filled in."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _sdpa_inputs(module: nn.MultiheadAttention, call: dict):
    """Meta tensors shaped as the q, k, v and mask that ``F.multi_head_attention_forward`` passes to
    SDPA for this call (with ``need_weights=False``), its dropout and causal flag."""
    query, key = call["query"], call["key"]
    batched = query.dim() == 3
    first = module.batch_first and batched
    bsz = (query.shape[0] if first else query.shape[1]) if batched else 1
    tgt, src = (query.shape[1], key.shape[1]) if first else (query.shape[0], key.shape[0])
    src += int(module.bias_k is not None) + int(module.add_zero_attn)
    heads, head_dim = module.num_heads, module.head_dim
    dtype = query.dtype
    if torch.is_autocast_enabled(query.device.type) and dtype.is_floating_point:
        dtype = torch.get_autocast_dtype(query.device.type)  # the in-projection's output dtype
    grad = torch.is_grad_enabled() and (query.requires_grad or module.in_proj_weight is None
                                        or module.in_proj_weight.requires_grad)
    q = torch.empty(bsz, heads, tgt, head_dim, dtype=dtype, device="meta", requires_grad=grad)
    k, v = (torch.empty(bsz, heads, src, head_dim, dtype=dtype, device="meta", requires_grad=grad) for _ in "kv")
    attn_mask, padding, is_causal = call["attn_mask"], call["key_padding_mask"], call["is_causal"]
    mask = None
    if not (is_causal and padding is None):  # else MHA drops the mask and passes the causal hint
        is_causal = False if padding is not None else is_causal
        if padding is not None or (attn_mask is not None and attn_mask.dim() == 3):
            mask = torch.empty(bsz, heads, tgt, src, dtype=dtype, device="meta")
        elif attn_mask is not None:
            mask = torch.empty(1, 1, tgt, src, dtype=dtype, device="meta")
    dropout = module.dropout if module.training else 0.0
    return q, k, v, mask, dropout, is_causal


# NOTE [ Attention auto follows the kernel ]
# SDPA's math path is no saving: on the CPU with dropout it keeps fp32 scores, softmax and dropout
# mask even for bf16 inputs (a post-norm MHA transformer, dim 128, 8 heads, 4 layers, dropout 0.1,
# batch 4, seq 128, on this CPU: peak +1.6% in fp32, +30% in bf16, +41% in bf16-pure). So ``auto``
# switches a call to SDPA only where the target device's kernel for that call is fused: on the CPU,
# flash attention without dropout; on CUDA, the cuDNN, flash or memory-efficient kernel that
# memfit's CUDA kernel model (:mod:`memfit.sdpa_backends`) says PyTorch selects for those shapes,
# dtype, mask and dropout.
def fused_kernel_saves(device, module: nn.MultiheadAttention, call: dict) -> bool:
    """Whether SDPA, for this ``nn.MultiheadAttention`` call with ``need_weights=False``, takes a
    fused kernel on ``device`` (a memfit Device): then it keeps no [B, H, T, T] matrix and saves
    memory over the call as written (NOTE [ Attention auto follows the kernel ])."""
    q, k, v, mask, dropout, is_causal = _sdpa_inputs(module, call)
    if device.kind == "cuda":
        if device.compute_capability is None:
            return True
        backend = select_backend(device.compute_capability, device.cuda_version or (13, 0), device.cudnn_version,
                                 q, k, v, mask, dropout, is_causal)
        return backend != MATH
    # The CPU's only fused kernel is flash attention (sdp_utils_cpp.cpp use_flash_attention_cpp): no
    # dropout, equal head dims, a mask broadcastable to [B, H, Tq, Tk].
    return torch.backends.cuda.flash_sdp_enabled() and dropout == 0.0


def _forward_fused_where_it_saves(device, module, original, *args, **kwargs):
    call = _mha_call(original, args, kwargs)
    if call["need_weights"] and fused_kernel_saves(device, module, call):
        return _forward_without_weights(original, *args, **kwargs)
    return original(*args, **kwargs)


def without_attention_weights_where_fused(model: nn.Module, device) -> list[nn.Module]:
    """Call every ``nn.MultiheadAttention`` of ``model`` with ``need_weights=False`` where that call
    takes a fused SDPA kernel on ``device`` (in place); returns the patched modules."""
    patched = []
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            m.forward = functools.partial(_forward_fused_where_it_saves, device, m, forward_of(m))
            patched.append(m)
    return patched


def without_attention_weights(model: nn.Module) -> list[nn.Module]:
    """Call every ``nn.MultiheadAttention`` of ``model`` with ``need_weights=False`` (in place);
    returns the patched modules."""
    patched = []
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            m.forward = functools.partial(_forward_without_weights, forward_of(m))
            patched.append(m)
    return patched


class Attention(Config):
    """The plan's ``attention``: patches MultiheadAttention modules and gives the context that the
    step holds around forward and backward (backward may recompute attention)."""

    mode = "auto"

    def values(self) -> dict:
        return {"attention": self.mode}

    def apply(self, parts) -> None:
        without_attention_weights(parts.model)
        parts.contexts.append(self.context)

    def context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def label(self, batch_size):
        return f"attn={self.mode}"

    def ablations(self):
        return [(f"attention {self.mode}", AutoAttention())]


@dataclass(frozen=True)
class AutoAttention(Attention):
    """MultiheadAttention without its weights where the device's SDPA kernel for the call is fused,
    else as written (NOTE [ Attention auto follows the kernel ])."""

    rank = 0

    def apply(self, parts) -> None:
        without_attention_weights_where_fused(parts.model, parts.device)
        parts.contexts.append(self.context)

    def label(self, batch_size):
        return None

    def ablations(self):
        return []

    def export(self, into: Export) -> None:
        into.kohya["sdpa"] = True  # (the fused kernels memfit's CUDA model takes)


@dataclass(frozen=True)
class SDPAttention(Attention):
    """Every MultiheadAttention call through SDPA (whichever kernel it takes; on the CPU with dropout
    that is the math path, which costs memory), and Hugging Face models switched to their SDPA
    implementation."""

    mode = "sdpa"
    rank = None

    def apply(self, parts) -> None:
        super().apply(parts)
        if hasattr(parts.model, "set_attn_implementation"):
            parts.model.set_attn_implementation("sdpa")  # Hugging Face models

    def export(self, into: Export) -> None:
        into.hf_notes.append("attention: sdpa: load the model with from_pretrained(..., attn_implementation='sdpa')")
        into.kohya["sdpa"] = True


@dataclass(frozen=True)
class MathAttention(Attention):
    """The unfused kernel, weights included (the reference)."""

    mode = "math"
    rank = None

    def apply(self, parts) -> None:
        parts.contexts.append(self.context)

    def context(self) -> contextlib.AbstractContextManager:
        return sdpa_kernel([SDPBackend.MATH])

    def export(self, into: Export) -> None:
        into.not_carried(self, kohya=False, ai_toolkit=True)  # (sd-scripts' SD/SDXL UNet without sdpa or xformers computes it so)


@dataclass(frozen=True)
class ChunkedAttention(Attention):
    """Attention in query chunks of ``chunk_size`` rows, each recomputed in backward."""

    chunk_size: int = CHUNK_SIZE
    """Query rows per chunk."""
    mode = "chunked"
    rank = 1
    adds_work = True

    def apply(self, parts) -> None:
        super().apply(parts)
        # A function mode is off while it handles ``backward``: checkpointed blocks enter it
        # again for their recomputation.
        parts.recompute_contexts.append(self.context)

    def context(self) -> contextlib.AbstractContextManager:
        return ChunkedSDPA(self.chunk_size)

    def export(self, into: Export) -> None:
        into.kohya["sdpa"] = True  # (sd-scripts' nearest: a fused kernel, not its UNet's whole score matrix)
        into.not_carried(self)


def parse(values: dict) -> Attention:
    mode = choice("attention", values["attention"], MODES)
    return {"auto": AutoAttention(), "sdpa": SDPAttention(), "math": MathAttention(),
            "chunked": ChunkedAttention()}[mode]


def search(ctx: SearchContext) -> list[str]:
    has_attention = any(isinstance(m, nn.MultiheadAttention) or "attention" in type(m).__name__.lower()
                        for m in ctx.model.modules())
    return ["auto", "chunked"] if has_attention and not ctx.device.is_gpu else ["auto"]


TECHNIQUE = register(
    Technique("attention", (Key("attention", "auto", "auto | sdpa | math | chunked.", metavar="ATTENTION"),),
              parse, search=search, depends_on_model=True),
    Attention, AutoAttention, SDPAttention, MathAttention, ChunkedAttention)
