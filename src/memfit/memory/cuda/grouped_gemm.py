"""Rule: mixture-of-experts grouped GEMMs take the kernels they take on the card.

Two choices are made on a real card that a trace on fake CPU tensors would make the CPU's way:

- **transformers' choice** (``transformers.integrations.moe._can_use_grouped_mm``): the
  ``grouped_mm`` experts call ``torch.nn.functional.grouped_mm`` on CUDA cards of compute
  capability 8.0 and up, and otherwise (T4, V100) transformers' own fallback op
  (``transformers::grouped_mm_fallback``: a zero-filled output and one ``mm`` per expert, its
  backward a zero-filled gradient of all experts' weights). On CPU tensors it asks about the
  CPU instead; during a GPU-target trace it answers for the card (and, as it does, refuses non-bf16
  weights under ``torch.compile``).
- **PyTorch's kernel** for ``aten._grouped_mm`` (aten/src/ATen/native/cuda/GroupedBlas.cpp
  ``_grouped_mm_cuda``): bf16 inputs and output on sm90/sm100 take CUTLASS's grouped GEMM
  (``bf16bf16_grouped_mm``, cuda/GroupMM.cu), which allocates through the caching allocator, for
  the duration of the call, its argument block (per group: A, B and output pointers, aligned to
  two groups, three 8-byte strides and a 12-byte problem shape) and the kernel's workspace; the
  output is created before them. Every other case (fp32, fp16, bf16 before Hopper) runs
  ``_grouped_mm_fallback``: the offsets copied to the host and one cuBLAS ``mm_out`` per group into
  the output, so it allocates nothing on the device but the thread's cuBLAS workspace.

The CUTLASS workspace is estimated (``Gemm::get_workspace_size`` is not computed here): the
ptr-array kernels keep one 128-byte TMA descriptor per operand (A, B, C, D) per SM. Both buffers
are a few tens of KiB, freed when the call returns.
"""

from __future__ import annotations

import contextlib
import sys

import torch

aten = torch.ops.aten

TMA_DESCRIPTOR_BYTES = 128
_POINTER, _STRIDE, _PROBLEM_SHAPE = 8, 8, 12


def fast_path(device, args, kwargs) -> bool:
    """Does ``_grouped_mm`` take CUTLASS's bf16 kernel on ``device`` (GroupedBlas.cpp)?"""
    mat_a, mat_b = args[0], args[1]
    out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None) or torch.bfloat16
    return (device.compute_capability[0] in (9, 10) and mat_a.dtype == torch.bfloat16
            and mat_b.dtype == torch.bfloat16 and out_dtype == torch.bfloat16)


def cutlass_buffers(device, args) -> list[tuple[str, int, bool]]:
    """The argument block and workspace CUTLASS's grouped GEMM allocates (held together)."""
    mat_a, mat_b = args[0], args[1]
    offs = args[2] if len(args) > 2 else None
    groups = offs.size(0) if offs is not None else (mat_a.size(0) if mat_a.dim() == 3 else mat_b.size(0))
    aligned = -(-groups // 2) * 2
    arguments = aligned * 3 * _POINTER + groups * _PROBLEM_SHAPE + 3 * groups * _STRIDE
    workspace = 4 * TMA_DESCRIPTOR_BYTES * device.sm_count
    return [("cutlass grouped gemm arguments", arguments, True), ("cutlass grouped gemm workspace", workspace, True)]


@contextlib.contextmanager
def transformers_choice(device):
    """transformers' ``_can_use_grouped_mm`` answered for ``device`` (see the module docstring)."""
    moe = sys.modules.get("transformers.integrations.moe")
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:
        yield
        return
    capable = device.compute_capability >= (8, 0)

    def can_use_grouped_mm(input, weight, offs) -> bool:
        if moe.is_torchdynamo_compiling() and weight.dtype != torch.bfloat16:
            return False
        return capable and (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm"))

    moe._can_use_grouped_mm = can_use_grouped_mm
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original
