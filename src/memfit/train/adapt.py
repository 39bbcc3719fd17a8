"""OOM adaptation: keep the training the same, use less memory, retry the same step.

Tools that halve the batch after an out-of-memory error change the effective batch and so the
training dynamics. memfit instead frees the failed step and splits the *same* batch into more,
smaller micro-batches with gradient accumulation: the same samples in the same order, the same
effective batch, the RNG state of the step restored. At micro-batch 1 it escalates: block
checkpointing, then activation offload. Every adaptation is logged with its cause.

An OOM inside the optimizer step is not retried: some parameters may already be updated, and a
retry would update them twice.
"""

from __future__ import annotations

import gc

import torch

from memfit.errors import UserError
from memfit.step import TrainStep
from memfit.techniques.checkpointing import CheckpointConfig, Checkpointing, find_blocks
from memfit.techniques.offload import OffloadActivations


def _smaller_micro_batch(step: TrainStep) -> int | None:
    if step.plan.optimizer_in_backward:
        return None  # in-backward steps cannot accumulate micro-batches
    m = step.micro_batch_size
    return next((d for d in range(m // 2, 0, -1) if step.batch_size % d == 0), None)


def adapt(step: TrainStep) -> str:
    """Change ``step`` in place to use less memory; returns what changed. Raises when out of options."""
    m = _smaller_micro_batch(step)
    if m is not None:
        step.plan = step.plan.replace(micro_batch_size=m, grad_accum_steps=1)
        step.micro_batch_size, step.num_micro_batches = step.plan.micro_batches(step.batch_size)
        return f"micro_batch_size {m} x {step.num_micro_batches} accumulation steps (same effective batch)"
    if step.plan.checkpointing == "none" and find_blocks(step.model):
        Checkpointing(CheckpointConfig("blocks")).apply(step.model)
        step.plan = step.plan.replace(checkpointing="blocks")
        return "checkpointing: blocks"
    if "activations" not in step.plan.offload:
        step.forward_contexts = (*step.forward_contexts, OffloadActivations(step.model, step.placement))
        step.plan = step.plan.replace(offload=[*step.plan.offload, "activations"])
        return "offload: activations"
    raise UserError("out of memory, and no adaptation is left (micro-batch 1, checkpointing, activation offload); "
                    "use a smaller model or batch, or a plan with less memory (memfit plan --budget ...)")


def free_failed_step(step: TrainStep) -> None:
    step.optimizer.zero_grad(set_to_none=True)
    for p in step.model.parameters():
        p.grad = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
