"""Ops whose output size depends on tensor values, sized on fake tensors by stated assumptions.

NOTE [ Sizes a fake tensor cannot know ]
A fake tensor has shapes, not values, and some ops size their outputs by values. Fake mode then
raises (``DynamicOutputShapeException``) and the trace falls back to a real run on this CPU, which
cannot stand in for a GPU's kernels. The ops below are sized instead, under the assumptions of
NOTE [ Assumed scalars ] in tracker.py (a boolean mask is full), each listed in the report:

- ``masked_select(x, mask)`` returns one element per True of the mask: assumed full, every element
  of the broadcast shape selected. A synthetic batch's masks are full (e.g. a CTC head's
  ``labels >= 0``, where labels have no padding), so there the size is exact; for a mask computed
  from activations it is an upper bound.
- ``_ctc_loss`` (lengths as tensors: how ``F.ctc_loss`` calls it from a model) returns the loss per
  sample ``[B]`` and ``log_alpha`` ``[B, T, 2 * S + 1]``, S the longest target. Targets given
  concatenated (1-D, as transformers' CTC heads give them) are assumed of equal length, S = their
  number / B, as a synthetic batch's labels are; targets padded to ``[B, S]`` give S directly.
  ``log_alpha`` is what CTC saves for backward: for 30 s of 16 kHz audio (T = 1,499 frames of
  wav2vec2) and 448 labels it is 5.4 MB a sample in fp32, small beside the encoder's activations.
- ``_ctc_loss_backward`` has no value-sized output (fake mode gives its gradient, shaped as
  ``log_probs``), but while it runs it holds ``log_beta``, an ``empty_like(log_alpha)``, in both
  the CPU and the CUDA kernel (ATen's LossCTC.cpp and LossCTC.cu): booked as the op's scratch.

Boolean masks made from host data are different: their values are real. SpecAugment in wav2vec2,
HuBERT, WavLM and Data2Vec draws which frames to mask with numpy, makes a mask of it with
``torch.tensor`` (a real tensor lifted into fake mode) and writes ``hidden_states[mask] = embed``,
whose backward indexes the gradient by that mask. :class:`HostMasks` counts the True values of
each mask lifted from the host (following copies and casts of it), and an index by such a mask is
traced as the index by the ``nonzero`` positions the kernel computes, with that ``nonzero``'s output
as the op's scratch: exact for the mask the trace drew (a real step draws another, of about as many).
A mask computed from fake tensors is not known, and indexing by it still fails the trace.

transformers runs CTC with cuDNN disabled (``torch.backends.cudnn.flags(enabled=False)``), so on a
GPU these are ATen's native kernels, whose allocations are the CPU kernel's.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

aten = torch.ops.aten

SIZED = frozenset({aten.masked_select.default, aten._ctc_loss.Tensor})
"""Ops answered by :func:`assumed_outputs` when fake mode cannot size them."""


def assumed_outputs(func, args) -> tuple[object, str] | None:
    """(outputs on the inputs' device, the assumption said in the report) for ``func`` of
    :data:`SIZED`, or None where its arguments are not of the form sized here."""
    if func is aten.masked_select.default:
        x, mask = args[0], args[1]
        shape = torch.broadcast_shapes(x.shape, mask.shape)
        return (torch.empty(shape.numel(), dtype=x.dtype, device=x.device),
                "a data-dependent masked_select assumed a full mask (every element selected)")
    log_probs, targets = args[0], args[1]
    if log_probs.dim() != 3 or targets.dim() not in (1, 2):
        return None
    frames, batch = log_probs.shape[0], log_probs.shape[1]
    longest = targets.shape[1] if targets.dim() == 2 else targets.numel() // max(batch, 1)
    outputs = (torch.empty(batch, dtype=log_probs.dtype, device=log_probs.device),
               torch.empty(batch, frames, 2 * longest + 1, dtype=log_probs.dtype, device=log_probs.device))
    return outputs, f"CTC targets assumed {longest} tokens each (log_alpha sized by the longest)"


SCRATCH = {aten._ctc_loss_backward.Tensor: 6}
"""Ops whose kernel holds a scratch tensor shaped as one of its arguments (the index) while it runs:
CTC's backward, ``log_beta = empty_like(log_alpha)``."""


def scratch_bytes(func, args) -> int:
    t = args[SCRATCH[func]]
    return t.numel() * t.element_size()


LIFTS = frozenset({aten.lift_fresh.default, aten.lift_fresh_copy.default, aten._to_copy.default, aten.clone.default})
"""Ops that make a mask of host data (``torch.tensor``), or a copy of one."""
MASK_INDEXED = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                          aten._unsafe_index_put.default})
"""Ops indexed by a list of tensors, where a boolean mask stands for its ``nonzero`` positions."""


class HostMasks:
    """True counts of boolean masks whose values the trace knows (see the module's NOTE)."""

    def __init__(self, token_of):
        self._token_of = token_of  # a tensor -> its storage's token
        self._counts: dict[object, tuple[int, int]] = {}  # token -> (elements, True among them)

    def seen(self, func, args, out) -> None:
        """After one of :data:`LIFTS` made ``out``: remember its count if it is a known mask."""
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool or not args:
            return
        src = args[0]
        if func in (aten.lift_fresh.default, aten.lift_fresh_copy.default):
            count = (out.numel(), _true_count(src)) if type(src) is torch.Tensor else None
        else:
            count = self._count(src) if isinstance(src, torch.Tensor) and src.numel() == out.numel() else None
        token = self._token_of(out)
        if count is not None and token is not None:
            self._counts[token] = count

    def _count(self, mask: torch.Tensor) -> tuple[int, int] | None:
        if mask.dtype not in (torch.bool, torch.uint8):
            return None
        known = self._counts.get(self._token_of(mask))
        return known if known is not None and known[0] == mask.numel() else None  # (not a view of part of it)

    def as_positions(self, func, args) -> tuple[tuple, int] | None:
        """(``func``'s arguments with each known mask among its indices replaced by its positions, the
        bytes of the ``nonzero`` the kernel computes for them), or None if a mask there is unknown."""
        indices = args[1]
        positions, scratch = [], 0
        for index in indices:
            if index is None or index.dtype not in (torch.bool, torch.uint8):
                positions.append(index)
                continue
            known = self._count(index)
            if known is None:
                return None
            rows = known[1]
            positions += [torch.empty(rows, dtype=torch.long, device=index.device) for _ in range(index.dim())]
            scratch += rows * index.dim() * 8
        return (args[0], positions, *args[2:]), scratch


def _true_count(real: torch.Tensor) -> int:
    with _disable_current_modes():  # (a real tensor: counted by its kernel, not by fake mode)
        return int(real.count_nonzero())
