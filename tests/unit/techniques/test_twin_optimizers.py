"""Twin models: memfit's adamw8bit and bf16-pure steps against hand-written training loops.

As in torchao's optimizer tests, a reference model (``copy.deepcopy`` of the same initial weights)
is trained by a plain loop with an optimizer built by hand, side by side with memfit's step, for
several steps, with gradient accumulation (memfit: ``micro_batch_size=MICRO`` over a global batch of
``ACCUM * MICRO``; the reference: loss / ACCUM per micro-batch, accumulate, then step) and an LR
scheduler attached to both optimizers. Where the op order is identical the parameters must be
torch.equal every step; lossy variants are held to a stated bound against fp32 AdamW.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import accumulated_step
from memfit.plans import Plan
from memfit.step import build_step
from memfit.workload import Workload

HP = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
IN, HIDDEN, OUT = 64, 128, 8  # the first weight has 8192 elements: 8-bit states (min_8bit_size=4096)
MICRO, ACCUM, STEPS = 4, 4, 6


def _initial_model() -> nn.Module:
    """A 2-layer MLP whose weights are bf16 values, so fp32 and bf16 twins start from equal weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def _loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ACCUM * MICRO, IN, generator=g), torch.randn(ACCUM * MICRO, OUT, generator=g))
            for _ in range(steps)]


def _workload(init: nn.Module, lr: float) -> Workload:
    return Workload(model=lambda: copy.deepcopy(init), batch=lambda n: tuple(t[:n] for t in _batches(1)[0]),
                    loss=_loss,
                    optimizer=lambda ps: torch.optim.AdamW(ps, **{**HP, "lr": lr}))


def _warmup_then_decay(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.9**step


def _reference_step(model, optimizer, scheduler, batch) -> torch.Tensor:
    """The plain loop: zero, loss / ACCUM per micro-batch, backward (accumulates), step, schedule."""
    return accumulated_step(model, optimizer, scheduler, batch, _loss, ACCUM)


def _fp32_reference(init: nn.Module, lr: float, steps: int) -> list[list[torch.Tensor]]:
    """Parameters after each step of fp32 torch.optim.AdamW, LambdaLR, the same accumulation."""
    model = copy.deepcopy(init)
    opt = torch.optim.AdamW(model.parameters(), **{**HP, "lr": lr})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_then_decay)
    out = []
    for batch in _batches(steps):
        _reference_step(model, opt, sched, batch)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _snr_db(x: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Signal-to-noise ratio of ``x`` against ``ref`` in dB (torchao's measure): 10 log10(|ref|^2 / |x - ref|^2)."""
    signal = sum(r.double().pow(2).sum().item() for r in ref)
    noise = sum((a.double() - r.double()).pow(2).sum().item() for a, r in zip(x, ref))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def test_adamw8bit_is_bit_equal_to_bitsandbytes_with_accumulation_and_one_cycle():
    """optimizer: adamw8bit is bitsandbytes' AdamW8bit with the workload's lr/betas/eps/weight_decay and
    min_8bit_size=4096: every step's parameters and loss are torch.equal to a hand-built twin, under
    gradient accumulation and OneCycleLR (which cycles beta1 as well as the lr, so the per-group
    betas must be honoured). The 8192-element weight really has uint8 states; the smaller tensors fp32."""
    bnb = pytest.importorskip("bitsandbytes")
    init = _initial_model()
    step = build_step(_workload(init, HP["lr"]), Plan(optimizer="adamw8bit", micro_batch_size=MICRO),
                      ACCUM * MICRO, "cpu")
    ref = copy.deepcopy(init)
    ref_opt = bnb.optim.AdamW8bit(ref.parameters(), **HP, min_8bit_size=4096)

    def one_cycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=HP["lr"], total_steps=STEPS + 1)
    sched, ref_sched = one_cycle(step.optimizer), one_cycle(ref_opt)
    for i, batch in enumerate(_batches(STEPS)):
        loss = step(batch)
        sched.step()
        ref_loss = _reference_step(ref, ref_opt, ref_sched, batch)
        assert loss == float(ref_loss), f"step {i + 1}: loss"
        for (name, p), r in zip(step.model.named_parameters(), ref.parameters()):
            assert torch.equal(p, r), f"step {i + 1}: {name} differs"
        group, ref_group = step.optimizer.param_groups[0], ref_opt.param_groups[0]
        assert (group["lr"], group["betas"]) == (ref_group["lr"], ref_group["betas"])
    assert {p.shape for p in step.optimizer.state if p.numel() >= 4096} == {(HIDDEN, IN)}
    for p in step.model.parameters():
        dtypes = {v.dtype for v in step.optimizer.state[p].values() if torch.is_tensor(v) and v.numel() == p.numel()}
        assert dtypes == ({torch.uint8} if p.numel() >= 4096 else {torch.float32}), (tuple(p.shape), dtypes)


def test_adamw8bit_tracks_fp32_adamw_within_a_bound():
    """Lossy, against fp32 torch.optim.AdamW (same accumulation and LambdaLR, STEPS steps): the
    parameters keep an SNR >= 50 dB (measured ~69 dB). The 8-bit states show in the update of the
    8192-element weight: its SNR is between 25 and 60 dB (measured ~37 dB; an fp32 fallback would be
    bit-equal, infinite dB), while the small tensors, on 32-bit states, differ only by op order
    (>= 70 dB; measured 82-97 dB)."""
    pytest.importorskip("bitsandbytes")
    init = _initial_model()
    ref = _fp32_reference(init, HP["lr"], STEPS)
    step = build_step(_workload(init, HP["lr"]), Plan(optimizer="adamw8bit", micro_batch_size=MICRO),
                      ACCUM * MICRO, "cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(step.optimizer, _warmup_then_decay)
    for batch in _batches(STEPS):
        step(batch)
        sched.step()
    params, start = [p.detach() for p in step.model.parameters()], list(init.parameters())
    assert _snr_db(params, ref[-1]) >= 50
    for p, r, p0 in zip(params, ref[-1], start):
        update_snr = _snr_db([p - p0], [r - p0])
        assert 25 <= update_snr <= 60 if p.numel() >= 4096 else update_snr >= 70, (tuple(p.shape), update_snr)


def test_bf16_pure_nearest_is_bit_equal_to_a_bf16_model_with_torch_adamw():
    """precision: bf16-pure (bf16_update: nearest) is the model cast to bf16 with the workload's own
    torch.optim.AdamW on the bf16 parameters (bf16 states) and float inputs cast to bf16: every
    step's bf16 parameters and loss are torch.equal to that twin, with accumulation and LambdaLR."""
    init = _initial_model()
    step = build_step(_workload(init, HP["lr"]), Plan(precision="bf16-pure", micro_batch_size=MICRO),
                      ACCUM * MICRO, "cpu")
    ref = copy.deepcopy(init).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(step.optimizer, _warmup_then_decay)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _warmup_then_decay)
    for i, batch in enumerate(_batches(STEPS)):
        loss = step(batch)
        sched.step()
        ref_loss = _reference_step(ref, ref_opt, ref_sched, tuple(t.bfloat16() for t in batch))
        assert loss == float(ref_loss), f"step {i + 1}: loss"
        for (name, p), r in zip(step.model.named_parameters(), ref.parameters()):
            assert p.dtype == torch.bfloat16 and torch.equal(p, r), f"step {i + 1}: {name} differs"
    for p in step.model.parameters():
        assert {v.dtype for v in step.optimizer.state[p].values() if v.numel() == p.numel()} == {torch.bfloat16}


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_bf16_update_keeps_the_small_updates_nearest_rounding_loses(rounding):
    """Lossy, against fp32 AdamW (same initial weights, accumulation and LambdaLR, 10 steps at lr 1e-4,
    where most updates are below half a bf16 ulp of the weight). Retained fraction of the fp32 update,
    <delta, delta_ref> / |delta_ref|^2 of (weights - initial weights): nearest keeps < 0.5 of it
    (measured 0.16: most updates round away), kahan and stochastic keep it within 10% (measured 1.02
    and 0.99 +- 0.015 over seeds). The parameters stay within SNR >= 40 dB of fp32 (measured ~56 and
    ~48 dB; nearest ~51 dB: the parameter SNR alone cannot tell the variants apart). Kahan keeps one
    more bf16 buffer per parameter (its compensation) than nearest and stochastic."""
    lr, steps = 1e-4, 10
    init = _initial_model()
    ref = _fp32_reference(init, lr, steps)[-1]
    start = list(init.parameters())

    def retained(plan: Plan) -> tuple[float, list[torch.Tensor], torch.optim.Optimizer]:
        torch.manual_seed(0)  # stochastic rounding draws from the global generator
        step = build_step(_workload(init, lr), plan, ACCUM * MICRO, "cpu")
        sched = torch.optim.lr_scheduler.LambdaLR(step.optimizer, _warmup_then_decay)
        for batch in _batches(steps):
            step(batch)
            sched.step()
        params = [p.detach().float() for p in step.model.parameters()]
        deltas, ref_deltas = [p - p0 for p, p0 in zip(params, start)], [r - p0 for r, p0 in zip(ref, start)]
        kept = sum((d * r).sum().item() for d, r in zip(deltas, ref_deltas)) / sum(r.pow(2).sum().item() for r in ref_deltas)
        return kept, params, step.optimizer

    nearest, _, _ = retained(Plan(precision="bf16-pure", micro_batch_size=MICRO))
    kept, params, opt = retained(Plan(precision="bf16-pure", bf16_update=rounding, micro_batch_size=MICRO))
    assert nearest < 0.5, nearest
    assert abs(kept - 1) < 0.1, (rounding, kept)
    assert _snr_db(params, ref) >= 40
    for p in opt.param_groups[0]["params"]:
        buffers = [v for v in opt.state[p].values() if torch.is_tensor(v) and v.shape == p.shape]
        assert [b.dtype for b in buffers] == [torch.bfloat16] * (3 if rounding == "kahan" else 2)


def _grouped(ps):
    """A workload optimizer with two param groups, as fine-tuning recipes build them: weight decay
    on the matrices, none on biases, and a smaller lr for the biases."""
    ps = list(ps)
    return [{"params": [p for p in ps if p.dim() > 1]},
            {"params": [p for p in ps if p.dim() <= 1], "weight_decay": 0.0, "lr": HP["lr"] / 10}]


def test_adamw8bit_keeps_the_workloads_param_groups():
    """The 8-bit AdamW gets the workload's own groups (per-group weight decay and lr), bit-equal to
    bitsandbytes' AdamW8bit built by hand over the same groups."""
    bnb = pytest.importorskip("bitsandbytes")
    init = _initial_model()
    wl = Workload(model=lambda: copy.deepcopy(init), batch=lambda n: tuple(t[:n] for t in _batches(1)[0]),
                  loss=_loss, optimizer=lambda ps: torch.optim.AdamW(_grouped(ps), **HP))
    step = build_step(wl, Plan(optimizer="adamw8bit"), ACCUM * MICRO, "cpu")
    assert [(g["weight_decay"], g["lr"]) for g in step.optimizer.param_groups] == [(0.1, 1e-3), (0.0, 1e-4)]
    ref = copy.deepcopy(init)
    opt = bnb.optim.AdamW8bit(_grouped(ref.parameters()), **HP, min_8bit_size=4096)
    for batch in _batches(3):
        step(batch)
        opt.zero_grad(set_to_none=True)
        _loss(ref, batch).backward()
        opt.step()
        for a, b in zip(step.model.parameters(), ref.parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(_grouped(ps), lr=1e-2, weight_decay=0.1),  # no momentum: none added
    lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1),           # coupled L2, not AdamW's decay
], ids=["sgd-without-momentum", "adam-l2"])
def test_compensated_bf16_updates_keep_the_workloads_optimizer(make):
    """bf16_update stochastic/kahan computes the workload's own update in fp32: SGD without momentum
    keeps no momentum buffer and matches plain SGD; Adam's weight decay is an L2 term in the
    gradient. Against the same optimizer on an fp32 twin the bf16 weights stay within bf16's
    rounding (Kahan carries what rounding lost), while a momentum or decoupled decay would not."""
    init = _initial_model()
    wl = Workload(model=lambda: copy.deepcopy(init), batch=lambda n: tuple(t[:n] for t in _batches(1)[0]),
                  loss=_loss, optimizer=make)
    step = build_step(wl, Plan(precision="bf16-pure", bf16_update="kahan"), ACCUM * MICRO, "cpu")
    ref = copy.deepcopy(init)
    opt = make(ref.parameters())
    for batch in _batches(5):
        step((batch[0].bfloat16(), batch[1].bfloat16()))
        opt.zero_grad(set_to_none=True)
        _loss(ref, (batch[0].bfloat16().float(), batch[1].bfloat16().float())).backward()
        opt.step()
    states = {k for s in step.optimizer.state.values() for k in s}
    assert "momentum_buffer" not in states
    for a, b in zip(step.model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-3)
