"""Inductor's lowering as it runs for CUDA, while a GPU preset's compiled region is predicted on CPU.

A GPU preset is traced on fake CPU tensors, so Inductor lowers its compiled regions for the CPU.
Where Inductor's lowering takes a CPU-only branch that changes what the wrapper allocates, the
prediction of a CUDA step would hold buffers the real one never allocates. While the CUDA kernel
model is active (:func:`lowering_for_cuda`, entered by ``memfit.memory.cuda.model``) the predicting
compile takes CUDA's branch instead (:func:`lowered_as_on_cuda`, entered by
``memfit.techniques.compiled``), and its wrappers are cached under a key of their own
(``fake_wrapper.PredictionPass``).
"""

from __future__ import annotations

import contextlib

import torch

_ACTIVE = [0]


@contextlib.contextmanager
def lowering_for_cuda():
    """While this is active, predicting compiles lower as Inductor does for CUDA (where it differs)."""
    _ACTIVE[0] += 1
    try:
        yield
    finally:
        _ACTIVE[0] -= 1


def active() -> bool:
    return _ACTIVE[0] > 0


# NOTE [ cat lowered as on CUDA ]
# Inductor lowers ``aten.cat`` on the CPU to a materialised concatenation always (pointwise
# concatenation is off there for speed; a uint8 ``cat`` even falls back to ATen's kernel), while on
# CUDA it may lower to a pointwise cat that its consumers fuse, allocating nothing. torchao's 4-bit
# AdamW unpacks its codes with ``torch.stack([codes >> 4, codes & 15], -1)``: on the H100, the
# compiled update of a 1B Llama's tied embedding allocated no unpacked codes, and the CPU lowering
# predicted two of 250.5 MiB each at the step's peak (+4.3% allocated; measured 2026-11-26,
# tests/data/h100.jsonl ``llama1b-full-purebf16-blocks-4bit-ao-inbw``). The lowering's first test is
# ``inputs[0].get_device().type == "cpu"``; here that one call answers "cuda", and every later call
# (the device the pointwise cat is built on) the real CPU device, so the kernels still generate for
# the CPU that runs the prediction.
#
# NOTE [ Kernels generated without vectorization for a GPU preset ]
# A predicted region's kernels are generated and never compiled (NOTE [ Inductor's own wrapper on
# fake tensors ]), and on a GPU the real ones are Triton's: the CPU's vector instructions shape only
# the text of kernels nobody runs. Finding them is not free: Inductor's first vectorized kernel in a
# process probes the C++ compiler for each instruction set (builds a test program for each on a cold
# cache), and every vectorized kernel is generated twice (a vector and a scalar tail). While a GPU
# preset is predicted, Inductor picks no vector instruction set: torchao's 4-bit AdamW for two Llama
# blocks at 7B width (5 graphs) then predicts in 12.5 s instead of 22.6 s on a cold cache, with the
# same allocations. Scheduling and fusion, hence the wrapper's buffers, do not depend on the
# instruction set; the H100 rows with compiled regions (tests/data/h100.jsonl) hold it. A CPU
# prediction keeps the CPU's own set: there the kernels it generates are the ones that run.
@contextlib.contextmanager
def lowered_as_on_cuda():
    """Inductor's ``aten.cat`` lowering takes its CUDA branch (NOTE [ cat lowered as on CUDA ]) and
    its kernels are generated without vector instructions (NOTE [ Kernels generated without
    vectorization for a GPU preset ]); a no-op unless :func:`lowering_for_cuda` is active."""
    if not active():
        yield
        return
    with _cat_as_on_cuda(), _no_vector_isa():
        yield


@contextlib.contextmanager
def _no_vector_isa():
    from torch._inductor import cpu_vec_isa

    pick = cpu_vec_isa.pick_vec_isa
    cpu_vec_isa.pick_vec_isa = lambda: cpu_vec_isa.invalid_vec_isa  # (Inductor's code generator asks the module)
    try:
        yield
    finally:
        cpu_vec_isa.pick_vec_isa = pick


@contextlib.contextmanager
def _cat_as_on_cuda():
    from torch._inductor import lowering

    cat = getattr(lowering.cat, "__wrapped__", None)  # the lowering itself, inside register_lowering's handling
    register = getattr(lowering, "_register_lowering", None)
    if cat is None or register is None:  # (another Inductor: its CPU lowering, as before this module)
        yield
        return

    def cat_as_on_cuda(inputs, dim=0):
        first = inputs[0]

        def device_once():
            object.__delattr__(first, "get_device")
            real = first.get_device()
            return torch.device("cuda") if real is not None and real.type == "cpu" else real

        try:
            object.__setattr__(first, "get_device", device_once)
        except (AttributeError, TypeError):  # (an input that takes no attribute: the CPU's branch)
            return cat(inputs, dim)
        try:
            return cat(inputs, dim)
        finally:
            if "get_device" in vars(first):
                object.__delattr__(first, "get_device")

    as_on_cuda = register(
        torch.ops.aten.cat, cat_as_on_cuda, broadcast=False, convert_input_to_bool=False, lowering_dict={},
        type_promotion_kind=lowering.ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)  # as lowering.py registers cat
    keys = [op for op, fn in lowering.lowerings.items() if fn is lowering.cat]
    for op in keys:
        lowering.lowerings[op] = as_on_cuda
    try:
        yield
    finally:
        for op in keys:
            lowering.lowerings[op] = lowering.cat
