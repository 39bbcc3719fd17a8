"""Hand-written Triton kernels in a fake trace: their launches skipped, their Python's allocations traced.

NOTE [ Triton kernels on fake tensors ]
Some libraries a model runs on a GPU are Triton kernels called from Python: flash-linear-attention
(``fla``), which transformers calls for the gated delta rule of Qwen3.5 and Qwen3-Next and for
other linear attention when it is installed, and Liger's fused losses and norms. Each op is an
``autograd.Function`` whose Python allocates the outputs and the tensors kept for backward with
``torch.empty`` and then launches kernels that write into them (``kernel[grid](...)``). The
kernels allocate nothing themselves, so the op's memory is its Python's allocations, which a fake
trace sees as it sees any other op's. Only the launch cannot run on fake tensors: Triton asks the
driver for a GPU ("0 active drivers" here) and would hand the kernel the tensors' data pointers.

So while a fake trace runs, a launch whose arguments hold a fake tensor is skipped: Triton's
``JITFunction.run`` (``kernel[grid](...)``), ``Autotuner.run`` (which would time each config on the
card) and ``Heuristics.run``. The kernel's outputs keep the fake values they were made with, and
the trace goes on: the rest of the op's Python, its backward, the allocator. A launch with real
tensors runs as before. What is skipped is said in the report, by library, because its time is not
priced (no aten op stands for it) and a kernel that writes a value the Python then reads (a count
that sizes a later tensor) would be traced with a stand-in: no library memfit meets does that.

Inductor's own kernels are not these: a compiled region is predicted from Inductor's wrapper,
which launches nothing (NOTE [ Inductor's own wrapper on fake tensors ]), and a ``triton_op`` or
``wrap_triton`` kernel dispatches to its fake implementation without a launch.
"""

from __future__ import annotations

import contextlib
import unittest.mock

from torch._subclasses.fake_tensor import FakeTensor

SKIPPED = "Triton kernels skipped on fake tensors (their Python's allocations traced, their time not priced)"
"""The approximation skipped kernels are reported under, with their library (fla, liger_kernel, ...)."""


@contextlib.contextmanager
def fake_triton_launches(tracker):
    """Triton launches on fake tensors are skipped and reported to ``tracker`` while this is active (the
    module's NOTE). Without Triton (PyTorch's CPU wheels) there is nothing to launch."""
    try:
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    with contextlib.ExitStack() as stack:
        for cls in (JITFunction, Autotuner, Heuristics):
            stack.enter_context(unittest.mock.patch.object(cls, "run", _skipping(cls.run, tracker)))
        yield


def _skipping(run, tracker):
    def launch(self, *args, **kwargs):
        if not any(isinstance(a, FakeTensor) for a in (*args, *kwargs.values())):
            return run(self, *args, **kwargs)
        tracker.approximate(SKIPPED, kernel_library(self))
        return None
    return launch


def kernel_library(kernel) -> str:
    """The package a Triton kernel is written in (``fla``): its Python function's, under the autotuners,
    heuristics and ``JITFunction`` around it (each keeps what it wraps as ``fn``)."""
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return (getattr(kernel, "__module__", None) or "triton").split(".")[0]
