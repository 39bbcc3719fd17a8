"""The twin-model task the optimizer twin tests share (tests/unit/techniques/test_twin_optimizers_*.py):
a student MLP fitting a fixed random teacher, AdamW's hyper-parameters, gradient accumulation, and
memfit's step run with a cosine schedule with warmup."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from helpers import cosine_with_warmup
from memfit.plans import Plan
from memfit.step import build_step
from memfit.workload import Workload

HP = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
IN, HIDDEN, OUT = 64, 256, 64  # weights of 16384 elements: quantized states; two projected 256 x 64 and 64 x 256
MICRO, ACCUM = 8, 4


def student() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))


def teacher_batches(steps: int, teacher_hidden: int):
    """``steps`` batches of ``ACCUM * MICRO`` inputs and a fixed teacher's outputs."""
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(IN, teacher_hidden), nn.Tanh(), nn.Linear(teacher_hidden, OUT)).requires_grad_(False)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(ACCUM * MICRO, IN, generator=g) for _ in range(steps)]
    return [(x, teacher(x)) for x in xs]


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def workload(init: nn.Module, batches) -> Workload:
    return Workload(model=lambda: copy.deepcopy(init), batch=lambda n: batches[0], loss=mse,
                    optimizer=lambda ps: torch.optim.AdamW(ps, **HP))


def step_losses(plan: Plan, init: nn.Module, batches) -> list[float]:
    """Per-step loss of memfit's step with ``plan`` (micro-batches of ``MICRO``), cosine schedule."""
    step = build_step(workload(init, batches), plan, ACCUM * MICRO, "cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(step.optimizer, cosine_with_warmup(len(batches)))
    out = []
    for batch in batches:
        out.append(float(step(batch)))
        sched.step()
    return out
