"""Rule: cuDNN convolutions hold a workspace while they run.

``cudnn_convolution`` and its backward passes ask cuDNN's heuristics for an execution plan
(``torch.backends.cudnn.benchmark`` off: the first plan of the heuristic list) and allocate the
plan's workspace from the caching allocator for the duration of the call
(aten/src/ATen/native/cudnn/Conv_v8.cpp ``run_conv_plan``). The plan depends on the cuDNN
version and the card, so its workspace cannot be derived from first principles. What the H100/H200
snapshots show (snap-cnn-fp32 and rsv-* in tests/data/snapshots: UNet, ResNet-50, ConvNeXt, ViT;
NCHW, TF32 allowed, cuDNN 9.19):

- order: ``cudnn_convolution_backward`` runs backward-data and backward-weight as two separate
  cuDNN calls, each allocating its output, then its own workspace, freeing the workspace before
  the next pass (grad_input, ws_data, grad_weight, ws_weight; the bias gradient is a reduction
  after both). The KernelMode books them in that order (memfit.memory.cuda.model);
- size, k x k convolutions: tensor-core plans work on NHWC copies, and the workspace is the size
  of the layout copies: input + output + weight bytes, for the forward, backward-data and
  backward-weight passes alike (exact to 16-147 bytes on 46 of 47 bf16 layers; fp32 forward and
  backward-weight plans sometimes add a split-K buffer of a few weight-sized fp32 copies, 0-30%
  more, which is not modelled);
- pointwise (1x1, stride 1, no padding) convolutions are a GEMM over the NCHW tensors as they are:
  no workspace for forward and backward-data (a few hundred bytes at most, on 24 of 27 layers),
  and backward-weight's split-K reduction holds 16 fp32 partial weight gradients (on 12 of 17
  layers; 12 to 64 on the others), or the layout copies where those are smaller;
- no workspace for a convolution with fewer than 8 input channels (the stem), whose plan is a
  direct kernel.

Channels-last inputs need no layout copies: their workspace is modelled as 0. This is a
calibrated model of cuDNN's choices on one card, not an exact rule; the report lists it.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
SPLIT_K = 16
"""fp32 partial weight gradients of a pointwise backward-weight's split-K reduction."""


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _layout_copies(x: torch.Tensor) -> bool:
    """Does cuDNN get this tensor in NCHW (needing an NHWC copy for tensor cores)?"""
    if x.dim() < 4:
        return True
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    return not (x.is_contiguous(memory_format=fmt) and not x.is_contiguous())


def _pointwise(w, stride, padding, dilation) -> bool:
    """A 1x1 convolution with stride 1 and no padding: a GEMM over the NCHW tensors as they are."""
    return (all(k == 1 for k in w.shape[2:]) and all(s == 1 for s in stride) and all(p == 0 for p in padding)
            and all(d == 1 for d in dilation))


def _uses_workspace(x, w, transposed, groups) -> bool:
    cin = w.shape[0] if transposed else w.shape[1]
    return x.dim() >= 4 and groups == 1 and cin >= 8 and _layout_copies(x)


def workspace(func, args, out) -> list[tuple[str, int, bool]]:
    """The workspace of a forward convolution (booked after its output)."""
    if func is aten.convolution.default:
        x, w = args[0], args[1]
        stride, padding, dilation, transposed, groups = args[3], args[4], args[5], args[6], args[8]
        if not _uses_workspace(x, w, transposed, groups) or _pointwise(w, stride, padding, dilation):
            return []
        return [("cudnn convolution workspace", _nbytes(x) + _nbytes(out) + _nbytes(w), True)]
    return []


def backward_workspace(which: int, args) -> list[tuple[str, int, bool]]:
    """The workspace of one pass of ``convolution_backward`` (``which``: 0 backward-data, 1
    backward-weight; the bias gradient is a reduction), booked right after that pass's output."""
    grad_out, x, w = args[0], args[1], args[2]
    stride, padding, dilation, transposed, groups = args[4], args[5], args[6], args[7], args[9]
    if which not in (0, 1) or not _uses_workspace(x, w, transposed, groups):
        return []
    if _pointwise(w, stride, padding, dilation):
        if which == 0:
            return []
        # split-K partials, unless the layout-copy plan (below) needs less
        return [("cudnn convolution backward-weight workspace",
                 min(SPLIT_K * w.numel() * 4, _nbytes(x) + _nbytes(grad_out) + _nbytes(w)), True)]
    what = "cudnn convolution backward-data workspace" if which == 0 else "cudnn convolution backward-weight workspace"
    base = _nbytes(x) + _nbytes(grad_out) + _nbytes(w)
    if which == 1 and x.dtype == torch.float32:
        # TF32 backward-weight plans add a split-K reduction buffer (snap-cnn-fp32: half the larger
        # of input and output, within 1%); half-precision plans mostly do not (rsv-* snapshots)
        base += max(_nbytes(x), _nbytes(grad_out)) // 2
    return [(what, base, True)]
