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

GPU presets get no probes: their kernels (cuBLAS, cuDNN, flash attention) cannot run here.
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
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.mean.dim, aten.mean.default, aten.sum.dim_IntList, aten.sum.default,
    aten.native_batch_norm.default, aten.native_batch_norm_backward.default,
    aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_functional.default,
    aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
    aten.embedding_dense_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._log_softmax.default, aten._log_softmax_backward_data.default,
    aten._softmax.default, aten._softmax_backward_data.default,
    aten.nll_loss_forward.default, aten.nll_loss_backward.default,
    aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default,
    aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default,
    aten.cumsum.default, aten.sort.default, aten.topk.default,
}
MAX_PROBE_BYTES = 64 << 20
"""Largest inputs + outputs of a probed ATen kernel call: keeps probing fast and its memory small."""
MAX_CUSTOM_PROBE_BYTES = 1 << 30
"""Custom ops (e.g. bitsandbytes' 8-bit optimizer update, plain torch code inside one op, holding
fp32 copies of both states, the gradient and the weight) are probed up to this size: their
scratch is several times their tensors, and an optimizer update on an embedding is large."""


def is_custom_op(func) -> bool:
    return getattr(func, "namespace", "aten") not in ("aten", "prims", "prim", "_c10d_functional", "c10d")
RANGE = "memfit::probe"


@dataclass(frozen=True)
class ProbeResult:
    scratch_bytes: int
    output_nbytes: tuple[int, ...]
    """Real storage bytes of each tensor output, in tree_flatten order."""


class KernelProbe:
    """Measure kernels on real CPU tensors shaped like the fake ones; cached by signature."""

    def __init__(self, ops=CPU_PROBED_OPS, max_bytes: int = MAX_PROBE_BYTES):
        self.ops = ops
        self.max_bytes = max_bytes
        self.cache: dict[tuple, ProbeResult | None] = {}

    def wants(self, func) -> bool:
        return func in self.ops or is_custom_op(func)

    def __call__(self, func, args, kwargs, out) -> ProbeResult | None:
        key = _signature(func, args, kwargs)
        if key in self.cache:
            return self.cache[key]
        leaves = [x for x in tree_flatten((args, kwargs, out))[0] if isinstance(x, torch.Tensor)]
        cap = MAX_CUSTOM_PROBE_BYTES if is_custom_op(func) else self.max_bytes
        if any(t.device.type != "cpu" for t in leaves) or sum(t.untyped_storage().nbytes() for t in leaves) > cap:
            self.cache[key] = None
            return None
        try:
            res = _measure(func, args, kwargs)
        except Exception:  # noqa: BLE001 - e.g. meta and CPU kernels disagree on a dtype
            res = None
        self.cache[key] = res
        return res


def _signature(func, args, kwargs) -> tuple:
    def sig(x):
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.storage_offset(), x.untyped_storage().nbytes())
        return repr(x)
    return (func, tuple(tree_flatten(tree_map(sig, (args, kwargs)))[0]))


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


# Kernels whose inputs must be consistent with each other, not just shaped alike.
_CONSISTENT_ARGS = {aten.mkldnn_rnn_layer_backward.default: _rnn_backward_args}


def _measure(func, args, kwargs) -> ProbeResult:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.profiler import ProfilerActivity, profile, record_function

    from memfit.memory.quiet import QuietProfiler

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
