"""``aten._grouped_mm`` on fake tensors in every dtype its real kernels take.

NOTE [ Grouped GEMM on fake tensors ]
transformers' mixture-of-experts layers run their experts with ``torch.nn.functional.grouped_mm``
(``experts_implementation="grouped_mm"``, the default since transformers 5): the tokens, sorted by
expert, times each expert's weight, in one call (``aten._grouped_mm``). Its real kernels take
float32, bfloat16 and float16 (``_grouped_mm_validate_inputs`` in ATen/native/GroupedMMUtils.h):
on the CPU, and on CUDA outside the bf16 fast path, they loop over the groups with ``mm_out``
into one output. PyTorch's meta kernel (``meta_grouped_mm`` in torch/_meta_registrations.py)
restates only the CUDA fast path's checks: it refuses float32 ("Expected mat_a to be BFloat16
or supported Float16 matrix") and float16 without cuBLASLt's grouped GEMM. So a model that trains
for real in fp32 could not be traced on fake tensors.

While a fake trace runs, :func:`grouped_mm_meta` adds an op implementation to fake mode's own
list (``torch._subclasses.fake_impls.op_implementations_checks``, consulted before meta kernels;
a test fails loudly if it moves) that leaves bfloat16 calls to PyTorch's meta kernel and answers
float32 and float16 ones with the real kernel's checks and its output:
``create_grouped_gemm_output_tensor``, whose last dimension is padded to 16 bytes on every build
but ROCm's (the fallback's ``mm_out`` writes into slices of it; in fp32 it allocates nothing
else, a profiled run on this CPU shows, tests/unit/test_moe.py; bf16's per-expert packing is
probed). The tracker sees ``_grouped_mm`` as any op. Not a Meta kernel registered with
``torch.library``: fake mode kept calling such a kernel after its library was destroyed (the
dispatch table restored), so it could not be scoped to the trace; not a dispatch mode: one more
Python call per op slowed every trace by 10%. Autograd's formulas for ``_grouped_mm`` call ``_grouped_mm``
again (the weight gradient is a 2-D x 2-D grouped GEMM), so the backward goes through the same
mode. A test fails loudly when PyTorch's meta kernel accepts float32 itself (then this goes).
"""

from __future__ import annotations

import contextlib

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def meta_refuses(dtype: torch.dtype) -> bool:
    """Does PyTorch's own meta kernel refuse a ``_grouped_mm`` its real kernels run?"""
    a = torch.empty(16, 8, dtype=dtype, device="meta")
    b = torch.empty(2, 8, 8, dtype=dtype, device="meta")
    offs = torch.empty(2, dtype=torch.int32, device="meta")
    try:
        torch.ops.aten._grouped_mm.default(a, b, offs)
    except RuntimeError:
        return True
    return False


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def _check_strides(name: str, mat: torch.Tensor) -> None:
    """GroupedMMUtils.h ``check_valid_strides_and_return_transposed`` (the data pointer's own
    alignment is checked on CUDA only, and a fake tensor has none)."""
    stride, size, end = mat.stride(), mat.shape, mat.dim() - 1
    alignment = 16 // mat.element_size()
    if stride[end - 1] == 1 and stride[end] >= max(1, size[end - 1]):
        _check(stride[end] % alignment == 0, f"{name}: strides should be multiple of 16 bytes")
    elif stride[end] == 1 and stride[end - 1] >= max(1, size[end]):
        _check(stride[end - 1] % alignment == 0, f"{name}: strides should be multiple of 16 bytes")
    else:
        _check(False, f"Invalid strides/sizes, got {list(stride)} for strides and {list(size)} for sizes")


def output_like_real(mat_a: torch.Tensor, mat_b: torch.Tensor, offs, out_dtype: torch.dtype) -> torch.Tensor:
    """GroupedMMUtils.h ``create_grouped_gemm_output_tensor`` (not ROCm): the last dimension's
    stride padded to 16 bytes."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)] if b2 else [mat_a.size(0), mat_b.size(-1)]
    else:
        size = [mat_a.size(1), mat_b.size(1)] if b2 else [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    alignment = 16 // torch.empty((), dtype=out_dtype).element_size()
    padded = list(size)
    padded[-1] = (size[-1] + alignment - 1) // alignment * alignment
    strides, step = [0] * len(size), 1
    for i in reversed(range(len(size))):
        strides[i] = step
        step *= padded[i]
    return torch.empty_strided(size, strides, dtype=out_dtype, device=mat_a.device)


def _real_kernel_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The checks and output of the real kernels (``_grouped_mm_validate_inputs``,
    ``_resolve_grouped_mm_out_dtype``, ``create_grouped_gemm_output_tensor``)."""
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        _check(mat.dtype in _DTYPES, f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}")
        _check(mat.dim() in (2, 3), f"{name} has to be 2 or 3d")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if not a2 or not b2:
        _check(mat_a.size(-1) == mat_b.size(-2), "contraction dimension of mat_a and mat_b must match")
    _check_strides("mat_a", mat_a)
    _check_strides("mat_b", mat_b)
    _check((offs is not None) == (a2 or b2),
           "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        _check(offs.dim() == 1 and offs.dtype == torch.int32 and offs.stride(0) == 1,
               "offs has to be a 1D int32 tensor of stride 1")
        if a2 and not b2:
            _check(offs.size(0) == mat_b.size(0), "matrix batch sizes have to match")
        elif b2 and not a2:
            _check(offs.size(0) == mat_a.size(0), "matrix batch sizes have to match")
    _check(bias is None, "Bias not supported yet")
    out_dtype = out_dtype or mat_a.dtype
    _check(out_dtype == mat_a.dtype, "Grouped gemm output dtype must match `mat_a` dtype")
    return output_like_real(mat_a, mat_b, offs, out_dtype)


_GROUPED_MM = torch.ops.aten._grouped_mm.default


@contextlib.contextmanager
def grouped_mm_meta():
    """See NOTE [ Grouped GEMM on fake tensors ]: fake mode's op implementations answer
    ``_grouped_mm`` in the dtypes PyTorch's meta kernel refuses, for the duration of the block."""
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    def applies(func) -> bool:
        return func is _GROUPED_MM

    def fake_grouped_mm(fake_mode, func, *args, **kwargs):
        if args[0].dtype == args[1].dtype == torch.bfloat16:
            return NotImplemented  # PyTorch's meta kernel
        device = args[0].device
        with in_kernel_invocation_manager(fake_mode):  # (the arguments read as meta tensors)
            out = _real_kernel_meta(*args, **kwargs)
        return FakeTensor(fake_mode, out, device)

    entry = (applies, fake_grouped_mm)
    fake_impls.op_implementations_checks.append(entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)
