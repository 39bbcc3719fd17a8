"""Rule: autocast follows CUDA's op lists, not the CPU's.

``torch.autocast`` decides per op whether to run it in 16 bits, in fp32 or in the widest input
type, and each device type has its own lists (aten/src/ATen/autocast_mode.cpp). A GPU preset is
traced on fake CPU tensors under CPU autocast, whose lists differ from CUDA's in ways that change
activation memory by 2x for the tensors involved:

- CUDA runs ``pow``, ``exp``, ``log``, ``rsqrt``, ``softplus``, ``layer_norm``, ``group_norm``,
  ``softmax``, ``log_softmax``, ``sum``, ``cumsum`` ... in fp32; the CPU leaves them in 16 bits. A
  GPT-2 GELU (``0.5 * x * (1 + tanh(c * (x + 0.044715 * pow(x, 3))))``) on bf16 activations
  therefore produces fp32 tensors on CUDA (snap-gpt2-bf16-small: ``pow`` and ``tanh`` outputs
  are twice the bytes of the bf16 ``addmm`` output feeding them).
- ``softmax``/``log_softmax``/``sum``/``cumsum``/``prod``/norms get ``dtype=float32`` on CUDA (no
  separate fp32 copy of the input); the CPU casts the input of ``cross_entropy_loss``,
  ``prod`` ... to fp32 first.
- CUDA promotes ``addcmul``, ``addcdiv``, ``index_put``, ``scatter_add`` ... to the widest input
  type, runs ``mv``, ``einsum``, ``convolution``, RNN cells in 16 bits, and refuses
  ``binary_cross_entropy``; the CPU has its own lists (FFTs, linalg, pooling, padding in fp32).

During a GPU-target trace memfit registers Python kernels under the ``AutocastCPU`` dispatch key
for every op whose CPU policy differs from CUDA's, implementing CUDA's policy (and a plain
pass-through for ops only the CPU list casts), and removes them when the trace ends: the CPU
autocast machinery (enabled state, dtype, weight cast cache for matmuls) stays in charge of
everything else. ``CUDA_POLICY`` lists the policy of every op that has an ``AutocastCUDA`` kernel
in the installed torch; a unit test checks that list against the dispatcher. Casts of parameters
for 16-bit ops that only CUDA lists are not cached (CPU's cache covers the matmuls/convolutions
both lists share).
"""

from __future__ import annotations

import contextlib

import torch

from memfit.quiet import silenced_warnings
from memfit.techniques.compiled import CAPTURE_PAUSES, while_capturing

aten = torch.ops.aten

LOWER, FP32, SET_DTYPE, APPEND_DTYPE, PROMOTE, BANNED, PASS = (
    "lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned", "pass")

_CUDA_LOWER = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "_cudnn_rnn")
_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa", "rms_norm", "linalg_matrix_sqrth")
_CUDA_SET_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
_CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                 "scatter_add", "tensordot")

CUDA_POLICY: dict[str, str] = {
    **dict.fromkeys(_CUDA_LOWER, LOWER), **dict.fromkeys(_CUDA_FP32, FP32), **dict.fromkeys(_CUDA_SET_DTYPE, SET_DTYPE),
    **dict.fromkeys(_CUDA_PROMOTE, PROMOTE), "norm.Scalar": APPEND_DTYPE, "norm.ScalarOpt_dim": APPEND_DTYPE,
    "binary_cross_entropy": BANNED,
}
"""The policy of every op with an AutocastCUDA kernel (autocast_mode.cpp, AutocastRNN.cpp)."""

_CPU_LOWER = (
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm", "linalg_vecdot",
    "baddbmm", "addmm", "addbmm", "linear", "_convolution.deprecated", "matmul", "conv_tbc", "mkldnn_rnn_layer",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "prelu", "scaled_dot_product_attention",
    "_native_multi_head_attention", "_addmm_activation")
_CPU_PROMOTE = ("cat", "stack", "index_copy")


def cpu_policy(op: str) -> str | None:
    """The CPU autocast policy of ``op`` (None: no AutocastCPU kernel)."""
    if op in _CPU_LOWER:
        return LOWER
    if op in _CPU_PROMOTE:
        return PROMOTE
    return FP32 if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "AutocastCPU") else None


def registered(key: str) -> set[str]:
    """Ops (``name`` or ``name.overload``) with a kernel for ``key`` in the installed torch."""
    out = set()
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
            out.add(name[6:])
    return out


def _overload(op: str):
    name, _, overload = op.partition(".")
    packet = getattr(aten, name)
    return getattr(packet, overload or "default")


def _is_eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(x, dtype):
    if _is_eligible(x):
        return x.to(dtype)
    if isinstance(x, (list, tuple)) and any(_is_eligible(t) for t in x):
        return type(x)(t.to(dtype) if _is_eligible(t) else t for t in x)
    return x


def _kernel(op_name: str, policy: str):
    """A Python kernel for the AutocastCPU key implementing CUDA's ``policy`` for ``op_name``.

    As autocast_mode.cpp's ``WrapFunction_``, a casting policy runs the op with autocast excluded
    (ops it calls internally are not cast again). ``PASS`` (an op only the CPU list has) hands the
    call on below the autocast key with autocast still on, as an op without an autocast kernel is
    dispatched: ops a composite calls inside are autocast (CUDA's ``cross_entropy_loss`` casts
    nothing itself, but its ``log_softmax`` and ``nll_loss`` follow their own policies)."""
    op = _overload(op_name)
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_index = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(keyset, *args, **kwargs):
        if policy == PASS:
            return op.redispatch(keyset - exclude, *args, **kwargs)
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            if policy == BANNED:
                raise RuntimeError(
                    f"{op_name}: torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
                    "autocast on CUDA (autocast refuses them); use binary_cross_entropy_with_logits / "
                    "BCEWithLogitsLoss")
            if policy == LOWER:
                dt = torch.get_autocast_dtype("cpu")
                return op(*[_cast(a, dt) for a in args], **{k: _cast(v, dt) for k, v in kwargs.items()})
            if policy == FP32:
                return op(*[_cast(a, torch.float32) for a in args],
                          **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
            if policy == SET_DTYPE:
                if args and _is_eligible(args[0]) and dtype_index is not None:
                    if len(args) > dtype_index:
                        if args[dtype_index] is None:
                            args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1:])
                    elif kwargs.get("dtype") is None:
                        kwargs["dtype"] = torch.float32
                return op(*args, **kwargs)
            if policy == APPEND_DTYPE:
                if args and _is_eligible(args[0]):
                    if op_name == "norm.Scalar":
                        return aten.norm.ScalarOpt_dtype(args[0], args[1] if len(args) > 1 else 2,
                                                         dtype=torch.float32)
                    x, p, dim, keepdim = (list(args) + [False])[:4]
                    return aten.norm.ScalarOpt_dim_dtype(x, p, dim, keepdim, dtype=torch.float32)
                return op(*args, **kwargs)
            # PROMOTE: the widest floating type among the tensor arguments
            tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])
                       if _is_eligible(t)]
            if not tensors:
                return op(*args, **kwargs)
            dt = tensors[0].dtype
            for t in tensors[1:]:
                dt = torch.promote_types(dt, t.dtype)
            return op(*[_cast(a, dt) for a in args], **{k: _cast(v, dt) for k, v in kwargs.items()})
    return kernel


def overrides() -> dict[str, str]:
    """op -> the policy to register on AutocastCPU so that CPU autocast acts as CUDA's."""
    out = {}
    for op, policy in CUDA_POLICY.items():
        if not hasattr(aten, op.partition(".")[0]):
            continue
        if cpu_policy(op) != policy:
            out[op] = policy
    for op in registered("AutocastCPU"):
        if op not in CUDA_POLICY:
            out[op] = PASS
    return out


_OVERRIDES: dict[str, str] | None = None


@contextlib.contextmanager
def cuda_autocast(tracker=None):
    """CPU autocast acts with CUDA's op lists while this is active.

    torch.compile cannot capture a graph through these Python kernels, so they step aside while a
    compiled region is captured (memfit.techniques.compiled.CAPTURE_PAUSES): inside compiled
    regions the CPU's lists decide, and the tracker lists that approximation."""
    global _OVERRIDES
    if _OVERRIDES is None:
        _OVERRIDES = overrides()
    libs = [_register()]

    @contextlib.contextmanager
    def unregistered():
        libs.pop()._destroy()
        try:
            yield
        finally:
            libs.append(_register())

    @contextlib.contextmanager
    def paused():
        if tracker is not None:
            tracker.approximate("autocast inside compiled regions follows the CPU's op lists (a GPU preset traced "
                                 "on CPU tensors)", "torch.compile")
        with while_capturing(unregistered):  # NOTE [ Paused only while a region is captured ]
            yield
    CAPTURE_PAUSES.append(paused)
    try:
        yield
    finally:
        CAPTURE_PAUSES.remove(paused)
        libs.pop()._destroy()


_KERNELS: dict[str, object] = {}
"""op -> its Python kernel (made once: a fake trace registers them again after each capture)."""


def _register():
    lib = torch.library.Library("aten", "IMPL")
    with silenced_warnings():
        for op, policy in _OVERRIDES.items():
            try:
                kernel = _KERNELS.get(op)
                if kernel is None:
                    kernel = _KERNELS[op] = _kernel(op, policy)
                lib.impl(op, kernel, "AutocastCPU", with_keyset=True)
            except (RuntimeError, AttributeError):  # an op this torch build lacks
                continue
    return lib
