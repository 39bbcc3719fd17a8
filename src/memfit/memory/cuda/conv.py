"""Rule: cuDNN convolutions hold a workspace while they run.

``cudnn_convolution`` and its backward passes ask cuDNN's heuristics for an execution plan
(``torch.backends.cudnn.benchmark`` off: the first plan of the heuristic list) and allocate the
plan's workspace from the caching allocator for the duration of the call
(aten/src/ATen/native/cudnn/Conv_v8.cpp ``run_conv_plan``). The plan depends on the cuDNN
version and the card, so its workspace cannot be derived from first principles. What the H100
snapshot shows (snap-cnn-fp32, fp32 NCHW, TF32 allowed, cuDNN 9.19): tensor-core plans work on
NHWC copies, and their workspace is about the size of the layout copies of the tensors involved:

- forward and backward-data: input + output + weight bytes (within 0.001% for three of the four
  layers; 8.4 MB of 8.5 MB on the fourth, which skipped the output copy);
- backward-weight: input + output + weight + half of the larger of input and output (a split-K
  reduction of the weight gradient; within 1% on both layers that had one);
- no workspace for a convolution with fewer than 8 input channels (the stem), whose plan is a
  direct kernel.

Channels-last inputs need no layout copies: their workspace is modelled as 0. This is a
calibrated model of cuDNN's choices on one card, not an exact rule; the report lists it.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _layout_copies(x: torch.Tensor) -> bool:
    """Does cuDNN get this tensor in NCHW (needing an NHWC copy for tensor cores)?"""
    if x.dim() < 4:
        return True
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    return not (x.is_contiguous(memory_format=fmt) and not x.is_contiguous())


def workspace(func, args, out) -> list[tuple[str, int, bool]]:
    if func is aten.convolution.default:
        x, w = args[0], args[1]
        transposed, groups = args[6], args[8]
        if x.dim() < 4 or groups != 1 or (w.shape[0] if transposed else w.shape[1]) < 8 or not _layout_copies(x):
            return []
        return [("cudnn convolution workspace", _nbytes(x) + _nbytes(out) + _nbytes(w), True)]
    if func is aten.convolution_backward.default:
        grad_out, x, w = args[0], args[1], args[2]
        transposed, groups, mask = args[7], args[9], args[10]
        cin = w.shape[0] if transposed else w.shape[1]
        if x.dim() < 4 or groups != 1 or cin < 8 or not _layout_copies(x):
            return []
        base = _nbytes(x) + _nbytes(grad_out) + _nbytes(w)
        sizes = []
        if mask[0]:
            sizes.append(base)
        if mask[1]:
            sizes.append(base + max(_nbytes(x), _nbytes(grad_out)) // 2)
        return [("cudnn convolution backward workspace", max(sizes), True)] if sizes else []
    return []
