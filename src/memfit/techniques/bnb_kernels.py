"""bitsandbytes' quantized weights and 4-bit matmuls on fake tensors, as a real run allocates them.

Used by :mod:`memfit.techniques.base_weights` (``base_weights: nf4``) and by any workload that
builds bitsandbytes modules itself (``Linear4bit``, ``Linear8bitLt``, ``BitsAndBytesConfig``).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit import rng_ops
from memfit.device_queries import PRIM_DEVICE, FakeTensor
from memfit.quiet import errors_only

_FAKE_CLASSES: dict[type, type] = {}


def _fake_class(cls: type) -> type:
    from torch._subclasses.fake_tensor import FakeTensor
    if cls not in _FAKE_CLASSES:
        def detach(self):
            t = FakeTensor.detach(self)
            t.__class__ = type(self)
            for key, value in self.__dict__.items():
                t.__dict__.setdefault(key, value)
            return t

        def deepcopy(self, memo):
            with torch.no_grad():  # (a leaf, as torch's own Tensor.__deepcopy__ makes it)
                t = FakeTensor.clone(self).requires_grad_(self.requires_grad)
            t.__class__ = type(self)
            for key, value in self.__dict__.items():
                t.__dict__[key] = value if isinstance(value, torch.nn.Module) else copy.deepcopy(value, memo)
            return t

        def to(self, *args, **kwargs):
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
            if self.dtype == torch.int8 and device in (None, self.device) and dtype in (None, self.dtype):
                return self  # (8-bit codes already where they are asked to be)
            return cls.to(self, *args, **kwargs)
        body = {"detach": detach, "__deepcopy__": deepcopy, "__module__": cls.__module__}
        _FAKE_CLASSES[cls] = type(cls.__name__, (FakeTensor, cls), body | ({"to": to} if cls.__name__ == "Int8Params" else {}))
        from torch._dynamo.variables.builder import VariableBuilder
        VariableBuilder._type_dispatch()[_FAKE_CLASSES[cls]] = VariableBuilder.wrap_tensor
    return _FAKE_CLASSES[cls]


# NOTE [ bitsandbytes parameters on fake tensors ]
# ``Params4bit`` and ``Int8Params`` are ``nn.Parameter`` subclasses made with
# ``torch.Tensor._make_subclass(cls, data)``, which needs a plain tensor: a fake tensor's storage is
# already owned by its ``FakeTensor`` object, so no bitsandbytes module could be built on fake
# tensors ("Creating a new Tensor subclass Params4bit but the raw Tensor object is already
# associated to a python object of type FakeTensor"). While a fake trace runs, ``_make_subclass``
# of fake data returns the fake tensor re-classed as a subclass of both ``FakeTensor`` (fake mode
# dispatches it) and the requested class (bitsandbytes' methods and attributes: ``quant_state``,
# ``.to`` that quantizes, ``CB``/``SCB``), keeping the class's name (peft checks
# ``param.__class__.__name__ != "Params4bit"``). Its ``detach`` keeps that class, as
# ``nn.Parameter(...)`` in ``Module._apply`` requires. Quantization then runs bitsandbytes' own
# code on fake tensors: its custom ops' fake kernels give the packed uint8 weights, absmax and the
# nested statistics exact shapes and dtypes. Every other ``_make_subclass`` call is untouched.
#
# Three more things the class does as the real parameter would:
# - Its ``__deepcopy__`` clones the data and copies the attributes (the layer it belongs to by
#   reference, as bitsandbytes' own): bitsandbytes' makes the copy with ``type(self).__new__(type(self))``,
#   which a fake tensor cannot take, and peft's DoRA deep-copies a 4-bit layer to dequantize its weight
#   (QDoRA).
# - An 8-bit weight's ``.to`` its own device and dtype is itself, as on a GPU: fake tensors are CPU
#   tensors, and on the CPU peft's DoRA re-wraps the weight every forward (``module.weight =
#   module.weight.to(device)``), where bitsandbytes' ``to`` keeps the codes but not the scales its layer
#   moved into its state: the next step fails (it fails on a real CPU too). On a GPU peft does not re-wrap it.
# - Dynamo wraps the class as a tensor, as it wraps the real one (a ``Parameter`` subclass): it picks the
#   exact ``FakeTensor`` class out by type, and took a subclass of it with fake mode's
#   ``__torch_dispatch__`` for an opaque object, so a compiled block of 4-bit layers (QLoRA with
#   ``compile: blocks``) failed to trace where the real step compiles.
@contextlib.contextmanager
def fake_parameter_subclasses():
    """See NOTE [ bitsandbytes parameters on fake tensors ]."""
    from torch._subclasses.fake_tensor import FakeTensor
    real = torch.Tensor._make_subclass

    def make_subclass(cls, data, require_grad=False, *args, **kwargs):
        if isinstance(data, FakeTensor) and not issubclass(cls, FakeTensor) and not args and not kwargs:
            t = data.detach().requires_grad_(require_grad)
            t.__class__ = _fake_class(cls)
            return t
        return real(cls, data, require_grad, *args, **kwargs)

    torch.Tensor._make_subclass = make_subclass
    try:
        yield
    finally:
        torch.Tensor._make_subclass = real


def gemm_4bit_kernels(device) -> contextlib.AbstractContextManager:
    """The context a step with 4-bit layers enters: :class:`Gemm4bitKernels` where a dispatch mode is
    active (a fake trace, or a real step measured under memfit's tracker, whose mode would otherwise
    hide autocast from bitsandbytes' kernel), else nothing: a plain training run has no mode to undo,
    and a mode of its own would cost every op a Python call."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return Gemm4bitKernels(device) if _get_current_dispatch_mode_stack() else contextlib.nullcontext()


def has_4bit_layers(model: torch.nn.Module) -> bool:
    import sys
    if "bitsandbytes" not in sys.modules:
        return False
    from bitsandbytes.nn import Linear4bit
    return any(isinstance(m, Linear4bit) for m in model.modules())


# NOTE [ 4-bit matmul kernels on fake tensors ]
# ``bitsandbytes::gemm_4bit`` is one custom op whose fake kernel returns only the output. The
# real kernels allocate more, inside the op:
# - CPU (bitsandbytes' default kernel, backends/default/ops.py ``_gemm_4bit_default_impl``): with
#   double quantization the fp32 block scales (``dequantize_blockwise`` + offset), then the weight
#   dequantized to the input's dtype, [out, in], then ``F.linear``;
# - CUDA (backends/cuda/ops.py): the fused kernel (no temporary) when bitsandbytes' own per-arch
#   heuristic ``_gemm_4bit_use_custom_cuda`` picks it (few rows: M <= 1536 tokens, K a multiple of
#   the block size), else ``_dequant_linear_fallback``: fp32 scales and scales + offset (both held),
#   the [out, in] weight in the input's dtype, ``F.linear``.
# :class:`Gemm4bitKernels` runs those ops instead of the fake kernel, so the tracker (and the CUDA
# kernel model below it) sees each temporary. The backward needs nothing: ``MatMul4Bit.backward``
# is Python (``F.dequantize_4bit`` -> an [out, in] weight in the quantization dtype, cast to the
# gradient's dtype, ``matmul``) and traces as it runs.
class Gemm4bitKernels(TorchDispatchMode):
    """See NOTE [ 4-bit matmul kernels on fake tensors ]. ``device``: the memfit Device whose
    kernels are modelled (a GPU preset: CUDA's; else the CPU's). Real tensors pass through."""

    # NOTE [ The 4-bit matmul under autocast ]
    # ``gemm_4bit`` has no autocast kernel: the dispatcher passes autocast through, and its CUDA (and
    # CPU) implementation runs with autocast on. Its ``F.linear`` is therefore autocast: under bf16
    # autocast a layer whose input is fp32 (``compute_dtype`` is the weight's dtype, fp32 beside fp32
    # master weights) dequantizes to fp32, casts input and weight to bf16, runs a bf16 GEMM on tensor
    # cores and returns bf16, although bitsandbytes' fake kernel says ``A.dtype``. The gradient is then
    # bf16 and ``MatMul4Bit.backward``'s GEMM is bf16 too. An H200 profile of QLoRA on a 3B Llama shows
    # exactly that: every GEMM a bf16 tensor-core kernel, 1,712 bf16 casts a step. A dispatch mode,
    # though, is called below the autocast keys with autocast excluded, so :class:`Gemm4bitKernels`
    # would run the ``F.linear`` in fp32, and the trace had fp32 outputs and 196 fp32 backward GEMMs
    # (46 TFLOP at CUDA-core rates: the time model's +118% on the H100's QLoRA row). While the mode is
    # entered, an AutocastCPU kernel for ``gemm_4bit`` (fake traces run on CPU tensors, a GPU preset
    # under CPU autocast with CUDA's lists) notes that autocast is on and hands the call on below the
    # autocast key (with autocast excluded, as PyTorch's autocast kernels do: under Dynamo's Python
    # dispatcher a redispatch recomputes the keys from the thread's and came back here, a RecursionError
    # that broke compiled QLoRA under bf16 autocast), and the mode runs its kernels with autocast on
    # again, as the real implementation.
    # Its ``F.linear`` reaches the modes below whole (``aten.linear``, called below autograd), so the
    # time model counts it as the GEMM it is (``memfit.planner.opcost``) and the CPU's kernel probes
    # measure its scratch (``memfit.memory.workspaces``); it had been priced as a memory-bound op, which
    # made QLoRA look faster than LoRA. The real step measured under memfit's tracker (``memfit
    # profile``) had the same blind spot: a mode hides autocast from bitsandbytes' kernel there too, so
    # the mode calls that kernel at its backend key with autocast on. With no mode active (a plain
    # training run) :func:`gemm_4bit_kernels` enters nothing. The 3B Llama's QLoRA step is now predicted
    # +17% on the H100 row and +6% on the H200's (``tests/unit/test_timing.py``).
    def __init__(self, device):
        super().__init__()
        self.device = device
        self.dequantized: list[tuple[int, int]] = []
        """(rows, bytes of the dequantized weight) of each 4-bit matmul that dequantized."""
        self._autocast: list[bool] = []
        """One entry per ``gemm_4bit`` call in flight that was made with autocast on (NOTE [ The 4-bit
        matmul under autocast ])."""

    def __enter__(self):
        _AutocastKernel.enter(self._autocast)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _AutocastKernel.exit()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE and type(args[0]) is FakeTensor:  # (NOTE [ Device queries ] in memfit.device_queries)
            return args[0].device
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) == "bitsandbytes" and func.__name__ == "gemm_4bit.default":
            with _autocast_again() if self._autocast else contextlib.nullcontext():
                if isinstance(args[0], FakeTensor):
                    return self._gemm_4bit(*args, **kwargs)
                # bitsandbytes' own kernel, called as with no mode: its ops autocast, and the modes below
                # (memfit's tracker) see them
                backend = getattr(torch._C.DispatchKey, args[0].device.type.upper())
                return func.redispatch(torch._C.DispatchKeySet(backend), *args, **kwargs)
        return func(*args, **kwargs)

    def _gemm_4bit(self, A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None,
                   absmax_code=None, absmax_offset=None):
        ops = torch.ops.bitsandbytes
        K = A.shape[-1]
        M = A.numel() // K
        if self.device.is_gpu and cuda_fused_4bit(self.device, A.dtype, M, shapeB[0], K, blocksize):
            return ops.gemm_4bit.default(A, B, shapeB, absmax, blocksize, quant_type, bias)  # output only
        if absmax_8bit is not None:
            scales = ops.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256, torch.float32)
            absmax = scales + absmax_offset
        weight = ops.dequantize_4bit.default(B, absmax, blocksize, quant_type, shapeB, A.dtype)
        self.dequantized.append((M, weight.numel() * weight.element_size()))
        return torch.nn.functional.linear(A, weight, bias)


_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


class _AutocastKernel:
    """One AutocastCPU kernel for ``gemm_4bit`` while any :class:`Gemm4bitKernels` is entered: it pushes True
    on the innermost mode's list while the call runs on below the autocast key (NOTE [ The 4-bit matmul
    under autocast ]). Registered once for nested modes (a compiled region's trace inside a step's), on a
    library destroyed when the outermost exits: torch 2.11 refuses a second kernel for the key, where
    2.14 warns and overrides."""

    active: list[list[bool]] = []
    library = None

    @classmethod
    def enter(cls, calls: list[bool]) -> None:
        cls.active.append(calls)
        if len(cls.active) == 1:
            cls.library = _register_autocast_kernel(cls.active)

    @classmethod
    def exit(cls) -> None:
        cls.active.pop()
        if not cls.active and cls.library is not None:
            cls.library._destroy()
            cls.library = None


def _register_autocast_kernel(active: list[list[bool]]):
    """Register, on a library the caller destroys, the kernel of :class:`_AutocastKernel` (its calls pushed
    on ``active[-1]``). None where bitsandbytes has no ``gemm_4bit``."""
    op = getattr(getattr(torch.ops, "bitsandbytes", None), "gemm_4bit", None)
    if op is None:
        return None
    overload = op.default

    def kernel(keyset, *args, **kwargs):
        calls = active[-1]
        calls.append(True)
        try:  # (autocast excluded too, as PyTorch's own autocast kernels do: under Dynamo's Python dispatcher a
            # redispatch recomputes the keys from the thread's, and would come back here)
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST):
                return overload.redispatch(keyset - _AUTOCAST, *args, **kwargs)
        finally:
            calls.pop()

    library = torch.library.Library("bitsandbytes", "IMPL")
    library.impl("gemm_4bit", kernel, "AutocastCPU", with_keyset=True)
    return library


def _autocast_again():
    """Autocast on again inside a dispatch mode, where the dispatcher excluded it."""
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - _AUTOCAST)


def cuda_fused_4bit(device, dtype, M: int, N: int, K: int, blocksize: int) -> bool:
    """Does bitsandbytes' CUDA ``gemm_4bit`` take its fused kernel (no dequantized weight) for this
    shape on ``device``? bitsandbytes' own heuristic, asked with the preset's SM count and
    compute capability; False (dequantize + F.linear) when it cannot be asked."""
    try:
        errors_only("bitsandbytes")
        from bitsandbytes.backends.cuda import ops as cuda_ops
    except Exception:  # noqa: BLE001 - an install without the CUDA backend: the fallback path
        return False
    if M > cuda_ops._gemm_4bit_custom_max_m or K % blocksize != 0:
        return False
    major, minor = device.compute_capability or (9, 0)
    props = cuda_ops._gpu_dispatch_props
    cuda_ops._gpu_dispatch_props = lambda index: (device.sm_count, major, minor)
    try:
        return bool(cuda_ops._gemm_4bit_use_custom_cuda.__wrapped__(0, dtype, M, N, K))
    finally:
        cuda_ops._gpu_dispatch_props = props


rng_ops.register(Gemm4bitKernels)  # (memfit.rng_ops)
