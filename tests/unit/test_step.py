"""TrainStep: micro-batching keeps gradients, precision bounds, loss checks."""

import copy

import pytest
import torch
from torch import nn

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.plans import Plan
from memfit.step import build_step, split_batch
from memfit.workload import Workload


def _workload(dropout=0.0):
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 4))

    def batch(n):
        g = torch.Generator().manual_seed(1)
        return {"x": torch.randn(n, 16, generator=g), "y": torch.randint(0, 4, (n,), generator=g)}
    return Workload(model=model, batch=batch,
                    loss=lambda m, b: nn.functional.cross_entropy(m(b["x"]), b["y"]),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), default_batch_size=8)


def _grads_after_backward(plan):
    wl = _workload()
    step = build_step(wl, plan, 8, "cpu")
    captured = {}
    orig = step.optimizer.step

    def capture(*a, **k):
        captured.update({n: p.grad.clone() for n, p in step.model.named_parameters()})
        return orig(*a, **k)
    step.optimizer.step = capture
    loss = step(wl.batch(8))
    return loss, captured


def test_micro_batching_gives_the_whole_batch_gradients():
    loss_full, g_full = _grads_after_backward(Plan())
    for plan in (Plan(micro_batch_size=2), Plan(grad_accum_steps=4), Plan(micro_batch_size=4)):
        loss, g = _grads_after_backward(plan)
        assert loss == pytest.approx(loss_full, rel=1e-6)
        for name in g_full:
            torch.testing.assert_close(g[name], g_full[name], rtol=1e-5, atol=1e-7)


def test_step_returns_float_and_trains():
    wl = _workload()
    step = build_step(wl, Plan(), 8, "cpu")
    batch = wl.batch(8)
    losses = [step(batch) for _ in range(20)]
    assert all(isinstance(x, float) for x in losses)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("precision,bound", [("bf16", 0.05), ("fp16", 0.01)])
def test_autocast_loss_curve_stays_close_to_fp32(precision, bound):
    """Lossy: the loss curve over 25 steps stays within a relative bound of fp32."""
    wl = _workload()
    curves = {}
    for p in ("fp32", precision):
        step = build_step(wl, Plan(precision=p), 8, "cpu")
        batch = wl.batch(8)
        curves[p] = torch.tensor([step(batch) for _ in range(25)])
    rel = ((curves[precision] - curves["fp32"]).abs() / curves["fp32"].abs()).max().item()
    assert rel < bound, rel


def test_fp16_uses_a_grad_scaler_and_bf16_pure_casts_weights():
    wl = _workload()
    fp16 = build_step(wl, Plan(precision="fp16"), 8, "cpu")
    assert isinstance(fp16.scaler, torch.amp.GradScaler)
    pure = build_step(wl, Plan(precision="bf16-pure"), 8, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in pure.model.parameters())
    auto = build_step(wl, Plan(precision="auto"), 8, get_device("cpu"))
    assert auto.precision.name == "bf16"


def test_precision_not_supported_by_device():
    with pytest.raises(UserError, match="no bf16"):
        build_step(_workload(), Plan(precision="bf16"), 8, "t4")


def test_loss_must_be_a_scalar_that_requires_grad():
    wl = _workload()
    for bad_loss, match in [(lambda m, b: m(b["x"]), "scalar"), (lambda m, b: m(b["x"]).sum().detach(), "grad"),
                            (lambda m, b: 1.0, "scalar tensor")]:
        w = copy.copy(wl)
        w.loss = bad_loss
        with pytest.raises(UserError, match=match):
            build_step(w, Plan(), 8, "cpu")(w.batch(8))


def test_split_batch():
    parts = split_batch({"x": torch.arange(8), "scale": 2.0, "c": torch.ones(3)}, 8, 4)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(p["scale"] == 2.0 and p["c"].shape == (3,) for p in parts)
    with pytest.raises(UserError, match="first dimension"):
        split_batch(torch.ones(3, 2), 8, 4)


def test_bf16_pure_builds_the_model_in_bf16():
    """An fp32 copy of the model never exists: model() itself sees bf16 as the default dtype, so a
    7B model does not take 26 GiB before its cast (the default dtype is restored afterwards)."""
    seen = []

    def model():
        m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        seen.append({p.dtype for p in m.parameters()})
        return m

    wl = Workload(model=model, batch=lambda n: torch.randn(n, 16), loss=lambda m, b: m(b).float().pow(2).mean())
    build_step(wl, Plan(precision="bf16-pure"), 2, "cpu")
    build_step(wl, Plan(precision="bf16"), 2, "cpu")
    assert seen == [{torch.bfloat16}, {torch.float32}] and torch.get_default_dtype() == torch.float32
