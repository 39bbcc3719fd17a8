"""cuDNN convolution workspace rules of the CUDA kernel model (memfit.memory.cuda.conv), as the
H200 allocator snapshots tests/data/snapshots/rsv-* show them, and the caching-allocator model
replaying a real trace."""

import torch

from memfit.memory.allocator import CachingAllocatorModel
from memfit.memory.cuda import conv

aten = torch.ops.aten


def _fwd(x, w, stride=(1, 1), padding=(0, 0)):
    out = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding)
    args = (x, w, None, list(stride), list(padding), [1, 1], False, [0, 0], 1)
    return conv.workspace(aten.convolution.default, args, out), out


def _bwd_args(x, w, out, stride=(1, 1), padding=(0, 0), mask=(True, True, False)):
    return (torch.empty_like(out), x, w, None, list(stride), list(padding), [1, 1], False, [0, 0], 1, list(mask))


def _nb(t):
    return t.numel() * t.element_size()


def test_kxk_convolution_workspace_is_the_layout_copies_in_every_pass():
    # unet 3x3, bf16: forward, backward-data and backward-weight workspaces = x + out + w (rsv-unet-bf16-blocks)
    x, w = torch.empty(2, 64, 16, 16, dtype=torch.bfloat16), torch.empty(64, 64, 3, 3, dtype=torch.bfloat16)
    ws, out = _fwd(x, w, padding=(1, 1))
    base = _nb(x) + _nb(out) + _nb(w)
    assert [n for _, n, _ in ws] == [base]
    args = _bwd_args(x, w, out, padding=(1, 1))
    assert [n for _, n, _ in conv.backward_workspace(0, args)] == [base]
    assert [n for _, n, _ in conv.backward_workspace(1, args)] == [base]
    assert conv.backward_workspace(2, args) == []  # the bias gradient is a reduction


def test_pointwise_convolution_is_a_gemm_without_layout_copies():
    x, w = torch.empty(2, 256, 32, 32, dtype=torch.bfloat16), torch.empty(64, 256, 1, 1, dtype=torch.bfloat16)
    ws, out = _fwd(x, w)
    assert ws == []
    args = _bwd_args(x, w, out)
    assert conv.backward_workspace(0, args) == []
    # backward-weight: split-K partial weight gradients in fp32
    assert [n for _, n, _ in conv.backward_workspace(1, args)] == [conv.SPLIT_K * w.numel() * 4]
    # a strided 1x1 convolution is not a plain GEMM: layout copies as for k x k
    ws, out = _fwd(x, w, stride=(2, 2))
    assert [n for _, n, _ in ws] == [_nb(x) + _nb(out) + _nb(w)]


def test_fp32_backward_weight_adds_a_split_k_buffer():
    x, w = torch.empty(2, 64, 16, 16), torch.empty(64, 64, 3, 3)
    _, out = _fwd(x, w, padding=(1, 1))
    args = _bwd_args(x, w, out, padding=(1, 1))
    base = _nb(x) + _nb(out) + _nb(w)
    assert [n for _, n, _ in conv.backward_workspace(1, args)] == [base + max(_nb(x), _nb(out)) // 2]


def test_convolution_backward_books_one_workspace_per_pass_in_cudnn_order():
    """grad_input, its workspace (freed), grad_weight, its workspace (freed): the order of
    cudnn_convolution_backward, which decides which cached blocks the allocator can reuse."""
    from memfit.devices import get_device
    from memfit.memory.cuda.model import KernelMode

    class Log(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is aten.convolution_backward.default:
                self.calls.append(("conv_bwd", tuple(args[10])))
            elif func is aten.empty.memory_format:
                self.calls.append(("ws", args[0][0]))
            return out

    x, w = torch.empty(2, 64, 16, 16, dtype=torch.bfloat16), torch.empty(64, 64, 3, 3, dtype=torch.bfloat16)
    out = torch.nn.functional.conv2d(x, w, padding=1)
    log = Log()
    with log, KernelMode(get_device("h100-80gb"), None):
        gi, gw, gb = aten.convolution_backward.default(*_bwd_args(x, w, out, padding=(1, 1), mask=(True, True, True)))
    assert gi.shape == x.shape and gw.shape == w.shape and gb.shape == (64,)
    base = _nb(x) + _nb(out) + _nb(w)
    assert log.calls == [("conv_bwd", (True, False, False)), ("ws", base),
                         ("conv_bwd", (False, True, False)), ("ws", base),
                         ("conv_bwd", (False, False, True))]


def test_allocator_model_replays_requests_as_the_caching_allocator_does():
    """Rules checked against a real trace: a 1.125 MiB request takes a 20 MiB large segment, a small
    one a 2 MiB segment, a 73.5 MiB request a segment rounded to 2 MiB; a freed block is reused."""
    m = CachingAllocatorModel()
    a = m.malloc(1179648)
    m.malloc(1536)
    big = m.malloc(77070336)
    assert m.reserved == (20 << 20) + (2 << 20) + (74 << 20)
    m.free(big)
    m.malloc(77070336 - 4096)
    assert m.reserved == (20 << 20) + (2 << 20) + (74 << 20)
    m.free(a)
    m.malloc(18 << 20)  # fits the free 20 MiB segment
    assert m.reserved == (20 << 20) + (2 << 20) + (74 << 20)
