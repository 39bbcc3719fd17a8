"""Twin models: memfit's paged AdamW against bitsandbytes' optimizers built by hand.

On a CPU bitsandbytes' paged optimizers keep plain tensors (nothing is paged), and run the same
update as their non-paged counterparts: ``adamw8bit-paged`` is ``AdamW8bit``, ``adamw-paged`` is
``AdamW`` (``optim_bits=32``), and both are their own ``Paged*`` classes. A reference model
(``copy.deepcopy`` of the same initial weights) trains in a plain loop beside memfit's step, with
gradient accumulation and OneCycleLR (which cycles beta1 too): every step's parameters and loss
must be torch.equal.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import accumulated_step
from memfit.plans import Plan
from memfit.step import build_step
from memfit.workload import Workload

bnb = pytest.importorskip("bitsandbytes")

HP = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
IN, HIDDEN, OUT = 64, 2048, 8  # the first weight has 131072 elements: paged on a GPU, 8-bit states
MICRO, ACCUM, STEPS = 4, 4, 5


def _initial_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ACCUM * MICRO, IN, generator=g), torch.randn(ACCUM * MICRO, OUT, generator=g))
            for _ in range(steps)]


def _workload(init: nn.Module) -> Workload:
    return Workload(model=lambda: copy.deepcopy(init), batch=lambda n: _batches(1)[0], loss=_loss,
                    optimizer=lambda ps: torch.optim.AdamW(ps, **HP))


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=HP["lr"], total_steps=STEPS + 1)


def _reference_step(model, optimizer, scheduler, batch) -> torch.Tensor:
    return accumulated_step(model, optimizer, scheduler, batch, _loss, ACCUM)


REFERENCES = {
    "adamw8bit-paged": [lambda ps: bnb.optim.AdamW8bit(ps, **HP, min_8bit_size=4096),
                        lambda ps: bnb.optim.PagedAdamW8bit(ps, **HP, min_8bit_size=4096)],
    "adamw-paged": [lambda ps: bnb.optim.AdamW(ps, **HP, optim_bits=32),
                    lambda ps: bnb.optim.PagedAdamW32bit(ps, **HP)],
}


@pytest.mark.parametrize("name,which", [(n, i) for n in REFERENCES for i in (0, 1)],
                         ids=["8bit-vs-AdamW8bit", "8bit-vs-PagedAdamW8bit", "32bit-vs-AdamW", "32bit-vs-PagedAdamW32bit"])
def test_paged_is_bit_equal_to_bitsandbytes_on_cpu(name, which):
    """Every step's parameters and loss torch.equal to the bitsandbytes optimizer built by hand with
    the workload's hyperparameters, under accumulation and OneCycleLR; the 131072-element weight has
    uint8 states with adamw8bit-paged, fp32 with adamw-paged."""
    init = _initial_model()
    step = build_step(_workload(init), Plan(optimizer=name, micro_batch_size=MICRO), ACCUM * MICRO, "cpu")
    ref = copy.deepcopy(init)
    ref_opt = REFERENCES[name][which](ref.parameters())
    sched, ref_sched = _one_cycle(step.optimizer), _one_cycle(ref_opt)
    for i, batch in enumerate(_batches(STEPS)):
        loss = step(batch)
        sched.step()
        ref_loss = _reference_step(ref, ref_opt, ref_sched, batch)
        assert loss == float(ref_loss), f"step {i + 1}: loss"
        for (n, p), r in zip(step.model.named_parameters(), ref.parameters()):
            assert torch.equal(p, r), f"step {i + 1}: {n} differs"
    big = step.model[0].weight
    assert step.optimizer.state[big]["state1"].dtype == (torch.uint8 if name == "adamw8bit-paged" else torch.float32)


def test_paged_8bit_in_backward_trains_exactly_as_after_backward():
    """torchtune steps PagedAdamW8bit in backward: one paged optimizer per parameter, the same
    blockwise update per tensor, so every step's parameters are torch.equal to the whole-model
    optimizer stepped after backward."""
    init = _initial_model()
    after = build_step(_workload(init), Plan(optimizer="adamw8bit-paged"), ACCUM * MICRO, "cpu")
    inbw = build_step(_workload(init), Plan(optimizer="adamw8bit-paged", optimizer_in_backward=True), ACCUM * MICRO, "cpu")
    for i, batch in enumerate(_batches(STEPS)):
        assert after(batch) == inbw(batch), f"step {i + 1}: loss"
        for (n, a), b in zip(after.model.named_parameters(), inbw.model.parameters()):
            assert torch.equal(a, b), f"step {i + 1}: {n} differs"
