"""The CUDA kernel model: all rules, active together during a GPU-target fake trace.

Three mechanisms, each scoped to the trace:

1. dispatcher registrations that make composite ops and autocast take their CUDA paths on the
   CPU tensors a GPU preset is traced on (memfit.memory.cuda.composites, .autocast);
2. torch.optim's foreach default as for CUDA parameters (memfit.memory.cuda.optim);
3. :class:`KernelMode`, a dispatch mode entered *inside* the memory tracker, which books the
   memory kernels allocate internally as fake tensors through the tracker: per-thread cuBLAS /
   cuBLASLt workspaces (persistent), and buffers held for the duration of one kernel (attention
   backward accumulators, reduction staging buffers, cuDNN workspaces, CUTLASS's grouped GEMM
   arguments and workspace), plus the outputs the
   meta kernels of cuDNN's RNN get wrong, and LayerNorm's statistics, which CUDA keeps in fp32 for
   half-precision inputs (``layer_norm_cuda``: ``toAccumulateType``) where the reference kernel a
   trace on CPU tensors runs gives them the input's dtype.

Booked buffers are ordinary fake storages, so the tracker's timeline, categories (``other`` for
workspaces that persist, ``temporaries`` for the rest), per-module attribution and the
caching-allocator replay all see them like any tensor. Each record's ``op`` names the rule
(e.g. ``cublas workspace (autograd thread)``).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit import rng_ops
from memfit.device_queries import PRIM_DEVICE, FakeTensor
from memfit.memory.cuda import blas, conv, grouped_gemm, reduce, rnn, sdpa
from memfit.memory.cuda.autocast import cuda_autocast
from memfit.memory.cuda.composites import cuda_composites
from memfit.memory.cuda.optim import cuda_optimizer_defaults
from memfit.techniques.cuda_facts import threads_per_sm
from memfit.techniques.cuda_lowering import lowering_for_cuda

aten = torch.ops.aten


LAYER_NORM_STATS = "layer_norm fp32 mean/rstd"
"""What a LayerNorm's statistics are booked as where they are half-precision in the trace and fp32 on CUDA."""
HALF = (torch.float16, torch.bfloat16)

WORKSPACE = " workspace"
WORKSPACE_SIZES = {"cublas": "workspace_bytes", "cublaslt": "lt_workspace_bytes"}
"""A library's workspace, booked as ``"<library> workspace (<thread> thread)"``, by the device field that sizes it."""


def workspace_bytes(op: str, device) -> int | None:
    """The bytes of the library workspace booked as ``op`` on ``device`` (None: ``op`` is not one)."""
    library, sep, _ = op.partition(WORKSPACE + " (")
    field = WORKSPACE_SIZES.get(library) if sep else None
    return getattr(device, field) if field else None


class KernelMode(TorchDispatchMode):
    """Books what CUDA kernels allocate that their meta kernels do not show."""

    def __init__(self, device, tracker):
        super().__init__()
        self.device = device
        self.tracker = tracker
        self.workspaces: set[tuple[str, str]] = set()  # (library, thread) already holding one
        self.booked: dict[str, int] = {}  # rule -> calls, for the report
        self.streams: dict[int, int] = {}
        """Serial of a storage allocated on a side stream -> stream number (see memfit.memory.allocator)."""
        self.reductions: dict[int, reduce.Geometry] = {}
        """Serial of a reduction's staging buffer or semaphores -> what sizes them (memfit.memory.stream_sizes
        sizes them at another batch)."""
        if tracker is not None:
            tracker.side_streams = self.streams
            tracker.reductions = self.reductions

    # -- booking ----------------------------------------------------------------------------------
    def _empty(self, nbytes: int, what: str, where: torch.device, category: str) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8, device=where)
        rec = self.tracker.state.records[-1] if self.tracker is not None else None
        if rec is not None and rec.nbytes == nbytes:
            rec.op = what
        if self.tracker is not None:
            self.tracker.label(t, category)
        self.booked[what] = self.booked.get(what, 0) + 1
        return t

    def persistent(self, nbytes: int, what: str, where: torch.device) -> None:
        self._held.append(self._empty(nbytes, what, where, "other"))

    def transient(self, buffers, where: torch.device, geometry: reduce.Geometry | None = None) -> None:
        """Allocate ``buffers`` [(what, bytes, held)] in order and free them all (a buffer not
        ``held`` is freed before the next one is allocated); ``geometry``: what sizes them (a reduction's)."""
        live = []
        for what, nbytes, held in buffers:
            if nbytes <= 0:
                continue
            t = self._empty(nbytes, what, where, "temporaries")
            if geometry is not None and self.tracker is not None:
                self.reductions[self.tracker.state.records[-1].serial] = geometry
            if held:
                live.append(t)
            del t
        live.clear()

    # -- dispatch ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE and type(args[0]) is FakeTensor:  # (NOTE [ Device queries ] in memfit.device_queries)
            return args[0].device
        kwargs = kwargs or {}
        if func is aten._cudnn_rnn.default:
            self._workspace("cudnn dropout state", "device", rnn.dropout_state_bytes(args, self.device.sm_count),
                            args[0].device)
            return rnn.forward(func, args, kwargs, lambda bufs: self.transient(
                [(w, n, True) for w, n in bufs], args[0].device))
        if func is aten._cudnn_rnn_backward.default:
            return rnn.backward(func, args, kwargs, lambda bufs: self.transient(
                [(w, n, True) for w, n in bufs], args[0].device))
        if func is aten.convolution_backward.default:
            return self._convolution_backward(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in blas.CUBLAS_OPS:
            if blas.uses_cublas(func, args, out):
                where = out.device if isinstance(out, torch.Tensor) else args[0].device
                thread = blas.thread()
                self._workspace("cublas", thread, self.device.workspace_bytes, where)
                if blas.uses_cublaslt(func, args, kwargs):
                    self._workspace("cublaslt", thread, self.device.lt_workspace_bytes, where)
        elif func in reduce.REDUCE_OPS:
            g = reduce.geometry(func, args, kwargs, self.device.sm_count, threads_per_sm(self.device))
            self.transient(reduce.buffers(g), args[0].device, g)
        elif func is aten.convolution.default:
            self.transient(conv.workspace(func, args, out), args[0].device)
        elif func in _ATTENTION:
            self.transient(sdpa.kernel_buffers(func, args, out), args[0].device)
        elif func is aten._grouped_mm.default:
            if grouped_gemm.fast_path(self.device, args, kwargs):
                self.transient(grouped_gemm.cutlass_buffers(self.device, args), args[0].device)
            elif out.numel():  # the fallback's one cuBLAS mm per group
                self._workspace("cublas", blas.thread(), self.device.workspace_bytes, out.device)
        elif func is aten.native_layer_norm.default and out[1].dtype in HALF:
            return out[0], self._fp32(out[1]), self._fp32(out[2])
        elif func in _COPIES and self._is_prefetch(args[0], out):
            self.streams[self.tracker.state.records[-1].serial] = PREFETCH_STREAM
        return out

    def _fp32(self, stats: torch.Tensor) -> torch.Tensor:
        """A LayerNorm statistic as CUDA's kernel allocates it: fp32, for a half-precision input (module docstring);
        the half-precision one the trace made is dropped."""
        out = torch.empty(stats.shape, dtype=torch.float32, device=stats.device)
        rec = self.tracker.state.records[-1] if self.tracker is not None else None
        if rec is not None and rec.nbytes == out.untyped_storage().nbytes():
            rec.op = LAYER_NORM_STATS
        self.booked[LAYER_NORM_STATS] = self.booked.get(LAYER_NORM_STATS, 0) + 1
        return out

    def _convolution_backward(self, func, args, kwargs):
        """cuDNN's backward runs one pass per gradient (data, then weight; the bias gradient is a
        reduction), each allocating its output and then its own workspace, freed before the next
        pass (aten/src/ATen/native/cudnn/ConvShared.cpp ``cudnn_convolution_backward``). Run the
        passes one by one so that the allocator replay sees that order."""
        mask = list(args[10])
        grads = [None, None, None]
        for i in range(3):
            if mask[i]:
                grads[i] = func(*args[:10], [j == i for j in range(3)], *args[11:], **kwargs)[i]
                self.transient(conv.backward_workspace(i, args), args[0].device)
        return tuple(grads)

    def _is_prefetch(self, src, out) -> bool:
        """A host-to-device copy during the optimizer step: offloaded optimizer states fetched on
        their prefetch stream (memfit.techniques.offload, ``OffloadOptimizerStates._fetch``)."""
        tracker = self.tracker
        if tracker is None or tracker.phase_name != "optimizer" or not isinstance(out, torch.Tensor):
            return False
        entry = tracker.storages.live.get(src.untyped_storage()._cdata)  # the tracker's storage -> record map
        rec = tracker.state.records[-1]
        return (entry is not None and tracker.state.records[entry[0]].device == "host" and rec.device != "host"
                and rec.nbytes == out.untyped_storage().nbytes())

    def _workspace(self, library: str, thread: str, nbytes: int, where) -> None:
        if nbytes and (library, thread) not in self.workspaces:
            self.workspaces.add((library, thread))
            self.persistent(nbytes, f"{library}{WORKSPACE} ({thread} thread)", where)

    def __enter__(self):
        # (entered again while inside, by a compiled region's wrapper that runs under the modes of its
        # call: the persistent buffers booked so far stay held until the outermost exit)
        self._depth = getattr(self, "_depth", 0) + 1
        if self._depth == 1:
            self._held: list[torch.Tensor] = []
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._depth -= 1
        if self._depth == 0:
            self._held = []
        return out


PREFETCH_STREAM = 1
_COPIES = {aten.clone.default, aten._to_copy.default}
_ATTENTION = {
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_cudnn_attention_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
}


@contextlib.contextmanager
def cuda_kernel_model(device, tracker=None):
    """Model CUDA's kernel choices and kernel memory for ``device`` (a GPU Device) in a fake
    trace. Enter it inside the tracker (so that the booked buffers are tracked)."""
    mode = KernelMode(device, tracker)
    with cuda_composites(device), cuda_autocast(tracker), cuda_optimizer_defaults(), lowering_for_cuda(device), \
            grouped_gemm.transformers_choice(device), mode:
        yield mode


rng_ops.register(KernelMode)  # (memfit.rng_ops)
