"""The work one ATen op does, as the op recorder (memfit.planner.opcost) reads it from its
arguments: the tensors it reads and writes and their bytes, its FLOPs (``torch.utils.flop_counter``'s
registry, the formulas FlopCounterMode uses), the dtype its matmuls run in, a cuDNN RNN's gate
matmuls and sequential steps, whether attention is causal."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

ATTENTION_OPS = {p for p in flop_registry if "attention" in str(p)}
HALF = (torch.bfloat16, torch.float16)
RNN_OPS = {aten._cudnn_rnn, aten._cudnn_rnn_backward}
_GATES = {0: 1, 1: 1, 2: 4, 3: 3}
"""cuDNN RNN mode -> gate matrices (RNN_RELU, RNN_TANH, LSTM, GRU)."""


def flat_args(args, kwargs) -> list:
    flat = []
    for a in args:
        flat.append(a)
    if kwargs:
        flat.extend(kwargs.values())
    return flat


def tensors_of(args, kwargs) -> list[torch.Tensor]:
    found = []
    items = args if isinstance(args, (list, tuple)) else (args,)
    for a in (*items, *(kwargs.values() if kwargs else ())):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes an op touches in ``t``: its elements, at most its storage (expanded views)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def flops_of(packet, args, kwargs, out) -> float:
    if packet is aten.linear:
        # composite, so it reaches a dispatch mode whole only where one calls it below autograd
        # (a library kernel's F.linear: NOTE [ The 4-bit matmul under autocast ])
        return 2.0 * args[0].numel() * args[1].shape[0]
    try:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that does not take this overload: count it as memory-bound
        return 0.0


def rnn_work(func, args) -> tuple[float, int]:
    """FLOPs and sequential steps of a cuDNN RNN call (its gate matmuls; backward twice the
    forward's: data and weight gradients)."""
    names = [a.name for a in func._schema.arguments]
    x = args[0]
    mode, hidden, layers, batch_first, bidirectional = (
        args[names.index(n)] for n in ("mode", "hidden_size", "num_layers", "batch_first", "bidirectional"))
    if x.dim() == 3:
        b, t = (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])
    else:  # packed: [sum of lengths, input]
        b, t = 1, x.shape[0]
    dirs = 2 if bidirectional else 1
    inp = x.shape[-1]
    flops = 0.0
    for layer in range(layers):
        width = inp if layer == 0 else hidden * dirs
        flops += 2.0 * _GATES.get(mode, 4) * hidden * (width + hidden) * b * t * dirs
    if func.overloadpacket is aten._cudnn_rnn_backward:
        flops *= 2
    return flops, t * layers * dirs


def matmul_dtype(packet, ins: list[torch.Tensor]) -> str:
    dtype = ins[0].dtype if ins else torch.float32
    if dtype in HALF:
        return "half"
    if packet in (aten.convolution, aten.convolution_backward, aten._convolution, aten.cudnn_convolution):
        return "tf32"  # torch.backends.cudnn.allow_tf32 is True by default
    return "fp32"  # torch.backends.cuda.matmul.allow_tf32 is False by default


def is_causal(func, args, kwargs) -> bool:
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    names = [a.name for a in func._schema.arguments]
    i = names.index("is_causal") if "is_causal" in names else -1
    return 0 <= i < len(args) and bool(args[i])
