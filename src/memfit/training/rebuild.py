"""Rebuilding a running step for another plan, keeping everything it has learned.

OOM adaptation changes the plan (smaller micro-batches, checkpointing, offload), and a plan is
applied in one place only: ``build_step``. So an adapted step is a new step, built from the
adapted plan exactly as a fresh run would build it, and the running one's state moves across
through the state dicts that checkpoints use (model, optimizer, grad scaler, EMA): the training
continues unchanged, and the step that runs is the step the estimate traced for that plan.

Memory: the old step is released before the new one is built. On a GPU its state is staged in
host memory first (a rebuild must not need two models' worth of device memory when memory has
just run out); on a CPU the state dicts keep the old tensors until they are loaded.
"""

from __future__ import annotations

import gc

import torch
from torch.utils._pytree import tree_map

from memfit.plans import Plan
from memfit.step import TrainStep, build_step
from memfit.training.checkpoint import load_step_state, step_state


def rebuild(step: TrainStep, plan: Plan, *, observer=None) -> TrainStep:
    """A new step for ``plan`` (same workload, batch and device) holding ``step``'s state; ``step``
    is released. ``observer`` watches the new step from its first phase."""
    target = step.target.with_plan(plan)
    state = step_state(step)
    if target.tensor_device == "cuda":
        state = tree_map(lambda x: x.to("cpu") if isinstance(x, torch.Tensor) and x.is_cuda else x, state)
    step.release()
    del step
    gc.collect()
    if target.tensor_device == "cuda":
        torch.cuda.empty_cache()
    new = build_step(target, observer=observer)
    load_step_state(new, state)
    return new
