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

Where the values that size them are known, they are used instead: the real twins of the trace's small
integer and boolean tensors (NOTE [ Real values of small integer tensors ] in memfit.real_values),
which a synthetic batch's labels and lengths have, and SpecAugment's mask, drawn with numpy on the host.
Any op sized by values whose arguments all have twins is sized by running it on them (Qwen2-VL's
``repeat_interleave`` of its image grid, ``unique_consecutive`` of its window bounds); an index by a
boolean mask with a twin is traced as the index by its ``nonzero`` positions, with that
``nonzero``'s output as the op's scratch. A mask computed from activations has no twin: ``masked_select``
by it is sized by the full-mask assumption above, and an index by it still fails the trace.

transformers runs CTC with cuDNN disabled (``torch.backends.cudnn.flags(enabled=False)``), so on a
GPU these are ATen's native kernels, whose allocations are the CPU kernel's.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

SIZED = frozenset({aten.nonzero.default, aten.masked_select.default, aten._ctc_loss.Tensor})
"""Ops answered by :func:`outputs` when fake mode cannot size them."""


def outputs(func, args, count, longest) -> tuple[object, str | None] | None:
    """(``func``'s outputs on the inputs' device, the assumption made for them or None where the values
    that size them are known) for ``func`` of :data:`SIZED`; None where nothing sizes them here.
    ``count(mask)``: a mask's True values, ``longest(lengths)``: the largest length, each None where
    unknown (memfit.real_values)."""
    if func is aten.nonzero.default:
        rows = count(args[0])
        return None if rows is None else (
            torch.empty((rows, args[0].dim()), dtype=torch.long, device=args[0].device), None)
    if func is aten.masked_select.default:
        x, mask = args[0], args[1]
        shape = torch.broadcast_shapes(x.shape, mask.shape)
        rows = count(mask) if mask.shape == shape else None
        assumption = None if rows is not None else \
            "a data-dependent masked_select assumed a full mask (every element selected)"
        return torch.empty(shape.numel() if rows is None else rows, dtype=x.dtype, device=x.device), assumption
    log_probs, targets = args[0], args[1]
    if log_probs.dim() != 3 or targets.dim() not in (1, 2):
        return None
    frames, batch = log_probs.shape[0], log_probs.shape[1]
    most, assumption = longest(args[3]), None
    if most is None:
        most = targets.shape[1] if targets.dim() == 2 else targets.numel() // max(batch, 1)
        assumption = f"CTC targets assumed {most} tokens each (log_alpha sized by the longest)"
    return (torch.empty(batch, dtype=log_probs.dtype, device=log_probs.device),
            torch.empty(batch, frames, 2 * int(most) + 1, dtype=log_probs.dtype, device=log_probs.device)), assumption


SCRATCH = {aten._ctc_loss_backward.Tensor: 6}
"""Ops whose kernel holds a scratch tensor shaped as one of its arguments (the index) while it runs:
CTC's backward, ``log_beta = empty_like(log_alpha)``."""


def scratch_bytes(func, args) -> int:
    t = args[SCRATCH[func]]
    return t.numel() * t.element_size()


