"""What Inductor asks of a CUDA card while it compiles, answered from a GPU preset, without a GPU.

Inductor's CUDA path (its lowering, scheduler, Triton code generator and wrapper) reads a few facts
of the card it compiles for: whether it is there and Triton-capable, its compute capability, its
streaming multiprocessors, threads and registers per multiprocessor, shared memory, Triton's
target, a matmul's arithmetic balance (FLOP/s over bytes/s) and, where a choice is made by timing
kernels, the timing. :func:`card` answers each from a ``memfit.devices.Device`` for the duration
of a compile (memfit.techniques.cuda_lowering): the interface Inductor asks through
(``torch._dynamo.device_interface.CudaInterface``), the few ``torch.cuda`` queries Inductor makes
directly, Triton's target, and the peak FLOP/s and bandwidth Inductor weighs a matmul by. Nothing
that runs a kernel is answered: the predicted wrapper never launches one (NOTE [ Inductor's own
wrapper on fake tensors ]); the one timing Inductor's CUDA path takes by default is answered in
memfit.techniques.cuda_lowering (NOTE [ Padded matmuls without timing ]).
"""

from __future__ import annotations

import contextlib
import types
import unittest.mock

import torch

# Per compute capability (CUDA C Programming Guide, "Technical Specifications per Compute
# Capability"): threads per multiprocessor, and the shared memory a block may opt in to.
_THREADS_PER_SM = {(7, 0): 2048, (7, 5): 1024, (8, 0): 2048, (8, 6): 1536, (8, 9): 1536, (9, 0): 2048, (10, 0): 2048,
                   (12, 0): 1536}
_SHARED_PER_BLOCK = {(7, 0): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 9): 101376,
                     (9, 0): 232448}


def threads_per_sm(device) -> int:
    """``maxThreadsPerMultiProcessor`` of a GPU preset's architecture (2048 where not listed)."""
    return _THREADS_PER_SM.get(tuple(device.compute_capability), 2048)


def properties(device) -> types.SimpleNamespace:
    """``torch.cuda.get_device_properties`` of ``device`` (a GPU preset), as far as Inductor reads it."""
    cc = tuple(device.compute_capability)
    return types.SimpleNamespace(
        name=device.name, major=cc[0], minor=cc[1], multi_processor_count=device.sm_count,
        total_memory=device.total_bytes, regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=threads_per_sm(device), max_threads_per_block=1024, warp_size=32,
        shared_memory_per_block=49152, shared_memory_per_block_optin=_SHARED_PER_BLOCK.get(cc, 101376),
        gcnArchName="", is_integrated=False, is_multi_gpu_board=False)


@contextlib.contextmanager
def card(device):
    """Inductor compiles for ``device`` (a GPU preset) while this is active."""
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor import utils as inductor_utils
    from torch.utils import _triton

    props = properties(device)
    cc = tuple(device.compute_capability)
    backend = _triton_backend(cc)

    def get_properties(_device=None):
        return props

    def capability(_device=None):
        return cc

    def zero(*_args):
        return 0

    answers = [
        (torch.cuda, {"get_device_properties": get_properties, "get_device_capability": capability,
                      "get_device_name": lambda _device=None: device.name, "device_count": lambda: 1,
                      "current_device": lambda: 0, "_exchange_device": zero, "_maybe_exchange_device": zero,
                      "is_bf16_supported": lambda *a, **k: device.bf16}),
        (CudaInterface, {k: staticmethod(v) for k, v in {
            "is_available": lambda: True, "get_device_properties": get_properties,
            "get_compute_capability": lambda _device=None: cc[0] * 10 + cc[1], "device_count": lambda: 1,
            "current_device": lambda: 0, "exchange_device": zero, "maybe_exchange_device": zero,
            "get_raw_stream": zero, "is_bf16_supported": lambda *a, **k: device.bf16}.items()}),
        (CudaInterface.Worker, {"get_device_properties": staticmethod(get_properties),
                                "current_device": staticmethod(lambda: 0)}),
        (_triton, {"triton_backend": lambda: backend, "triton_hash_with_backend": lambda: f"MEMFIT-SM{cc[0]}{cc[1]}"}),
        (inductor_utils, {"get_device_tflops": lambda dtype: _peak_tflops(device, dtype),
                          "get_gpu_dram_gbps": lambda: device.mem_bandwidth / 1e9}),
    ]
    with contextlib.ExitStack() as stack:
        for owner, values in answers:
            for name, value in values.items():
                stack.enter_context(unittest.mock.patch.object(owner, name, value))
        _triton.has_triton.cache_clear()  # (answered from the card while compiling, and afresh after)
        stack.callback(_triton.has_triton.cache_clear)
        yield


def _triton_backend(cc):
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    return make_backend(GPUTarget("cuda", cc[0] * 10 + cc[1], 32))


def _peak_tflops(device, dtype) -> float:
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
    return device.peak_flops.get(name, device.peak_flops.get("float32", 0.0)) / 1e12
