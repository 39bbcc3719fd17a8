"""What every trainer integration shares: trainer settings <-> plan, planning for a budget, and
the predicted vs measured peak.

A trainer (Hugging Face's, Lightning's) arrives with settings of its own. Some are training
hyperparameters, not memory choices: gradient clipping, and the precision the user trains in.
They change the step's memory (clipping needs every gradient at once; autocast keeps 16-bit copies
of what backward saves), so a plan that ignored them would predict another run than the one that
trains. The core takes them from the trainer into the plan where the plan leaves them open (its
default, or ``precision: auto``) and refuses, in one line naming the argument to change, only a true
conflict: two different values, or a combination no step can run (clipping with the optimizer
stepped inside backward, which frees each gradient as soon as it is ready).

Each technique maps its own arguments, both ways: ``Config.export(into)`` (plan -> arguments) and
``Config.from_arguments(given)`` (arguments -> the config the trainer runs), with ``given`` an
:class:`~memfit.techniques.base.Export` holding the trainer's values. No table of arguments lives
here, and no technique is applied here: ``memfit.apply`` (``build_step``) applies every one.

Memory: the prediction is memfit's estimate of that same step on a fake copy of the model (no
memory), the measurement the trainer's steady-state step (the second on: the optimizer's states
appear during the first); :class:`PeakLog` holds both, gives the values the trainer logs and warns
once when the run exceeds the prediction by more than its tolerance.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from memfit.errors import UserError
from memfit.integrations.apply import estimate_applied, workload_of
from memfit.plans import BY_NAME, TECHNIQUES, Plan
from memfit.techniques.base import Config, Export
from memfit.units import fmt_bytes

PREDICTED, MEASURED, ERROR = "memfit/predicted_peak_bytes", "memfit/measured_peak_bytes", "memfit/error_percent"
TAKEN = ("precision", "max_grad_norm")
"""The techniques whose trainer settings are training hyperparameters: taken into the plan."""
CALLS = {"hf": "TrainingArguments", "lightning": "Trainer"}


# -- trainer settings <-> plan ----------------------------------------------------------------------
def trainer_configs(given: Export) -> dict[str, Config]:
    """Technique name -> the config the trainer's arguments run, for those they set."""
    found = {t.name: t.default.from_arguments(given) for t in TECHNIQUES}
    return {name: config for name, config in found.items() if config is not None}


def arguments_text(config: Config, trainer: str, given: Export | None = None) -> str:
    """``config``'s arguments for ``trainer`` ('hf', 'lightning') as ``key=value, ...`` (the values
    ``given`` holds for those keys, when given)."""
    into = Export(given.batch_size if given is not None else 1)
    config.export(into)
    values = getattr(into, trainer)
    if given is not None:
        values = {k: getattr(given, trainer).get(k, v) for k, v in values.items()}
    return ", ".join(f"{k}={v!r}" for k, v in values.items())


def take_arguments(plan: Plan, given: Export, trainer: str, *, who: str, device) -> Plan:
    """``plan`` with the trainer's hyperparameters (:data:`TAKEN`) where the plan leaves them open;
    a one-line UserError for a value the plan sets otherwise, or a combination the plan refuses."""
    call = CALLS[trainer]
    for name, theirs in trainer_configs(given).items():
        if name not in TAKEN:
            continue
        ours = plan.config(name)
        if ours.resolve(device) == theirs:
            continue
        shown = arguments_text(theirs, trainer, given)
        if not ours.is_default and ours.resolve(device) == ours:  # the plan sets its own value
            wanted = arguments_text(ours.resolve(device), trainer)
            fix = f"set {call}({wanted}) or remove it" if wanted else f"remove {call}({shown})"
            plan_says = "; ".join(f"{k}: {v}" for k, v in ours.values().items())
            raise UserError(f"{who}: {call}({shown}) but the plan runs {plan_says}; {fix}, or change the plan")
        try:
            plan = plan.with_config(theirs)
        except UserError as e:
            reason = str(e).removeprefix("plan: ").split("; ")[0]
            off = arguments_text(BY_NAME[name].default, trainer)
            fix = f"set {off} in {call}" if off else f"remove {call}({shown})"
            raise UserError(f"{who}: {call}({shown}) cannot run with this plan ({reason}); {fix} "
                            "or change the plan") from None
    return plan


def taken_values(given: Export) -> dict[str, Any]:
    """The plan values of the trainer's hyperparameters (the planner keeps them fixed)."""
    return {k: v for name, config in trainer_configs(given).items() if name in TAKEN
            for k, v in config.values().items()}


# -- planning for a budget --------------------------------------------------------------------------
def plan_for_budget(model: torch.nn.Module, budget, *, batch_size: int, example, loss_fn, optimizer_factory,
                    device: str, fixed: dict | None, who: str, hint: str) -> Plan:
    """The planner's fastest plan for ``budget`` on ``model`` and ``example`` batches, with ``fixed``
    plan values. The planner's real steps (CPU timings) run on copies: ``model`` is left untrained.
    ``hint``: what else the user may change when nothing fits."""
    from memfit.planner.search import plan as make_plan
    workload = workload_of(model, batch_size=batch_size, loss_fn=loss_fn, optimizer_factory=optimizer_factory,
                           example_batch=example, copies=True)
    found = make_plan(workload, budget=budget, batch_size=batch_size, device=device, fixed=fixed or None)
    if found.chosen is None:
        smallest = found.smallest
        needs = (f"; the smallest found needs {fmt_bytes(smallest.used_bytes)} ({smallest.plan.describe()})"
                 if smallest is not None else "")
        raise UserError(f"{who}: no plan fits the budget {budget}{needs}; give a larger budget or {hint}")
    return found.chosen.plan


# -- predicted vs measured --------------------------------------------------------------------------
class PeakLog:
    """memfit's predicted peak of the trainer's step and the last measured one: the values a trainer
    logs, and one warning when a measurement exceeds the prediction by more than ``tolerance``."""

    def __init__(self, who: str, tolerance: float):
        self.who, self.tolerance = who, tolerance
        self.report = None
        """The predicted MemoryReport (None before the prediction)."""
        self.predicted_peak_bytes: int | None = None
        self.measured_peak_bytes: int | None = None
        self.warned = False

    def predict(self, model: torch.nn.Module, plan: Plan, **step) -> None:
        """Estimate the step ``memfit.apply(model, plan, **step)`` builds, on a fake copy of ``model``."""
        self.report = estimate_applied(model, plan, **step)
        self.predicted_peak_bytes = self.report.measurable_peak_bytes

    def record(self, step: int, measured: int, plan: Plan) -> dict[str, float]:
        """Record step ``step``'s measured peak; returns the values to log."""
        predicted = self.predicted_peak_bytes
        self.measured_peak_bytes = measured
        over = measured - predicted
        if over > self.tolerance * predicted and not self.warned:
            self.warned = True
            warnings.warn(f"{self.who}: the measured peak of step {step}, {fmt_bytes(measured)}, exceeds the "
                          f"predicted {fmt_bytes(predicted)} by {100 * over / predicted:.1f}% (plan "
                          f"{plan.describe()})", stacklevel=3)
        return {PREDICTED: predicted, MEASURED: measured, ERROR: round(100.0 * -over / max(measured, 1), 3)}


def storage_bytes(*roots) -> int:
    """Bytes of the distinct storages of every tensor in ``roots`` (modules: parameters, their
    gradients and buffers; dicts, lists and tuples: their values)."""
    seen: dict[int, int] = {}

    def visit(x) -> None:
        if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes():
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, torch.nn.Module):
            for t in (*x.parameters(), *(p.grad for p in x.parameters()), *x.buffers()):
                visit(t)
        elif isinstance(x, (dict, list, tuple)):
            for v in x.values() if isinstance(x, dict) else x:
                visit(v)
    visit(roots)
    return sum(seen.values())


class StepOptimizer(torch.optim.Optimizer):
    """What a trainer (its lr scheduler, its checkpoints) sees as the optimizer of memfit's step:
    ``step()`` is the step's update (clipping, the loss scaler, EMA; when the plan steps in backward,
    only those: the parameters were stepped during backward), ``zero_grad()`` its zero_grad, param
    groups and state its optimizer's. Its state dict keeps the rest of the step's state (the EMA,
    the loss scaler) under ``memfit``."""

    def __init__(self, step):  # (no Optimizer.__init__: the param groups are the step's own)
        self.memfit_step = step

    param_groups = property(lambda self: self.memfit_step.optimizer.param_groups)
    defaults = property(lambda self: self.memfit_step.optimizer.defaults)
    state = property(lambda self: self.memfit_step.optimizer.state)

    def step(self, closure=None):
        result = closure() if closure is not None else None  # (a trainer's hooks before the update)
        self.memfit_step.update()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.memfit_step.zero_grad()

    def state_dict(self) -> dict:
        step = self.memfit_step
        return {**step.optimizer.state_dict(), "memfit": {"ema": step.ema.state_dict(),
                                                          "scaler": step.scaler.state_dict()}}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        extra = state.pop("memfit", None)
        step = self.memfit_step
        step.optimizer.load_state_dict(state)
        if extra is not None:
            step.ema.load_state_dict(extra["ema"])
            step.scaler.load_state_dict(extra["scaler"])
