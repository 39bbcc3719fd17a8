"""Kernel probes never run full-size work (NOTE [ Probes never run full-size work ]).

The probe's own measurement (``_measure``) is replaced by a recorder with a known scratch law, so
the tests check what the probe *would run* and what it *concludes*, independently of this CPU.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.memory import workspaces
from memfit.memory.workspaces import KernelProbe, ProbeResult

aten = torch.ops.aten


@pytest.fixture
def recorder(monkeypatch):
    """_measure replaced: records the shapes it is asked to run; scratch = a bilinear law."""
    seen = []

    def fake_measure(func, args, kwargs):
        a, b = (args[1], args[2]) if func is aten.addmm.default else (args[0], args[1])
        m, k = a.shape[-2:]
        n = b.shape[-1]
        batch = a.shape[0] if a.dim() == 3 else 1
        seen.append((func, tuple(a.shape), tuple(b.shape), a.stride(), b.stride()))
        return ProbeResult(scratch_bytes=batch * (3 * m * k + 5 * k * n + 7 * m * n) + 4096, output_nbytes=())

    monkeypatch.setattr(workspaces, "_measure", fake_measure)
    monkeypatch.setattr(workspaces, "flop_budget", lambda func, dtype: 5e7)  # 50 MFLOP per probe
    return seen


def _probe(func, *shapes, transpose_b=False, dtype=torch.bfloat16):
    with FakeTensorMode():
        tensors = [torch.empty(s, dtype=dtype) for s in shapes]
        if transpose_b:
            tensors[-1] = torch.empty(tuple(reversed(shapes[-1])), dtype=dtype).t()
        out = func(*tensors)
    return KernelProbe()(func, tuple(tensors), {}, out), tensors


def test_a_large_matmul_is_probed_small_and_extrapolated_exactly(recorder):
    # 2048 x 4096 @ 4096 x 11008 is 185 GFLOP; one probe may run 50 MFLOP
    res, _ = _probe(aten.mm.default, (2048, 4096), (4096, 11008))
    assert res.scaled and not res.error
    assert 2 <= len(recorder) <= 8
    assert sum(2 * a[0] * a[1] * b[1] for _, a, b, _, _ in recorder) <= 5e7  # all probes together in budget
    m, k, n = 2048, 4096, 11008
    assert res.scratch_bytes == 3 * m * k + 5 * k * n + 7 * m * n + 4096  # multi-linear law: exact


def test_shrunk_operands_keep_their_layout(recorder):
    _probe(aten.mm.default, (2048, 4096), (4096, 4096), transpose_b=True)
    for _, _, b, _, b_stride in recorder:
        assert b_stride == (1, b[0])  # still a transposed (column-major) weight


def test_batched_and_bias_matmuls_are_extrapolated(recorder):
    res, _ = _probe(aten.bmm.default, (64, 1024, 128), (64, 128, 1024))
    assert res.scaled and res.scratch_bytes == 64 * (3 * 1024 * 128 + 5 * 128 * 1024 + 7 * 1024 * 1024) + 4096
    recorder.clear()
    res, _ = _probe(aten.addmm.default, (11008,), (2048, 4096), (4096, 11008))
    assert res.scaled and res.scratch_bytes == 3 * 2048 * 4096 + 5 * 4096 * 11008 + 7 * 2048 * 11008 + 4096
    assert all(len(a) == 2 for _, a, _, _, _ in recorder)


def test_a_cheap_matmul_is_probed_at_full_size(recorder):
    res, _ = _probe(aten.mm.default, (64, 64), (64, 64))
    assert not res.scaled and recorder[0][1:3] == ((64, 64), (64, 64))


def test_a_kernel_missing_on_this_cpu_is_reported_not_raised(monkeypatch):
    def broken(func, args, kwargs):
        raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive. "
                           "Run workload with ONEDNN_VERBOSE=all")
    monkeypatch.setattr(workspaces, "_measure", broken)
    res, _ = _probe(aten.mm.default, (8, 8), (8, 8))
    assert res.error == "could not create a primitive descriptor for the LSTM forward propagation primitive"


def test_real_probes_of_a_7b_sized_matmul_run_small(monkeypatch):
    """With this CPU's own budget (native or emulated bf16), a 7B-sized matmul is never run whole."""
    shapes = []
    real = workspaces._measure
    monkeypatch.setattr(workspaces, "_measure", lambda f, a, k: shapes.append(a[0].shape) or real(f, a, k))
    res, _ = _probe(aten.mm.default, (2048, 4096), (4096, 11008))
    assert res is not None and res.scaled and all(s[0] < 2048 for s in shapes)


def test_convolutions_shrink_their_batch_and_tiny_ones_run_whole(monkeypatch):
    seen = []

    def fake_measure(func, args, kwargs):
        seen.append(args[0].shape[0])
        return ProbeResult(scratch_bytes=1000 * args[0].shape[0] + 77, output_nbytes=())

    monkeypatch.setattr(workspaces, "_measure", fake_measure)
    monkeypatch.setattr(workspaces, "flop_budget", lambda func, dtype: 1e9)

    def conv(n):
        with FakeTensorMode():
            args = (torch.empty(n, 64, 56, 56), torch.empty(64, 64, 3, 3), None, [1, 1], [1, 1], [1, 1], False,
                    [0, 0], 1)
            out = aten.convolution.default(*args)
        return KernelProbe()(aten.convolution.default, args, {}, out)

    res = conv(64)  # 64 x 0.23 GFLOP = 14.8 GFLOP: probed at batches 1 and 2, extrapolated to 64
    assert res.scaled and res.scratch_bytes == 1000 * 64 + 77 and sorted(seen) == [1, 2]
    seen.clear()
    monkeypatch.setattr(workspaces, "flop_budget", lambda func, dtype: 1e8)
    res = conv(1)  # 0.23 GFLOP: cannot shrink, cheap enough (<= 4 x its budget) to run whole
    assert not res.scaled and seen == [1] and res.scratch_bytes == 1077
