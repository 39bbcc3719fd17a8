"""memfit in a Lightning ``Trainer``: memfit's one step is the LightningModule's training step.

A plan's techniques are not all things Lightning's automatic optimization can express: it steps
one optimizer after backward (no optimizer in backward), calls the user's loss on whole logits (no
chunked loss), and accumulates over DataLoader batches rather than splitting one. So memfit does
not rebuild them in Lightning: the plan is applied through ``memfit.apply`` (the same ``build_step``
that estimate, profile and ``memfit train`` run) and the module trains with manual optimization::

    class LitGPT(MemfitModule, lightning.LightningModule):   # MemfitModule first
        def __init__(self):
            super().__init__()
            self.model = GPT2LMHeadModel(config)             # the network the plan applies to

        def memfit_optimizer(self, params):                  # optional (default AdamW lr=1e-4)
            return torch.optim.AdamW(params, lr=3e-4)

        def memfit_loss(self, model, batch):                 # optional (default model(**batch).loss)
            return model(**batch).loss

    trainer = lightning.Trainer(max_steps=1000, callbacks=[MemfitCallback(plan="plan.yaml")])

The contract: :class:`MemfitModule` supplies ``configure_model`` (the callback applies the plan
there), ``configure_optimizers`` (:class:`StepOptimizer`: Lightning counts and checkpoints memfit's
optimizer; its ``step()`` is memfit's update) and ``training_step`` (zero_grad, memfit's
``forward_backward``, the update; logs ``train_loss``). A subclass that defines ``configure_model``
or ``training_step`` calls ``super()``'s. The DataLoader gives the plan's whole batch: memfit
splits it into the plan's micro-batches and runs its precision, clipping and EMA itself, so the
Trainer must not do them too: ``accumulate_grad_batches`` stays 1. The Trainer's ``gradient_clip_val``
and ``precision`` are training hyperparameters: the plan takes them where it leaves them open
(``memfit.integrations.core``), and Lightning's precision plugin is replaced by the plain one
(memfit's step autocasts, converts and scales, and the plugin would do it again; its fp16 GradScaler
would unscale gradients it never scaled). A true conflict (another value in the plan, clipping with
the optimizer stepped in backward) is one line naming what to change, before the first step.

``MemfitCallback(budget="8GiB")`` plans instead: on the module's network and one batch drawn from
the train DataLoader (shapes only), with the Trainer's precision and clipping fixed in the plan.

Memory: the callback logs ``memfit/predicted_peak_bytes`` (estimated on a fake copy of the network
before the plan is applied) and ``memfit/measured_peak_bytes`` with ``pl_module.log``, so they reach
the user's loggers, and warns when a measurement exceeds the prediction by more than ``tolerance``.
What the measurement's window holds: NOTE [ What the window sees ].

Not covered: several devices (``Trainer(devices>1)``; memfit's sharded plans run with ``memfit
train --nproc N``), LR schedulers from ``configure_optimizers`` (step one on ``step.optimizer``
yourself), parameters of the LightningModule outside ``memfit_model()``.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations import core
from memfit.integrations.apply import apply, as_plan, hf_loss
from memfit.memory.categories import STEADY_STEP
from memfit.memory.measure import PeakWindow
from memfit.plans import Plan
from memfit.step import TrainStep
from memfit.techniques.base import Export
from memfit.workload import default_optimizer

MISSING = "lightning is not installed; pip install lightning (or memfit[lightning])"
LIGHTNING_DEFAULT_PRECISION = "32-true"


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        raise UserError(MISSING) from None
    return pl


class MemfitModule:
    """Mixin that makes memfit's step the training step: ``class M(MemfitModule, LightningModule)``."""

    def memfit_model(self) -> torch.nn.Module:
        """The network the plan applies to (default ``self.model``)."""
        model = getattr(self, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise UserError("MemfitModule: memfit applies the plan to the network in self.model; assign it in "
                            "__init__ or configure_model (before super().configure_model()), or override memfit_model()")
        return model

    def memfit_loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The loss of one (micro-)batch; default the model's own, ``model(**batch).loss``."""
        return hf_loss(model, batch)

    def memfit_optimizer(self, params) -> torch.optim.Optimizer:
        """The optimizer of the parameters the plan leaves trainable (default AdamW, lr 1e-4)."""
        return default_optimizer(params)

    @property
    def memfit_step(self) -> TrainStep:
        step = self.__dict__.get("_memfit_step")
        if step is None:
            raise UserError("MemfitModule: memfit's step is not built yet; it is built in configure_model by "
                            "MemfitCallback (add it to Trainer(callbacks=[...]))")
        return step

    def configure_model(self) -> None:
        if self.trainer.state.fn != "fit":  # (validate, test, predict: the network as it is)
            return
        callbacks = [c for c in self.trainer.callbacks if isinstance(c, MemfitCallback)]
        if len(callbacks) != 1:
            raise UserError(f"MemfitModule trains through memfit's step and needs one MemfitCallback in "
                            f"Trainer(callbacks=[...]), found {len(callbacks)}")
        callbacks[0].apply_to(self.trainer, self)

    def configure_optimizers(self):
        return core.StepOptimizer(self.memfit_step)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.memfit_step
        step.zero_grad()
        loss = step.forward_backward(batch)
        self.optimizers().step()  # memfit's update (core.StepOptimizer); Lightning counts the step
        self.log("train_loss", loss, prog_bar=True)
        return loss


_CLASS: list[type] = []


class MemfitCallback:
    """``lightning.Trainer(callbacks=[MemfitCallback(plan=...)])`` (or ``budget=``): applies the plan
    to a :class:`MemfitModule` through memfit's step and logs predicted vs measured peak memory.

    ``plan``: a Plan, a plan file or a dict of plan keys. ``budget``: ``"8GiB"``, ``"80%"`` or bytes,
    planned on the module's network and first batch. ``tolerance``: the fraction by which a
    measured peak may exceed the prediction before the callback warns.
    After fit: ``plan``, ``report`` (the predicted MemoryReport), ``predicted_peak_bytes``,
    ``measured_peak_bytes`` (the last measurement)."""

    def __new__(cls, *args, **kwargs):
        if cls is MemfitCallback:  # a lightning Callback too, made when lightning is first used
            if not _CLASS:
                _CLASS.append(type("MemfitCallback", (MemfitCallback, _lightning().Callback), {}))
            cls = _CLASS[0]
        return super().__new__(cls)

    def __init__(self, plan: Plan | str | Path | dict | None = None, *, budget: str | int | None = None,
                 tolerance: float = 0.01):
        if (plan is None) == (budget is None):
            raise UserError("MemfitCallback: give plan=... (a plan file, Plan or dict of plan keys) or budget=... "
                            "(e.g. '8GiB'), one of them")
        self.plan = as_plan(plan, "MemfitCallback") if plan is not None else None
        self.budget = budget
        self.peaks = core.PeakLog("MemfitCallback", tolerance)
        self._window: PeakWindow | None = None
        self._range = contextlib.ExitStack()
        self._baseline, self._steps = 0, 0

    report = property(lambda self: self.peaks.report)
    predicted_peak_bytes = property(lambda self: self.peaks.predicted_peak_bytes)
    measured_peak_bytes = property(lambda self: self.peaks.measured_peak_bytes)

    # -- before training: checks, the plan, the step ----------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        pl = _lightning()
        mro = type(pl_module).__mro__
        if MemfitModule not in mro or mro.index(MemfitModule) > mro.index(pl.LightningModule):
            raise UserError(f"MemfitCallback: {type(pl_module).__name__} must subclass MemfitModule before "
                            "LightningModule (class M(MemfitModule, LightningModule)); memfit's step is its training_step")
        if trainer.world_size > 1:
            raise UserError(f"MemfitCallback runs one device's step; use Trainer(devices=1) (this Trainer has "
                            f"{trainer.world_size}); memfit's sharded plans run with memfit train --nproc N")
        if trainer.strategy.root_device.type not in ("cpu", "cuda"):
            raise UserError(f"MemfitCallback: memfit's step runs on cpu or cuda, not "
                            f"{trainer.strategy.root_device.type}; use Trainer(accelerator='cpu' or 'gpu')")
        _check_trainer(trainer, self.plan)
        pl_module.automatic_optimization = False  # (after Lightning checked the Trainer for automatic optimization)

    # NOTE [ What the window sees ]
    # On a CPU the measurement is ``profile``'s, the profiler's allocator events, whose running sum
    # only counts what was allocated after the profiler started. It starts just before the plan is
    # applied, so gradients, optimizer states and what the plan converts are counted; the network's
    # own storages, alive before, are added as a baseline. Only the second step is measured there (the
    # steady state; a profiler over a whole run costs too much); what Lightning itself holds in that
    # window (logged values, its data fetcher's state) counts too: 72 bytes over the prediction of 5.7
    # MiB for the tests' tiny GPT-2. On a GPU it is ``torch.cuda.max_memory_allocated`` over every
    # step from the second on.
    def apply_to(self, trainer, module: MemfitModule) -> None:
        """Called from ``MemfitModule.configure_model``: plan (for a budget), predict, build the step."""
        if module.__dict__.get("_memfit_step") is not None:  # (a second fit: the plan is applied)
            return
        network, device = module.memfit_model(), trainer.strategy.root_device.type
        batch_size, example = _first_batch(trainer)
        kw = dict(batch_size=batch_size, loss_fn=module.memfit_loss, optimizer_factory=module.memfit_optimizer,
                  device=device)
        given = _given(trainer)
        if self.plan is None:
            self.plan = core.plan_for_budget(network, self.budget, example=example, fixed=core.taken_values(given),
                                        who="MemfitCallback", hint="a smaller DataLoader batch", **kw)
        self.plan = core.take_arguments(self.plan, given, "lightning", who="MemfitCallback", device=get_device(device))
        _check_trainer(trainer, self.plan)
        self.peaks.predict(network, self.plan, example_batch=example, **kw)
        gc.collect()
        self._window = PeakWindow(get_device(device))
        if device == "cpu" and _profiling(trainer):
            warnings.warn("MemfitCallback: the Trainer's PyTorch profiler is on; memfit measures no peak on the CPU "
                          "(one profiler at a time)", stacklevel=2)
            self._window = None
        elif device == "cpu":  # NOTE [ What the window sees ]
            self._window.__enter__()
            self._baseline = core.storage_bytes(network)
        module._memfit_step = apply(network, self.plan, **kw)
        if trainer.precision != LIGHTNING_DEFAULT_PRECISION:  # memfit's step runs it (see the docstring)
            from lightning.pytorch.plugins.precision import Precision
            trainer.strategy.precision_plugin = Precision()

    # -- during training: the measured peak ---------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._steps += 1
        if self._window is not None and self._steps >= STEADY_STEP:
            if self._window.cpu:
                gc.collect()
            self._range.enter_context(self._window.step(self._steps))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._window is None or self._steps < STEADY_STEP:
            return
        self._range.close()
        measured = self._baseline + self._window.finish(self._steps)
        if self._window.cpu:
            self._window = None  # (its profiler has stopped)
        for key, value in self.peaks.record(self._steps, measured, self.plan).items():
            pl_module.log(key, float(value), on_step=True, on_epoch=False)

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._close()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        self._range.close()
        if self._window is not None:
            self._window.__exit__(None, None, None)
            self._window = None


def _check_trainer(trainer, plan: Plan | None) -> None:
    """One line naming the Trainer argument to change when it would repeat what memfit's step does
    for ``plan`` (None: the plan is not made yet). Clipping and precision: ``core.take_arguments``."""
    if trainer.accumulate_grad_batches != 1:
        why = ("the plan steps the optimizer in backward (optimizer_in_backward), which cannot accumulate gradients"
               if plan is not None and plan.optimizer_in_backward else
               "memfit's step splits each batch into the plan's micro-batches itself (micro_batch_size)")
        raise UserError(f"MemfitCallback: {why}; remove Trainer(accumulate_grad_batches="
                        f"{trainer.accumulate_grad_batches}) and give the DataLoader the plan's whole batch")
    _given(trainer)  # (a precision or a clipping memfit cannot run: one line before the first step)


def _given(trainer) -> Export:
    """The Lightning Trainer's settings, as the techniques' ``from_arguments`` read them."""
    algorithm = trainer.gradient_clip_algorithm  # (None: Lightning's default, by norm)
    given = Export(1, lightning={"precision": trainer.precision, "gradient_clip_val": trainer.gradient_clip_val,
                                 "gradient_clip_algorithm": getattr(algorithm, "value", algorithm) or "norm"})
    try:
        core.trainer_configs(given)
    except UserError as e:
        raise UserError(f"MemfitCallback: {e}") from None
    return given


def _first_batch(trainer) -> tuple[int, Any]:
    """The batch size of the train DataLoader, and a maker of batches shaped like its first (what
    memfit traces; the data itself is not kept)."""
    trainer.fit_loop.setup_data()  # (the loop's own call later finds it done)
    loader = trainer.train_dataloader
    if loader is None:
        raise UserError("MemfitCallback: the Trainer has no train DataLoader (limit_train_batches=0?) to take the "
                        "batch's shape from; give it one")
    if isinstance(loader, (dict, list, tuple)):
        raise UserError("MemfitCallback: memfit's step trains on one train DataLoader; give the Trainer exactly one")
    leaves, spec = tree_flatten(next(iter(loader)))
    sized = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not sized:
        raise UserError("MemfitCallback: the train DataLoader's batch holds no tensor shaped [batch, ...]")
    size = sized[0].shape[0]
    specs = [(x.shape, x.dtype) if isinstance(x, torch.Tensor) else None for x in leaves]
    others = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    del leaves, sized

    def example(n: int) -> Any:
        assert n == size, (n, size)
        return tree_unflatten([torch.zeros(s[0], dtype=s[1]) if s else o for s, o in zip(specs, others)], spec)
    return size, example


def _profiling(trainer) -> bool:
    return type(trainer.profiler).__name__ == "PyTorchProfiler" or torch.autograd.profiler._is_profiler_enabled
