"""Frozen linear weights in float8 (e4m3), upcast per layer for each matmul: ``base_weights: fp8``.

Memory/compute trade-off, per frozen linear weight of N elements: N bytes of float8 e4m3 codes
plus one fp32 scale per output row, instead of 2N (bf16) or 4N (fp32): half a bf16 model (FLUX.1-dev:
11.9 GB instead of 23.8 GB), as kohya's ``--fp8_base`` keeps it. Each matmul upcasts its weight to
the compute dtype (autocast's, else the layer's), an [out, in] temporary of 2N bytes (4N in fp32)
that lives for that one matmul, in forward and again in backward (for the input's gradient): one
weight-sized temporary at a time, and a memory-bound pass over the weight each time. Backward keeps
the float8 weight itself, not its upcast copy, so nothing weight-sized is held from forward to
backward. Lossy: e4m3 keeps 3 mantissa bits (a relative rounding error of at most 1/16 per weight);
scaling each row by its largest magnitude keeps the small rows in range. On a random layer the
output's relative error against the bf16 layer is about 2.5% (the tests bound it by 3.5%, and a few
training steps' losses within 1% of a bf16 base's).

Why not torchao's float8 weight-only path (``Float8WeightOnlyConfig``): it dequantizes in
``__torch_function__``, outside autograd's view, so autograd saves the upcast bf16 weight of every
layer for backward (``saved_tensors_hooks`` show a bf16 [out, in] tensor per layer): from forward to
backward the step holds the fp8 weights *and* a bf16 copy of each, more than a bf16 base alone. And
a LoRA needs an ``nn.Linear`` to wrap: this layer is one (peft's ``compute_dtype`` attribute keeps
the adapter's matrices in the compute dtype, not in float8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = "float8_e4m3fn"
"""torch's name of the format (absent from a torch without float8)."""
E4M3_MAX = 448.0
"""The largest finite e4m3 magnitude: each row's largest weight is scaled to it."""
CHUNK_BYTES = 64 * 2**20
"""Quantizing works on rows in fp32 chunks of at most this many bytes: the temporary a weight's
quantization adds while the model loads, whatever the layer's size."""


def float8_available() -> bool:
    return hasattr(torch, FP8)


def upcast(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype``: one [out, in] temporary (the scale multiplies in place, in fp32)."""
    return weight.to(dtype).mul_(scale)


class Fp8Matmul(torch.autograd.Function):
    """``x @ (codes * scale).T + bias``, saving the float8 codes (a frozen leaf) for backward."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, dtype):
        ctx.save_for_backward(weight, scale)
        ctx.dtype, ctx.x_dtype, ctx.with_bias = dtype, x.dtype, bias is not None
        w = upcast(weight, scale, dtype)
        return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad.to(ctx.dtype) @ upcast(weight, scale, ctx.dtype)).to(ctx.x_dtype)
        if ctx.with_bias and ctx.needs_input_grad[3]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, None, None, grad_bias, None


class Float8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose frozen weight is float8 e4m3 codes with one fp32 scale per output row
    (buffer ``scale``, [out, 1]); forward computes in ``compute_dtype``, or autocast's when it is on.

    Made from a linear by :meth:`from_linear` holding that linear's weight, not yet quantized (how
    ``base_weights`` replaces layers before the weights arrive); :func:`quantize` gives it its codes."""

    def __init__(self, in_features: int, out_features: int, compute_dtype: torch.dtype) -> None:
        torch.nn.Module.__init__(self)  # (nn.Linear's own __init__ would allocate a weight)
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.register_parameter("bias", None)
        self.register_buffer("scale", None)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Float8Linear:
        layer = cls(linear.in_features, linear.out_features, linear.weight.dtype)
        layer.weight = torch.nn.Parameter(linear.weight.data, requires_grad=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else self.compute_dtype
        return Fp8Matmul.apply(x, self.weight, self.scale, self.bias, dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8_e4m3 weight, compute_dtype={self.compute_dtype}"


@torch.no_grad()
def quantize(layer: Float8Linear, full: torch.Tensor) -> torch.nn.Parameter:
    """``full`` ([out, in], on its device) as float8 codes, ``layer.scale`` set to each row's
    largest magnitude over 448; works on fp32 row chunks of at most :data:`CHUNK_BYTES`."""
    fp8 = getattr(torch, FP8)
    amax = torch.linalg.vector_norm(full, ord=float("inf"), dim=1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp_(min=torch.finfo(torch.float32).tiny) / E4M3_MAX
    codes = torch.empty(full.shape, dtype=fp8, device=full.device)
    rows = max(1, CHUNK_BYTES // max(1, 4 * full.shape[1]))
    for start in range(0, full.shape[0], rows):
        end = start + rows
        codes[start:end] = full[start:end].to(torch.float32, copy=True).div_(scale[start:end])
    layer.scale = scale
    return torch.nn.Parameter(codes, requires_grad=False)
