"""Kernel probes: what a CPU kernel allocates that fake tensors cannot show.

See NOTE [ What a storage tracker cannot see ] in tracker.py. Some kernels hold scratch memory
while they run (oneDNN convolution and RNN scratchpads, bf16 matmul weight packing, fp32
accumulation buffers of 16-bit reductions), and some meta kernels get an output's size wrong
(``mkldnn_rnn_layer``'s workspace is empty on meta tensors, 4 MB for real on a small LSTM).

For the ``cpu`` device the kernel that will run is on this machine, so memfit measures it: the op
is run once on real random tensors of the same shapes, strides and dtypes, inside a profiler
session that records the CPU allocator. Scratch = peak live bytes inside the op minus the bytes
still held at its end (its outputs). Results are cached by signature, so a model with 32 identical
layers probes each kernel shape once. Kernels whose tensors exceed ``max_bytes`` are not probed
and are listed as an approximation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten

# Kernels seen to hold scratch (or return mis-sized outputs on meta) on x86 CPUs with oneDNN.
CPU_PROBED_OPS = {
    aten.convolution.default, aten.convolution_backward.default,
    aten.mkldnn_rnn_layer.default, aten.mkldnn_rnn_layer_backward.default,
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
    aten.mean.dim, aten.mean.default, aten.sum.dim_IntList, aten.sum.default,
    aten.native_batch_norm.default, aten.native_batch_norm_backward.default,
    aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_functional.default,
    aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
    aten.embedding_dense_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._log_softmax.default, aten._log_softmax_backward_data.default,
    aten._softmax.default, aten._softmax_backward_data.default,
    aten._safe_softmax.default,  # (SDPA's math path: a -inf mask and its all() inside the op)
    aten.nll_loss_forward.default, aten.nll_loss_backward.default,
    aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default,
    aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default,
    aten.cumsum.default, aten.sort.default, aten.topk.default,
    # a mean/sum MSE returns a 0-dim view of its elementwise buffer, kept alive for backward
    aten.mse_loss.default,
    # a mixture of experts' grouped GEMM: one mm_out per expert, each packing its operands (bf16)
    aten._grouped_mm.default,
    # LAPACK's SVD (GaLore's projection): a column-major copy of the input and gesdd's work arrays
    aten._linalg_svd.default,
}
# NOTE [ Mixed dtypes on a CPU ]
# A binary elementwise op over tensors of two dtypes (bf16 activations times fp32 weights) computes
# in the promoted dtype; on a CPU, TensorIterator first copies each input of another dtype into a
# temporary of the promoted dtype (measured here: ``bf16[256, 64] * fp32[256, 1]`` holds a 64 KiB
# fp32 copy of the bf16 operand while it runs). The ops of :data:`MIXED_DTYPE_OPS` are probed when
# their inputs' dtypes differ, and cost nothing to look at otherwise.
MIXED_DTYPE_OPS = {
    aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.where.self, aten.maximum.default,
    aten.minimum.default, aten.mul_.Tensor, aten.add_.Tensor, aten.sub_.Tensor, aten.div_.Tensor,
}
"""Elementwise ops whose CPU kernel (TensorIterator) copies an input of another dtype than the
result's into a temporary of the result's dtype before computing (CUDA casts on the fly): e.g. a
mixture of experts' bf16 expert outputs times its fp32 routing weights. Probed only when their
tensor inputs differ in dtype (NOTE [ Mixed dtypes on a CPU ])."""
CPU_PROBED_OPS |= MIXED_DTYPE_OPS
MAX_PROBE_BYTES = 64 << 20
"""Largest inputs + outputs of a probed ATen kernel call: keeps probing fast and its memory small."""
MAX_CUSTOM_PROBE_BYTES = 1 << 30
"""Custom ops (e.g. bitsandbytes' 8-bit optimizer update, plain torch code inside one op, holding
fp32 copies of both states, the gradient and the weight) are probed up to this size: their
scratch is several times their tensors, and an optimizer update on an embedding is large."""


FULL_PROBE_EFFORT = 4
"""A call that cannot be shrunk (e.g. a convolution of batch 1) still runs at full size if it
costs at most this many times its FLOP budget (see :func:`flop_budget`)."""


def _gloo_scratch():
    if not torch.distributed.is_available():  # (a PyTorch build without distributed: no collectives)
        return {}
    c10d = torch.ops.c10d
    return {c10d._allgather_base_.default: 0,  # the output: a flat copy of it
            c10d._reduce_scatter_base_.default: 1}  # the input: a clone of it


# NOTE [ gloo's collective scratch ]
# A sharded rank on a CPU talks through gloo, whose collectives cannot be probed (they need the
# other ranks), so their scratch is booked by rule, measured on 2-rank FSDP2 runs here (profiler
# allocator events, ``bench/sharding_cpu.py``): ``_allgather_base_`` gathers into a flat buffer the
# size of its output and copies that out, and ``_reduce_scatter_base_`` all-reduces a clone of its
# whole input before copying the caller's shard out. Each is booked as scratch of the call; the
# reduce-scatter's clone really lives until gloo's worker thread finishes the all-reduce, a
# millisecond or two after the call returns, while the caller goes on. NCCL's buffers are its own
# (outside PyTorch's allocator), and GPU presets get no probes, so they book none.
GLOO_SCRATCH = _gloo_scratch()
"""Collectives with scratch on gloo (NOTE [ gloo's collective scratch ]): the argument whose bytes
it is."""


def is_custom_op(func) -> bool:
    return getattr(func, "namespace", "aten") not in ("aten", "prims", "prim", "_c10d_functional", "c10d")
RANGE = "memfit::probe"


# NOTE [ Probes never run full-size work ]
# A probe's cost is its kernel's work on this CPU, which varies by a factor of 100 between CPUs: a
# bf16 matmul is native with AVX-512 bf16 and emulated (0.1-4 GFLOP/s) with AVX2 only. Each probe
# is therefore priced before it runs: its FLOPs (``torch.utils.flop_counter``'s formulas) against a
# budget fixed by the CPU's features for the dtype (:func:`flop_budget`; never timed, so a busy
# machine cannot change a prediction). A call over budget is probed at smaller shapes: matmuls
# shrink M, K, N (and the batch of ``bmm``), convolutions their batch, and the scratch is
# extrapolated multi-linearly from two sizes per shrunk dimension. That is exact when scratch is a
# sum of packing/accumulation buffers, each proportional to a product of those dimensions (A: M*K,
# B: K*N, C: M*N), which is how oneDNN and MKL size them; such calls are listed in the report as
# scaled. A call that cannot be made cheap enough is not probed and is listed as not counted.
#
# GPU presets get no probes: their kernels (cuBLAS, cuDNN, flash attention) cannot run here.
@dataclass(frozen=True)
class ProbeResult:
    scratch_bytes: int
    output_nbytes: tuple[int, ...]
    """Real storage bytes of each tensor output, in tree_flatten order."""
    scaled: bool = False
    """Extrapolated from probes at smaller shapes (see NOTE [ Probes never run full-size work ])."""
    error: str = ""
    """The kernel failed on this CPU (e.g. oneDNN has no bf16 LSTM without AVX-512): a real run
    will fail too; its scratch is not counted."""


class KernelProbe:
    """Measure kernels on real CPU tensors shaped like the fake ones; cached by signature."""

    def __init__(self, ops=CPU_PROBED_OPS, max_bytes: int = MAX_PROBE_BYTES):
        self.ops = ops
        self.max_bytes = max_bytes
        self.cache: dict[tuple, ProbeResult | None] = {}
        self._wanted: dict = {}  # op -> wants(op): asked on every op of a trace

    def wants(self, func) -> bool:
        hit = self._wanted.get(func)
        if hit is None:
            hit = self._wanted[func] = func in self.ops or func in GLOO_SCRATCH or is_custom_op(func)
        return hit

    def __call__(self, func, args, kwargs, out) -> ProbeResult | None:
        if func in MIXED_DTYPE_OPS and not _mixed_dtypes(args):
            return _NO_SCRATCH
        if func in GLOO_SCRATCH:
            t = args[GLOO_SCRATCH[func]]
            return ProbeResult(scratch_bytes=t.numel() * t.element_size(), output_nbytes=())
        key = _signature(func, args, kwargs)
        if key in self.cache:
            return self.cache[key]
        leaves = [x for x in tree_flatten((args, kwargs, out))[0] if isinstance(x, torch.Tensor)]
        cap = MAX_CUSTOM_PROBE_BYTES if is_custom_op(func) else self.max_bytes
        too_big = sum(t.untyped_storage().nbytes() for t in leaves) > cap
        if any(t.device.type != "cpu" for t in leaves) or (too_big and _dim_names(func, args) is None):
            self.cache[key] = None
            return None
        try:
            effort = max(probe_effort(func, args, kwargs, out), sum(t.untyped_storage().nbytes() for t in leaves) / cap)
            res = _measure(func, args, kwargs) if effort <= 1 else _scaled_measure(func, args, kwargs, out, effort)
            if res is None and effort <= FULL_PROBE_EFFORT and not too_big:
                res = _measure(func, args, kwargs)  # too small to shrink, and still cheap enough
        except Exception as e:  # noqa: BLE001 - e.g. no kernel for this dtype on this CPU (oneDNN bf16 LSTM)
            res = ProbeResult(scratch_bytes=0, output_nbytes=(), error=_first_sentence(e))
        self.cache[key] = res
        return res


_NO_SCRATCH = ProbeResult(scratch_bytes=0, output_nbytes=())


def _mixed_dtypes(args) -> bool:
    """Do the (non-scalar) tensor inputs of an elementwise op differ in dtype?"""
    dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim()}
    return len(dtypes) > 1


def _first_sentence(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0].split(". ")[0]


def _signature(func, args, kwargs) -> tuple:
    """The call's op, and each argument's layout (a tensor's shape, strides, dtype, offset and
    storage size) or value: what decides a kernel's scratch. Built on every probed call, hit or not."""
    key: list = [func]
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor):
            key += ("T", *x.shape, *x.stride(), x.dtype, x.storage_offset(), x.untyped_storage().nbytes())
        else:
            key.append(repr(x))
    return tuple(key)


def _materialise(x):
    if not isinstance(x, torch.Tensor):
        return x
    nbytes = x.untyped_storage().nbytes()
    # zeros: scratch sizes do not depend on values, and zeros are a valid index/workspace for every kernel
    base = torch.zeros(max(nbytes // x.element_size(), 1), dtype=x.dtype, device="cpu")
    return base.as_strided(x.shape, x.stride(), x.storage_offset())


def _rnn_backward_args(args: list) -> list:
    """mkldnn_rnn_layer_backward reads its forward's workspace: make a real, consistent one."""
    (inp, w1, w2, w3, w4, hx, cx, _out, _hy, _cy, _go, _ghy, _gcy, reverse, mode, hidden, layers, biases, train,
     bidir, batch_sizes, batch_first, _ws) = args
    out, hy, cy, ws = aten.mkldnn_rnn_layer.default(inp, w1, w2, w3, w4, hx, cx, reverse, batch_sizes, mode, hidden,
                                                    layers, biases, bidir, batch_first, train)
    args = list(args)
    args[7], args[8], args[9], args[22] = out, hy, cy, ws
    return args


def _grouped_mm_args(args: list) -> list:
    """_grouped_mm's offsets split its jagged dimension evenly between the groups: the balanced
    routing of NOTE [ Routing on fake tensors ] (zeros would make every group empty)."""
    mat_a, mat_b, offs = args[0], args[1], args[2] if len(args) > 2 else None
    if offs is not None:
        jagged = mat_a.size(1) if mat_a.dim() == 2 and mat_b.dim() == 2 else (
            mat_a.size(0) if mat_a.dim() == 2 else mat_b.size(1))
        groups = offs.size(0)
        args = list(args)
        args[2] = torch.tensor([(i + 1) * jagged // groups for i in range(groups)], dtype=offs.dtype)
    return args


def _grouped_mm_flops(args, out) -> int:
    """2 x output elements x contraction; a 2-D x 2-D grouped GEMM contracts its jagged dimension
    (each group's share of it)."""
    mat_a, mat_b = args[0], args[1]
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * (out.numel() // max(out.size(0), 1)) * mat_a.size(1)
    return 2 * out.numel() * mat_a.size(-1)


# Kernels whose inputs must be consistent with each other, not just shaped alike.
_CONSISTENT_ARGS = {aten.mkldnn_rnn_layer_backward.default: _rnn_backward_args,
                    aten._grouped_mm.default: _grouped_mm_args}


def _measure(func, args, kwargs) -> ProbeResult:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.profiler import ProfilerActivity, profile, record_function

    from memfit.quiet import QuietProfiler

    with unset_fake_temporarily(), torch.enable_grad():  # oneDNN RNN returns its workspace only with grad on
        real_args, real_kwargs = tree_map(_materialise, (args, kwargs))
        if func in _CONSISTENT_ARGS:
            real_args = _CONSISTENT_ARGS[func](list(real_args))
        with QuietProfiler(profile(activities=[ProfilerActivity.CPU], profile_memory=True)) as prof:
            with record_function(RANGE):
                out = func(*real_args, **real_kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        output_nbytes = tuple(t.untyped_storage().nbytes() for t in outs)
        events = prof.profiler.kineto_results.events()
        rng = next(e for e in events if e.name() == RANGE)
        live = peak = 0
        for _t, n in sorted((e.start_ns(), e.nbytes()) for e in events
                           if e.name() == "[memory]" and rng.start_ns() <= e.start_ns() <= rng.end_ns()):
            live += n
            peak = max(peak, live)
        del out, outs
    return ProbeResult(scratch_bytes=max(peak - live, 0), output_nbytes=output_nbytes)


def probe_for(device) -> KernelProbe | None:
    return _CPU_PROBE if not device.is_gpu else None


_CPU_PROBE = KernelProbe()  # process-wide cache: kernel scratch depends only on this machine


# -- pricing and shrinking (NOTE [ Probes never run full-size work ]) ----------------------------

_CONV_OPS = {aten.convolution.default, aten.convolution_backward.default}


def native_dtype(dtype: torch.dtype) -> bool:
    """Does this CPU compute ``dtype`` natively (fp32; bf16/fp16 with AVX-512 bf16/fp16 or AMX)?"""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def flop_budget(func, dtype: torch.dtype) -> float:
    """FLOPs one probe may run. Native kernels run at tens of GFLOP/s here: 2 GFLOP. Emulated
    16-bit matmuls run at 0.1-4 GFLOP/s (oneDNN's non-transposed path is the slow one): 20 MFLOP;
    emulated 16-bit convolutions convert to fp32 internally and are fast enough for 1 GFLOP.
    Fixed by the CPU's features, not timed, so a busy machine never changes a prediction."""
    if native_dtype(dtype):
        return 2e9
    return 1e9 if func in _CONV_OPS else 2e7


def probe_effort(func, args, kwargs, out) -> float:
    """A full-size probe's FLOPs over its budget (``torch.utils.flop_counter``'s formulas: matmuls,
    convolutions, attention); 0 for ops without a formula, which are memory-bound and kept cheap
    by the byte cap."""
    from torch.utils.flop_counter import flop_registry
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    formula = flop_registry.get(func.overloadpacket)
    if func is aten._grouped_mm.default:
        formula = lambda *a, out_val, **k: _grouped_mm_flops(a, out_val)  # noqa: E731 - (no formula in torch)
    if formula is None or not tensors:
        return 0.0
    flops = formula(*args, **kwargs, out_val=out)
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
    return flops / flop_budget(func, dtype)


def _right_aligned(t: torch.Tensor, names: tuple[str, ...]) -> tuple[str | None, ...]:
    """Dimension names of a broadcast operand (a bias): size-1 dims stay 1."""
    tail = names[len(names) - t.dim():]
    return tuple(n if s != 1 else None for n, s in zip(tail, t.shape))


def _dim_names(func, args) -> dict[int, tuple[str | None, ...]] | None:
    """Which positional tensor arguments carry which shrinkable dimensions (None: keep the size)."""
    if func is aten.mm.default:
        return {0: ("M", "K"), 1: ("K", "N")}
    if func is aten.addmm.default:
        return {0: _right_aligned(args[0], ("M", "N")), 1: ("M", "K"), 2: ("K", "N")}
    if func is aten.bmm.default:
        return {0: ("B", "M", "K"), 1: ("B", "K", "N")}
    if func is aten.baddbmm.default:
        return {0: _right_aligned(args[0], ("B", "M", "N")), 1: ("B", "M", "K"), 2: ("B", "K", "N")}
    if func is aten.convolution.default and not args[6]:  # not transposed
        return {0: ("N",) + (None,) * (args[0].dim() - 1)}
    if func is aten.convolution_backward.default and not args[7]:
        return {0: ("N",) + (None,) * (args[0].dim() - 1), 1: ("N",) + (None,) * (args[1].dim() - 1)}
    return None


def _like(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Zeros of ``shape`` laid out like ``t`` (same dimension order of strides: a transposed
    operand stays transposed, which decides the kernel oneDNN picks)."""
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))
    base = torch.zeros([shape[i] for i in order], dtype=t.dtype)
    return base.permute([order.index(i) for i in range(t.dim())])


def _scaled_measure(func, args, kwargs, out, effort: float) -> ProbeResult | None:
    """Probe at smaller shapes and extrapolate; None if the op cannot be shrunk enough.
    ``effort``: the full-size probe's price relative to what one probe may cost (> 1)."""
    from itertools import product

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    names = _dim_names(func, args)
    if names is None:
        return None
    full: dict[str, int] = {}
    for i, dims in names.items():
        for n, size in zip(dims, args[i].shape):
            if n is not None:
                full[n] = size
    small: dict[str, int] = {}  # shrunk dimension -> the smaller of its two probe sizes

    def price() -> float:  # all 2^k probes, at the larger probe size of each shrunk dimension
        ratio = 1.0
        for n, r in small.items():
            ratio *= 2 * r / full[n]
        return effort * ratio * 2 ** len(small)

    while price() > 1:
        # halve the largest dimension; one not shrunk yet doubles the number of probes, so it
        # starts at an eighth (probes at 1/8 and 1/4 of its size)
        current = {n: 2 * small[n] if n in small else full[n] for n in full}
        n = max((n for n in current if (current[n] >= 4 if n in small else current[n] >= 2 and len(small) < 3)),
                key=current.get, default=None)
        if n is None:
            return None
        small[n] = small[n] // 2 if n in small else max(current[n] // 8, 1)

    shrunk = sorted(small)
    total = 0.0
    with unset_fake_temporarily():
        for corner in product((0, 1), repeat=len(shrunk)):
            sizes = dict(full)
            weight = 1.0
            for n, hi in zip(shrunk, corner):
                r = small[n]
                sizes[n] = 2 * r if hi else r
                # linear extrapolation from sizes r and 2r to the full size, one dimension at a time
                weight *= (full[n] - r) / r if hi else (2 * r - full[n]) / r
            new_args = list(args)
            for i, dims in names.items():
                shape = [sizes[n] if n is not None else s for n, s in zip(dims, args[i].shape)]
                new_args[i] = _like(args[i], shape)
            total += weight * _measure(func, tuple(new_args), kwargs).scratch_bytes
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return ProbeResult(scratch_bytes=max(int(round(total)), 0),
                       output_nbytes=tuple(t.untyped_storage().nbytes() for t in outs), scaled=True)
