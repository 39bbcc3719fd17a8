"""OOM adaptation: keep the training the same, use less memory, retry the same step.

Tools that halve the batch after an out-of-memory error change the effective batch and so the
training dynamics. memfit instead frees the failed step and splits the *same* batch into more,
smaller micro-batches with gradient accumulation: the same samples in the same order, the same
effective batch, the RNG state of the step restored. At micro-batch 1 it escalates: block
checkpointing, then activation offload. Every adaptation is logged with its cause.

An OOM inside the optimizer step is not retried: some parameters may already be updated, and a
retry would update them twice.

NOTE [ Recover outside the except block ]: while Python handles an exception, its traceback holds
the frames of the failed step and so every activation they reference; freeing memory there frees
nothing. :func:`run_adapting` leaves the ``except`` block first, then frees and adapts.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from memfit.errors import UserError
from memfit.step import TrainStep
from memfit.techniques.checkpointing import CheckpointConfig, Checkpointing, find_blocks
from memfit.techniques.offload import OffloadActivations

Fits = Callable[[object], bool]


def _smaller_micro_batch(step: TrainStep, fits: Fits | None) -> tuple[int | None, bool]:
    """The next micro-batch size: the largest smaller one predicted to fit (``fits``), else half.
    Returns (size or None, whether it is predicted to fit)."""
    if step.plan.optimizer_in_backward:
        return None, False  # in-backward steps cannot accumulate micro-batches
    m = step.micro_batch_size
    smaller = [d for d in range(m // 2, 0, -1) if step.batch_size % d == 0]
    if not smaller:
        return None, False
    if fits is not None:
        for d in smaller:
            if fits(step.plan.replace(micro_batch_size=d, grad_accum_steps=1)):
                return d, True
        return smaller[-1], False
    return smaller[0], False


def adapt(step: TrainStep, fits: Fits | None = None) -> str:
    """Change ``step`` in place to use less memory; returns what changed. Raises when out of options.

    ``fits(plan)``: whether the estimate predicts ``plan`` fits. With it, the micro-batch goes
    straight to the largest size predicted to fit instead of halving one OOM at a time."""
    m, predicted = _smaller_micro_batch(step, fits)
    if m is not None:
        step.plan = step.plan.replace(micro_batch_size=m, grad_accum_steps=1)
        step.micro_batch_size, step.num_micro_batches = step.plan.micro_batches(step.batch_size)
        return (f"micro_batch_size {m} x {step.num_micro_batches} accumulation steps (same effective batch"
                + ("; the largest predicted to fit)" if predicted else ")"))
    if step.plan.checkpointing == "none" and find_blocks(step.model):
        Checkpointing(CheckpointConfig("blocks")).apply(step.model)
        step.plan = step.plan.replace(checkpointing="blocks")
        return "checkpointing: blocks"
    if "activations" not in step.plan.offload:
        step.forward_contexts = (*step.forward_contexts, OffloadActivations(step.model, step.placement))
        step.plan = step.plan.replace(offload=[*step.plan.offload, "activations"])
        return "offload: activations"
    raise OutOfAdaptations(step.plan)


class OutOfAdaptations(UserError):
    """Out of memory with every adaptation applied; ``plan`` is the most frugal plan reached."""

    def __init__(self, plan):
        super().__init__("out of memory, and no adaptation is left (micro-batch 1, checkpointing, activation "
                         "offload); use a smaller model or batch, or a plan with less memory (memfit plan --budget)")
        self.plan = plan


def free_failed_step(step: TrainStep) -> None:
    step.optimizer.zero_grad(set_to_none=True)
    for p in step.model.parameters():
        p.grad = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class FitPredictor:
    """``fits(plan)``: does the estimate predict that ``plan`` fits? On a CPU: its device peak within
    the guard's budget; on a GPU: what the caching allocator reserves within the budget (the
    allocator's limit), or with the CUDA context within the card's memory. Each plan is traced once on fake tensors (seconds). While ``blocked()`` (a profiler is
    measuring) nothing new is traced and unknown plans count as fitting, which makes
    :func:`adapt` halve the micro-batch as it would without predictions."""

    def __init__(self, workload, batch_size: int, device, guard=None, budget_bytes: int | None = None,
                 blocked: Callable[[], bool] = lambda: False):
        self.workload, self.batch_size, self.device, self.guard = workload, batch_size, device, guard
        self.budget_bytes, self.blocked = budget_bytes, blocked
        self.cache: dict = {}

    def __call__(self, plan) -> bool:
        if plan not in self.cache:
            if self.blocked():
                return True
            self.cache[plan] = self._trace(plan)
        return self.cache[plan]

    def precompute(self, plan) -> None:
        """Trace the micro-batch sizes below ``plan``'s, largest first, up to the first that fits."""
        m, _ = plan.micro_batches(self.batch_size)
        for d in range(m // 2, 0, -1):
            if self.batch_size % d == 0 and self(plan.replace(micro_batch_size=d, grad_accum_steps=1)):
                return

    def _trace(self, plan) -> bool:
        import contextlib
        import warnings

        from memfit.memory.estimate import estimate
        with self.guard.paused() if self.guard is not None else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                r = estimate(self.workload, plan, batch_size=self.batch_size, device=self.device)
            except UserError:
                return False
        if self.guard is not None:
            return r.peak_bytes <= self.guard.budget_bytes
        if self.budget_bytes is not None:
            return r.reserved_bytes <= self.budget_bytes
        return bool(r.fits)


def run_adapting(step: TrainStep, batch, on_adapt: Callable[[dict], None] | None = None,
                 fits: Fits | None = None) -> float:
    """``step(batch)``; on an out-of-memory error in zero_grad, forward or backward, free the failed
    step, :func:`adapt`, restore the step's RNG state and retry the same batch. ``on_adapt`` gets a
    record ``{"phase", "cause", "adaptation"}`` for each adaptation."""
    rng = _rng_state()
    while True:
        try:
            return step(batch)
        except torch.OutOfMemoryError as e:
            phase, cause = step.phase, (str(e).splitlines() or ["out of memory"])[0][:300]
        # (outside the except block: see NOTE [ Recover outside the except block ])
        if phase == "optimizer":
            raise UserError("out of memory inside the optimizer step, which cannot be retried safely; use a plan "
                            "with less optimizer memory (e.g. --optimizer adamw8bit or --offload optimizer_states)")
        step.phase = "idle"
        free_failed_step(step)
        change = adapt(step, fits)
        _set_rng_state(rng)
        if on_adapt is not None:
            on_adapt({"phase": phase, "cause": cause, "adaptation": change})


def _rng_state():
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
