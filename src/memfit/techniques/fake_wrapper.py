"""Inductor's generated wrapper, run on fake tensors, and kept in Inductor's own caches.

A compiled region's prediction (memfit.techniques.compiled) runs Inductor in full, down to the
Python wrapper it generates, and replaces only the loading of that wrapper: its kernels do nothing,
and its allocations go through the dispatcher, so fake mode and memfit's tracker see them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

NO_KERNELS_LINE = "async_compile = AsyncCompile()"
"""The line of Inductor's wrapper that makes its kernels' compiler: replaced by :data:`NO_KERNELS`."""

RUNTIME_MODES: list = []
"""The dispatch modes active where the region was called (the tracker, fake mode, the kernel
model): its graphs run under them (see NOTE [ Compiled regions on fake tensors ])."""

LISTENERS: list = []
"""Who is told of each call of a predicted wrapper (``compiled_call()``) and of each of its kernel
launches (``compiled_kernel(tensors)``, the tensors the kernel was given): their kernels do not
dispatch, so the planner's op recorder (memfit.planner.opcost) hears of them here (NOTE [ Compiled
kernels in the step time ] there)."""


class PredictionPass(CustomGraphPass):
    """Inductor's post-grad custom pass while a region is predicted: it changes nothing, and its uuid
    keeps predicted wrappers apart from real ones in Inductor's caches."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        from memfit import sdpa_backends
        from memfit.techniques import (
            cuda_facts,
            cuda_lowering,  # lowered as on CUDA: other wrappers (its NOTE)
        )
        files = (__file__, cuda_lowering.__file__, cuda_facts.__file__)
        device = cuda_lowering.target()  # (the card's facts decide the CUDA path's choices)
        card = f"{device.name}-sm{device.compute_capability}-{device.sm_count}-" if device is not None else ""
        # (and the torch release whose attention choices the trace follows: tools/gpu/rows.py emulates older ones)
        sdpa = "sdpa" + "".join(str(int(on)) for on in sdpa_backends.rules()) + "-"
        return "memfit-fake-wrapper-" + card + sdpa + get_hash_for_files(files).hex()


PREDICTION_PASS = PredictionPass()


# NOTE [ Predicted wrappers in Inductor's caches ]
# Lowering and code generation are most of a compile (seconds per graph on a CPU; torchao's 8-bit
# update, one graph per parameter shape, takes about 3.5 s). The planner's worker processes, and
# every later ``estimate`` or ``plan``, meet the same graphs again. So the predicting compile keeps
# Inductor's caches on (its FX graph cache and AOTAutograd's cache, in Inductor's cache folder,
# ``TORCHINDUCTOR_CACHE_DIR``), with two guards:
#
# - **Apart from real compiles.** While a region is predicted, ``post_grad_custom_post_pass`` is a
#   pass that does nothing and whose ``uuid`` names memfit's wrapper (a hash of this file). Both
#   caches hash that uuid into their keys, so a real compile never loads a predicted wrapper (its
#   kernels do nothing) and a prediction never loads real kernels. Where a user has set that pass
#   already, predictions leave the caches off (``force_disable_caches``), as before.
# - **Self-contained.** The wrapper written to Inductor's code cache imports this module and calls
#   :func:`install` at its end, so the source a cache hit loads in another process runs exactly as
#   the one just generated.
#
# ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` turns the caches off for predictions too.
@contextlib.contextmanager
def prediction_caches():
    """Around a predicting compile: Inductor's caches keyed apart from real compiles, or off where a
    user's own post-grad pass is set (NOTE [ Predicted wrappers in Inductor's caches ])."""
    config = torch._inductor.config
    if config.post_grad_custom_post_pass is None:
        with config.patch(post_grad_custom_post_pass=PREDICTION_PASS):
            yield
    elif isinstance(config.post_grad_custom_post_pass, PredictionPass):  # (nested)
        yield
    else:
        with config.patch(force_disable_caches=True):
            yield


def load_wrapper(graph, wrapper_code):
    """Stands in for ``GraphLowering._compile_to_module_lines``: the generated wrapper with kernels
    that do nothing, written to Inductor's code cache (its source differs from the real wrapper's,
    so it has a key of its own) and loaded from there, as a cache hit loads it."""
    return _load(graph, wrapper_code, emulated=False)


def load_emulated_wrapper(graph, wrapper_code):
    """:func:`load_wrapper` for a wrapper of Inductor's CUDA path that runs on the CPU fake tensors
    of a GPU preset's trace (NOTE [ Inductor's CUDA path without a GPU ]): its CUDA allocations on
    the trace's device, its device guard and streams doing nothing."""
    return _load(graph, wrapper_code, emulated=True)


def _load(graph, wrapper_code, emulated: bool):
    from torch._inductor.codecache import PyCodeCache
    source = wrapper_code.value
    if NO_KERNELS_LINE not in source:
        raise RuntimeError("Inductor's wrapper code has changed shape: memfit cannot run it on fake tensors")
    # (on one line: the line map of the wrapper stays valid)
    source = source.replace(NO_KERNELS_LINE, "from memfit.techniques import fake_wrapper as _memfit_fake_wrapper; "
                            "async_compile = _memfit_fake_wrapper.NO_KERNELS", 1)
    if emulated:
        for call, stand_in in EMULATED_CALLS.items():
            source = source.replace(call, stand_in)
    source += f"\n_memfit_fake_wrapper.install(globals(), emulated={emulated})\n"
    linemap = [(line, node.stack_trace) for line, node in wrapper_code.line_map]
    key, path = PyCodeCache.write(source)
    module = PyCodeCache.load_by_key_path(key, path, linemap, graph.constants)
    graph.cache_key, graph.cache_path, graph.cache_linemap = key, path, linemap
    return module


def install(scope: dict, emulated: bool = False) -> None:
    """Called by a predicted wrapper's last line: its allocations through the dispatcher, its
    ``call`` under the modes of the region's call; an emulated CUDA wrapper's on the trace's device."""
    scope.update(FAKE_ALLOCATORS)
    if emulated:
        scope.update(EMULATED_CUDA)
    scope["call"] = _under_call_modes(scope["call"])


class _NoKernels:
    """``async_compile`` for a wrapper run on fake tensors: each kernel is a call that does nothing
    but tell :data:`LISTENERS`."""

    def __getattr__(self, kind):
        return lambda *args, **kwargs: _KERNEL

    def wait(self, scope) -> None:
        pass


NO_KERNELS = _NoKernels()


def _no_kernel(*args, **kwargs) -> None:
    return None


class _Kernel:
    """A kernel of a wrapper run on fake tensors (called, or ``.run(...)`` as Triton's are)."""

    def __call__(self, *args, **kwargs) -> None:
        if LISTENERS:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            for listener in LISTENERS:
                listener.compiled_kernel(tensors)

    run = __call__


_KERNEL = _Kernel()


def _empty_strided(size, stride, dtype, device="cpu"):
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def _empty_strided_cuda(size, stride, dtype):
    return torch.empty_strided(size, stride, dtype=dtype, device="cuda")


def _reinterpret(tensor, size, stride, offset):
    return tensor.as_strided(size, stride, tensor.storage_offset() + offset)


FAKE_ALLOCATORS = {
    "empty_strided_cpu": _empty_strided,
    "empty_strided_cpu_pinned": _empty_strided,
    "empty_strided_cuda": _empty_strided_cuda,
    "reinterpret_tensor": _reinterpret,
    "assert_size_stride": _no_kernel,
    "assert_size_stride_grouped": _no_kernel,
    "assert_alignment": _no_kernel,
}


class _NoDeviceGuard:
    def __init__(self, index) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def _device_of_trace(type=None, index=None):
    """``torch.device`` in an emulated CUDA wrapper: CUDA is the trace's (CPU) device."""
    kind = type.type if isinstance(type, torch.device) else str(type)
    if kind.split(":")[0] == "cuda":
        return torch.device("cpu")
    return torch.device(type) if index is None else torch.device(type, index)


def _empty_strided_on_trace(size, stride, dtype):
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _copy_if_misaligned(tensor):
    """Inductor's CUDA wrapper copies an input whose data is not 16-byte aligned (its kernels assume
    it); the caching allocator aligns each block, so a fake tensor is misaligned by its offset only."""
    if isinstance(tensor, torch.Tensor) and tensor.storage_offset() * tensor.element_size() % 16:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                   device=tensor.device).copy_(tensor)
    return tensor


EMULATED_CALLS = {"torch.cuda._DeviceGuard(": "_memfit_fake_wrapper.NoDeviceGuard(",
                  "torch.cuda.set_device(": "_memfit_fake_wrapper.no_kernel("}
"""Calls of a CUDA wrapper that need a driver, and what an emulated wrapper calls instead."""
NoDeviceGuard = _NoDeviceGuard
no_kernel = _no_kernel
EMULATED_CUDA = {
    "empty_strided_cuda": _empty_strided_on_trace,
    "device": _device_of_trace,
    "get_raw_stream": lambda index: 0,
    "copy_if_misaligned": _copy_if_misaligned,
}


# NOTE [ The modes again, in order ]
# The region's call stepped out of its modes from the top of the stack down
# (``_disable_current_modes`` pops them top first), so they go back bottom first: the forward then
# runs under the modes in the order the step set them up, as the backward does (autograd's engine
# runs it inside the step, under the step's own stack). Pushed in the order popped, the stack was
# upside down in every compiled forward: the op recorder and the memory tracker sat above the 4-bit
# matmul's kernel model (memfit.techniques.bnb_kernels) and saw one ``bitsandbytes::gemm_4bit``, not
# its dequantized weight and ``F.linear``: an 8B QLoRA's compiled step lost 114 of its 185 TFLOP of
# GEMMs in ``tools.fit.compiled_ops`` (priced below the LoRA step it adds work to).
def _under_call_modes(call: Callable) -> Callable:
    """Forward runs inside the region's call, which stepped out of the modes: enter them again;
    backward runs from autograd's engine, inside the step, where they are active already."""
    def run(args):
        for listener in LISTENERS:
            listener.compiled_call()
        modes = RUNTIME_MODES[-1] if RUNTIME_MODES else []
        with contextlib.ExitStack() as stack:
            for m in reversed(modes):  # (stepped out of from the top down: NOTE [ The modes again, in order ])
                stack.enter_context(m)
            return call(args)
    return run
