"""Hand-written Triton kernels in a fake trace (NOTE [ Triton kernels on fake tensors ]).

An op written as flash-linear-attention's and Liger's are (an autograd.Function whose Python allocates
its outputs and saved tensors, then launches Triton kernels into them, one of them autotuned) cannot
run on this CPU, and its launch cannot run on fake tensors. Its prediction must be its allocations:
equal to the profiler's measured peak of a twin op that allocates the same tensors and writes them
with torch (``out=``) instead of a launch.
"""

import pytest
import torch
import triton
import triton.language as tl
from torch import nn

from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.memory.triton_launches import SKIPPED
from memfit.plans import Plan
from memfit.workload import Workload
from memfit.workloads.checks import blamed


@triton.jit
def _doubled(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=inside) * 2, mask=inside)


@triton.heuristics({"EVEN": lambda args: args["n"] % args["BLOCK"] == 0})
@triton.autotune(configs=[triton.Config({"BLOCK": 128}), triton.Config({"BLOCK": 256})], key=["n"])
@triton.jit
def _doubled_tuned(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=inside) * 2, mask=inside)


class _Doubled(torch.autograd.Function):
    """x * 2, keeping for backward a workspace 4x its input (as a chunked kernel keeps its chunk states)."""

    @staticmethod
    def forward(ctx, x, launch):
        out = torch.empty_like(x)
        kept = torch.empty((4, *x.shape), dtype=x.dtype, device=x.device)
        if launch:
            _doubled[(triton.cdiv(x.numel(), 128),)](x, out, x.numel(), BLOCK=128)
        else:
            torch.mul(x, 2, out=out)
        ctx.save_for_backward(kept)
        ctx.launch = launch
        return out

    @staticmethod
    def backward(ctx, grad):
        (kept,) = ctx.saved_tensors
        grad_in = torch.empty_like(grad)
        if ctx.launch:
            _doubled_tuned[lambda meta: (triton.cdiv(grad.numel(), meta["BLOCK"]),)](grad, grad_in, grad.numel())
        else:
            torch.mul(grad, 2, out=grad_in)
        return grad_in, None


class _Net(nn.Module):
    def __init__(self, launch: bool):
        super().__init__()
        self.launch = launch
        self.up, self.down = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x):
        return self.down(_Doubled.apply(self.up(x), self.launch))


def _workload(launch: bool) -> Workload:
    return Workload(model=lambda: _Net(launch), batch=lambda n: torch.randn(n, 256),
                    loss=lambda m, b: m(b).square().mean(), default_batch_size=64,
                    name="triton-op" if launch else "torch-twin")


@pytest.mark.parametrize("device", ["cpu", "rtx4090"])
def test_a_triton_op_is_predicted_as_its_allocations(device):
    predicted = estimate(_workload(launch=True), Plan(), batch_size=64, device=device)
    assert predicted.method == "fake"
    skipped = [a for a in predicted.approximations if SKIPPED in str(a)]
    assert len(skipped) == 1 and "at test_triton_launches (x4)" in str(skipped[0]), predicted.approximations
    twin = estimate(_workload(launch=False), Plan(), batch_size=64, device=device)
    assert predicted.peak_bytes == twin.peak_bytes
    if device == "cpu":  # (the twin runs for real here; the Triton op cannot: no GPU)
        measured = profile(_workload(launch=False), Plan(), batch_size=64, repeats=0)
        # (within 0.1%: the twin's own prediction misses the real run by a scalar's bytes, as every CPU step's)
        assert abs(predicted.peak_bytes - measured.measured.peak_bytes) <= measured.measured.peak_bytes / 1000
        assert measured.measured.peak_bytes > 64 * 1024 * 4 * 5  # (the kept workspace and output at the peak)


def test_a_launch_with_real_tensors_still_launches():
    """Outside a fake trace nothing is skipped: Triton itself answers (no GPU here: no driver). A model folder's
    step that launches one on this machine (``memfit profile --device cpu`` of a Qwen3.5 with fla installed) is
    one line naming the kernel's package, not a fault of its config.json."""
    x = torch.randn(8)
    with pytest.raises(RuntimeError, match="active drivers"):
        _doubled[(1,)](x, torch.empty_like(x), 8, BLOCK=128)
    step = blamed("model folder ./m", "fix its config.json", "loss(model, batch)", _workload(launch=True).loss)
    with pytest.raises(UserError, match=r"^model folder ./m: loss\(model, batch\) launched a Triton kernel of "
                                        r"test_triton_launches, which needs a GPU \(.*`memfit estimate` predicts it"):
        step(_Net(launch=True), torch.randn(4, 256))
