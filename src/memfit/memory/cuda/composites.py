"""Composite ops that take a different path on CUDA, registered for the duration of a trace."""

from __future__ import annotations

import contextlib

import torch

from memfit.memory.cuda import rnn as rnn_rule
from memfit.memory.cuda import sdpa as sdpa_rule
from memfit.quiet import silenced_warnings

aten = torch.ops.aten


# NOTE [ CUDA composites on CPU tensors ]
# Some ATen ops are *composite*: they are written in terms of other ops and branch on the
# device of their inputs. A GPU preset is traced on fake CPU tensors (autograd cannot run backward
# on fake CUDA tensors without a driver, see memfit.devices.tensor_device), so these branches take
# their CPU side. While a GPU-target trace runs, memfit registers Python kernels for them under
# the ``CompositeImplicitAutograd`` key (``torch.library.Library("aten", "IMPL")``) that take the
# CUDA side instead, calling the very ops the CUDA build calls. Being registered at the dispatcher,
# they apply to every caller (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``'s
# internal call, C++ code); autograd records the inner ops and their own derivative formulas, so
# gradients are those of the CUDA run. The registrations are removed when the trace ends (the
# dispatcher falls back to the built-in kernels); while they exist they apply process-wide.
#
# - ``scaled_dot_product_attention``: the CUDA backend selection (memfit.memory.cuda.sdpa).
# - ``dropout`` / ``dropout_``: CUDA uses the fused ``native_dropout`` (a 1-byte boolean mask is
#   saved for backward); the CPU composite builds a mask of the input's dtype (4 bytes per element
#   in fp32) with ``bernoulli_`` and multiplies (Dropout.cpp ``is_fused_kernel_acceptable``).
# - ``lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``: cuDNN's ``_cudnn_rnn`` (RNN.cpp
#   ``_cudnn_impl``) instead of oneDNN's per-layer kernels (memfit.memory.cuda.rnn).
# - ``linear``: Linear.cpp adds the bias *in place* after ``matmul`` (a non-contiguous input, e.g.
#   a batch-first cuDNN RNN output) unless the bias is a tensor subclass, which a fake tensor is:
#   the trace would allocate a second output-sized tensor (500 MiB for an LSTM LM's vocabulary
#   projection, an H200 snapshot showed none). This kernel takes the real tensors' branch. (The
#   CPU-device trace keeps the built-in kernel.)
def _dropout(input, p, train):
    if train and 0 < p < 1 and input.numel() > 0:
        return aten.native_dropout(input, p, train)[0]
    if not train or p == 0 or input.numel() == 0:
        return input
    return input * torch.zeros_like(input)


def _dropout_(input, p, train):
    if train and 0 < p < 1 and input.numel() > 0:
        return input.copy_(aten.native_dropout(input, p, train)[0])
    if not train or p == 0 or input.numel() == 0:
        return input
    return input.mul_(0)


def _flatten_nd_linear(input, weight, bias):
    rows = 1
    for size in input.shape[:-1]:
        rows *= size
    out = aten.addmm(bias, input.view(rows, input.shape[-1]), weight.t())
    return out.view(*input.shape[:-1], out.shape[1])


def _linear(input, weight, bias=None):
    """Linear.cpp ``linear`` as it runs on real (non-subclass) tensors."""
    dim = input.dim()
    if dim == 2 and bias is not None:
        return aten.addmm(bias, input, weight.t())
    if bias is not None and input.is_contiguous():
        if dim == 3 or (input.layout == torch.strided and weight.layout == torch.strided and bias.dim() == 1):
            return _flatten_nd_linear(input, weight, bias)
    output = aten.matmul(input, weight.t())
    if bias is not None:
        output.add_(bias)
    return output


@contextlib.contextmanager
def cuda_composites(device):
    """Register the CUDA paths of the composite ops above for ``device`` (a GPU Device)."""
    cc, cuda, cudnn = device.compute_capability, device.cuda_version, device.cudnn_version

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return sdpa_rule.sdpa(cc, cuda, cudnn, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    lib = torch.library.Library("aten", "IMPL")
    try:
        with silenced_warnings():
            lib.impl("scaled_dot_product_attention", sdpa, "CompositeImplicitAutograd")
            lib.impl("dropout", _dropout, "CompositeImplicitAutograd")
            lib.impl("dropout_", _dropout_, "CompositeImplicitAutograd")
            lib.impl("linear", _linear, "CompositeImplicitAutograd")
            for name, fn in rnn_rule.composites(device).items():
                lib.impl(name, fn, "CompositeImplicitAutograd")
        yield
    finally:
        lib._destroy()
