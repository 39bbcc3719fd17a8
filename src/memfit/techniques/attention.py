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
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

CHUNK_SIZE = 256


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


class Attention:
    """The plan's ``attention`` field: patches MultiheadAttention modules and gives the context
    that the step holds around forward and backward (backward may recompute attention)."""

    def __init__(self, mode: str = "auto", chunk_size: int = CHUNK_SIZE):
        self.mode, self.chunk_size = mode, chunk_size
        self.patched: list[nn.Module] = []

    def apply(self, model: nn.Module) -> nn.Module:
        if self.mode in ("auto", "sdpa", "chunked"):
            for m in model.modules():
                if isinstance(m, nn.MultiheadAttention):
                    m.forward = functools.partial(_forward_without_weights, m.forward)
                    self.patched.append(m)
        if self.mode == "sdpa" and hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("sdpa")  # Hugging Face models
        return model

    def context(self) -> contextlib.AbstractContextManager:
        """Held around forward and backward by the step. A function mode is off while it handles
        ``backward``, so checkpointed blocks also enter it for their recomputation (see
        memfit.techniques.checkpointing, ``recompute_contexts``)."""
        if self.mode == "math":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            return sdpa_kernel([SDPBackend.MATH])
        if self.mode == "chunked":
            return ChunkedSDPA(self.chunk_size)
        return contextlib.nullcontext()
