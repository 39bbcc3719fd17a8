"""Rule: a CUDA reduction that splits its inputs across blocks stages partial results in a
global buffer.

``gpu_reduce_kernel`` (aten/src/ATen/native/cuda/Reduce.cuh) picks a launch configuration in
``setReduceConfig``; when every thread would still have >= 256 values to reduce and the grid is
small, it splits each output's inputs over ``ctas_per_output`` blocks and allocates, from the
caching allocator and for the duration of the kernel, a staging buffer of ``global_memory_size()``
bytes plus ``4 * grid.x`` bytes of semaphores. For a reduction along a non-contiguous dimension,
such as the bias gradient ``grad.sum(0)`` of a [tokens, features] gradient, the buffer is
``4 * outputs * ctas_per_output * block.x * output_vec_size`` bytes: 8 bytes per input element
for a [1024, 1000] bf16 gradient on an H100 (snap-mha-bf16: 8,192,000 bytes and 32 bytes of
semaphores for 1,024,000 inputs; snap-gpt2-bf16-small: 25,165,824 bytes for a 6 MB gradient).

This module reproduces ``setReduceConfig`` for sum/mean/amax/amin/norm over dense inputs: the
TensorIterator dimension order (reduced dimensions first, each group by increasing stride),
coalescing of contiguous dimensions, block shape (``set_block_dimension`` with 512 threads, warp
32), input/output splitting, and ``ctas_per_output`` from the card's SM count and 2048 threads
per SM. Inputs of 2**31 or more elements (split into 32-bit-indexable pieces) are not modelled.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

aten = torch.ops.aten

MAX_NUM_THREADS = 512
WARP = 32
MAX_THREADS_PER_SM = 2048
"""The H100's ``maxThreadsPerMultiProcessor`` (a card's own: memfit.techniques.cuda_facts.threads_per_sm): Reduce.cuh's
``blocks_per_sm`` is it over the block's threads."""

REDUCE_OPS = {
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
    aten.amin.default, aten.linalg_vector_norm.default, aten.nansum.default,
}


def _last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _reduced_dims(func, args, kwargs, ndim: int) -> set[int]:
    if func in (aten.sum.default, aten.mean.default, aten.nansum.default) and (len(args) < 2 or args[1] is None):
        return set(range(ndim))
    if func is aten.linalg_vector_norm.default:
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
    else:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return {d % ndim for d in dims} if ndim else set()


def iterator_layout(shape, strides, reduced: set[int]) -> tuple[list[int], list[int], int]:
    """(sizes, byte-agnostic element strides, number of reduced dims) of the TensorIterator that
    reduces a tensor of ``shape``/``strides`` over ``reduced``: size-1 dims dropped, reduced dims
    first, each group ordered by increasing input stride, contiguous neighbours coalesced."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    red = sorted((d for d in dims if d in reduced), key=lambda d: (strides[d], -d))
    keep = sorted((d for d in dims if d not in reduced), key=lambda d: (strides[d], -d))
    out_sizes, out_strides, n_red = [], [], 0
    for group, is_red in ((red, True), (keep, False)):
        sizes, strs = [], []
        for d in group:
            if sizes and strides[d] == strs[-1] * sizes[-1]:
                sizes[-1] *= shape[d]
            else:
                sizes.append(shape[d])
                strs.append(strides[d])
        out_sizes += sizes
        out_strides += strs
        if is_red:
            n_red = len(sizes)
    return out_sizes, out_strides, n_red


def global_buffer_bytes(shape, strides, reduced: set[int], element_size: int, acc_size: int, sm_count: int,
                        vt0: int = 4, input_vec_size: int = 4,
                        threads_per_sm: int = MAX_THREADS_PER_SM) -> tuple[int, int]:
    """(staging buffer bytes, semaphore bytes) of ``setReduceConfig`` for this reduction."""
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return 0, 0
    sizes, strides_e, n_red = iterator_layout(shape, strides, reduced)
    if n_red == 0:  # nothing to reduce: a copy
        return 0, 0
    num_outputs = 1
    for s in sizes[n_red:]:
        num_outputs *= s
    inputs_per_output = numel // max(num_outputs, 1)
    ndim = len(sizes)
    if ndim > 0:
        fastest = n_red == ndim or (strides_e[0] < strides_e[n_red] if n_red < ndim else True)
        if fastest:
            dim0, dim1, fast_stride = inputs_per_output, num_outputs, strides_e[0]
        else:
            dim0, dim1, fast_stride = num_outputs, inputs_per_output, strides_e[n_red]
    else:
        fastest, dim0, dim1, fast_stride = True, 1, 1, 1
    output_vec = 1
    if fast_stride == 1:
        if fastest and dim0 > 128 and n_red == 1 and vt0 >= input_vec_size:
            dim0 //= input_vec_size
        elif not fastest:
            output_vec = 4
            while sizes[n_red] % output_vec:
                output_vec //= 2
            dim0 //= output_vec
    max_threads = MAX_NUM_THREADS // output_vec
    d0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    d1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    bw = min(d0, WARP)
    bh = min(d1, max_threads // bw)
    bw = min(d0, max_threads // bh)
    threads = bw * bh
    step_in, step_out = 1, 1
    input_mult = [0, 0, 0]
    if ndim == 0 or fastest:
        input_mult[0] = step_in
        step_in *= bw
    else:
        step_out *= bw
    if _div_up(inputs_per_output, step_in) >= min(bh * 16, 256):
        input_mult[1] = step_in
        step_in *= bh
    else:
        step_out *= bh
    target_grid = sm_count * (threads_per_sm // threads)
    grid_x = _div_up(num_outputs // output_vec, step_out)
    ctas = 1
    vpt = _div_up(inputs_per_output, step_in)
    if input_mult[1] != 0 and vpt >= 256 and grid_x <= target_grid:
        ctas = max(min(_div_up(target_grid, grid_x), _div_up(vpt, 16)), _div_up(vpt, 256))
        if ctas > 1:
            input_mult[2] = step_in
    if input_mult[2] == 0:
        return 0, 0
    size = acc_size * num_outputs * ctas
    if input_mult[0] == 0:
        size *= bw * output_vec
    return size, 4 * grid_x


STAGING_BUFFER, SEMAPHORES = "reduction staging buffer", "reduction semaphores"
"""The names a reduction's own allocations are booked under (the SM count sizes them)."""


class Geometry(NamedTuple):
    """What sizes a reduction's staging buffer: its input's layout, and the card's SM count. A batch
    dimension moves ``shape`` (and the strides over it); :func:`sized` gives the bytes at any."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    reduced: tuple[int, ...]
    element_size: int
    acc_size: int
    vec: int
    sm_count: int
    threads_per_sm: int


def sized(g: Geometry) -> tuple[int, int]:
    """(staging buffer bytes, semaphore bytes) of a reduction of this geometry (0, 0: none)."""
    return global_buffer_bytes(list(g.shape), list(g.strides), set(g.reduced), g.element_size, g.acc_size,
                               g.sm_count, input_vec_size=g.vec, threads_per_sm=g.threads_per_sm)


def geometry(func, args, kwargs, sm_count: int, threads_per_sm: int) -> Geometry | None:
    """The geometry of a reduction's staging buffer (None: a reduction this model does not size)."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.is_complex() or x.numel() >= 2**31 or not x.dtype.is_floating_point:
        return None
    reduced = tuple(sorted(_reduced_dims(func, args, kwargs, x.dim())))
    return Geometry(tuple(x.shape), tuple(x.stride()), reduced, x.element_size(), 8 if x.dtype == torch.float64 else 4,
                    8 if x.element_size() <= 2 else 4, sm_count, threads_per_sm)


def buffers(g: Geometry | None) -> list[tuple[str, int, bool]]:
    """The staging buffer and semaphores a reduction of geometry ``g`` allocates inside its kernel, if any."""
    size, sem = sized(g) if g is not None else (0, 0)
    if not size:
        return []
    return [(STAGING_BUFFER, size, True), (SEMAPHORES, sem, True)]
