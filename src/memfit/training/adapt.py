"""OOM adaptation: keep the training the same, use less memory, retry the same step.

Tools that halve the batch after an out-of-memory error change the effective batch and so the
training dynamics. memfit instead frees the failed step and *re-plans*: the same batch split into
more, smaller micro-batches with gradient accumulation (the same samples in the same order, the
same effective batch), and at micro-batch 1 more frugal techniques. Which technique to turn to,
and in what order, the techniques say themselves (``Config.escalation``, ``Config.frugal``):
micro-batches first, then block checkpointing, then activation offload; a compiled plan first
lowers its activation memory budget (``checkpointing: budget:F``, see
memfit.techniques.checkpointing), then splits the batch. The adapted plan is a new
step built by ``build_step``, the one path that applies techniques, with the model, optimizer,
scaler and EMA moved across through the state dicts checkpoints use (memfit.training.rebuild).
The RNG state of the step is restored and the same batch retried. Every adaptation is logged
with its cause.

An OOM inside the optimizer step is not retried: some parameters may already be updated, and a
retry would update them twice."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import torch

from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate_target
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.step import TrainStep
from memfit.target import Target
from memfit.techniques.base import AdaptContext
from memfit.training.rebuild import rebuild

Fits = Callable[[Plan], bool]


def adapt(plan: Plan, batch_size: int, model: torch.nn.Module, fits: Fits | None = None,
          coupled_samples: str | None = None) -> tuple[Plan, str]:
    """A plan that uses less memory than ``plan``, and what changed. Raises when out of options.

    ``fits(plan)``: whether the estimate predicts ``plan`` fits. With it, the micro-batch (or a
    compiled plan's activation budget) goes straight to the largest predicted to fit instead of
    stepping down one OOM at a time. ``coupled_samples``: why the step's samples depend on each other
    (the workload's), when they do: the batch is then not re-split."""
    # (the samples one step runs: a rank's share of the global batch when sharded)
    ctx = AdaptContext(plan=plan, batch_size=plan.config("shard").rank_batch(batch_size), model=model, fits=fits,
                       coupled_samples=coupled_samples)
    order = [(c.escalation(ctx), i, c) for i, c in enumerate(plan.techniques)]
    for _, _, current in sorted(o for o in order if o[0] is not None):
        step = current.frugal(ctx)
        if step is None:
            continue
        config, change = step
        try:
            return plan.with_config(config), change
        except UserError:  # not with the plan's other techniques
            continue
    raise OutOfAdaptations(plan)


class OutOfAdaptations(UserError):
    """Out of memory with every adaptation applied; ``plan`` is the most frugal plan reached."""

    def __init__(self, plan):
        super().__init__("out of memory, and no adaptation is left (micro-batch 1, checkpointing, activation "
                         "offload); use a smaller model or batch, or a plan with less memory (memfit plan --budget)")
        self.plan = plan

    def __reduce__(self):  # (rank 0 sends it to the other ranks)
        return OutOfAdaptations, (self.plan,)


def free_failed_step(step: TrainStep) -> None:
    step.optimizer.zero_grad(set_to_none=True)
    for p in step.model.parameters():
        p.grad = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class FitPredictor:
    """``fits(plan)``: does the estimate predict that ``plan`` fits under the run's enforcement
    (:meth:`memfit.memory.budget.Budget.enforced_fits`: the guard's device bytes on a CPU, the
    allocator's reserved bytes on a GPU)? Each plan is traced once on fake tensors (seconds).
    ``paused()`` returns a context manager the trace runs in (the CPU guard must not count it).
    While ``blocked()`` (a profiler is measuring) nothing new is traced and unknown plans count as
    fitting, which makes :func:`adapt` halve the micro-batch as it would without predictions."""

    def __init__(self, target: Target, budget: Budget, *, paused=None, blocked: Callable[[], bool] = lambda: False):
        self.target, self.budget = target, budget
        self.paused, self.blocked = paused, blocked
        self.cache: dict = {}

    def __call__(self, plan: Plan) -> bool:
        if plan not in self.cache:
            if self.blocked():
                return True
            self.cache[plan] = self._trace(plan)
        return self.cache[plan]

    def precompute(self, plan: Plan, model: torch.nn.Module) -> None:
        """Trace the remedy :func:`adapt` would turn to first for ``plan`` (e.g. the micro-batch sizes
        below ``plan``'s, largest first, up to the first that fits); ``model``: its structure."""
        with contextlib.suppress(OutOfAdaptations):
            adapt(plan, self.target.batch_size, model, self, self.target.workload.info.coupled_samples)

    def _trace(self, plan: Plan) -> bool:
        with (self.paused() if self.paused is not None else contextlib.nullcontext()), silenced_warnings():
            try:
                report = estimate_target(self.target.with_plan(plan))
            except UserError:
                return False
        return self.budget.enforced_fits(report)


# NOTE [ Recover outside the except block ]
# While Python handles an exception, its traceback holds the frames of the failed step and so every
# activation they reference; freeing memory there frees nothing. :func:`run_adapting` leaves the
# ``except`` block first, then frees and adapts.
def run_adapting(step: TrainStep, batch, on_adapt: Callable[[dict], None] | None = None,
                 fits: Fits | None = None, rebuild_step: Callable[[TrainStep, Plan], TrainStep] = rebuild,
                 decide: Callable[[Callable], tuple[Plan, str]] | None = None) -> tuple[float, TrainStep]:
    """``step(batch)``; on an out-of-memory error in zero_grad, forward or backward, free the failed
    step, :func:`adapt` the plan, rebuild the step for it (``rebuild_step``, by default
    :func:`memfit.training.rebuild.rebuild`), restore the step's RNG state and retry the same
    batch. Returns the loss and the step that ran it (a new one after an adaptation).
    ``on_adapt`` gets a record ``{"phase", "cause", "adaptation"}`` for each adaptation.
    ``decide(choose)``: where the choice is made (several ranks: rank 0 runs ``choose``, every rank
    gets its plan, so all rebuild the same step; an OOM on one rank only is not agreed on, and the
    other ranks wait in their next collective until the process group's timeout)."""
    rng = _rng_state()
    while True:
        try:
            return step(batch), step
        except torch.OutOfMemoryError as e:
            phase, cause = step.phase, (str(e).splitlines() or ["out of memory"])[0][:300]
        # (outside the except block: see NOTE [ Recover outside the except block ])
        if phase == "optimizer":
            raise UserError("out of memory inside the optimizer step, which cannot be retried safely; use a plan "
                            "with less optimizer memory (e.g. --optimizer adamw8bit or --offload optimizer_states)")
        step.phase = "idle"
        free_failed_step(step)
        def choose(step=step):
            return adapt(step.plan, step.batch_size, step.model, fits, step.target.workload.info.coupled_samples)
        plan, change = decide(choose) if decide is not None else choose()
        step = rebuild_step(step, plan)
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
