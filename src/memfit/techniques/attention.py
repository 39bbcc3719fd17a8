"""Attention without the T x T matrix.

``nn.MultiheadAttention`` returns attention weights by default (``need_weights=True``), which
forces the math path: a [batch, heads, T, T] softmax kept for backward, the single largest
activation of many models, even when the caller throws the weights away (``out, _ = attn(...)``).
With ``attention: auto | sdpa | chunked`` memfit calls it with ``need_weights=False`` (it then
returns ``None`` for the weights, as PyTorch does) and the fused SDPA kernel runs instead.

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from memfit.techniques.base import Config, Export, Key, SearchContext, Technique, choice, register

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


def without_attention_weights(model: nn.Module) -> list[nn.Module]:
    """Call every ``nn.MultiheadAttention`` of ``model`` with ``need_weights=False`` (in place);
    returns the patched modules."""
    patched = []
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            m.forward = functools.partial(_forward_without_weights, m.forward)
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
    """MultiheadAttention without its weights; each attention call picks its kernel as usual."""

    rank = 0

    def label(self, batch_size):
        return None

    def ablations(self):
        return []


@dataclass(frozen=True)
class SDPAttention(Attention):
    """As ``auto``, and Hugging Face models switched to their SDPA implementation."""

    mode = "sdpa"
    rank = None

    def apply(self, parts) -> None:
        super().apply(parts)
        if hasattr(parts.model, "set_attn_implementation"):
            parts.model.set_attn_implementation("sdpa")  # Hugging Face models

    def export(self, into: Export) -> None:
        into.hf_notes.append("attention: sdpa: load the model with from_pretrained(..., attn_implementation='sdpa')")


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
        into.not_carried(self)


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
              parse, order=90, search=search, depends_on_model=True),
    Attention, AutoAttention, SDPAttention, MathAttention, ChunkedAttention)
