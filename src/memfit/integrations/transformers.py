"""memfit in a Hugging Face ``Trainer``: the plan runs, its peak is predicted and measured, and the
logs say both.

Two ways in, by how much of the plan the Trainer's own step can run::

    trainer = Trainer(model, TrainingArguments(**kwargs), train_dataset=ds,      # memfit plan --format hf
                      callbacks=[MemfitCallback(plan="plan.yaml")])
    trainer = MemfitTrainer(model, args, train_dataset=ds, plan="plan.yaml")     # or budget="6GiB"

- :class:`MemfitCallback` leaves the step to the Trainer. ``TrainingArguments`` carry precision,
  accumulation, clipping, the optimizer and compile (the callback refuses arguments that disagree
  with the plan, in one line that gives the right ones); the callback applies what acts on the
  model alone (checkpointing, attention). A plan that changes the step itself (optimizer in
  backward, chunked loss, offload, EMA) is refused with a pointer to MemfitTrainer.
- :class:`MemfitTrainer` runs every batch through memfit's own TrainStep (``memfit.apply`` on the
  Trainer's model, ``compute_loss`` and optimizer settings): ``training_step`` is the step's
  forward and backward, the Trainer's ``optimizer.step()`` the step's update (clipping, the
  optimizer or nothing when it ran in backward, EMA); the lr scheduler moves the step's own param
  groups. The plan owns precision, accumulation, clipping and checkpointing, so the matching
  arguments stay off (``gradient_accumulation_steps=1``, no ``gradient_checkpointing``/``torch_compile``).
  The Trainer's hyperparameters go into the plan where it leaves them open (``max_grad_norm``, 1.0
  by default, and ``bf16``/``fp16``; the Trainer's own autocast is then turned off: the step runs
  it), and a true conflict (clipping with the optimizer stepped in backward) is one line before
  training (``memfit.integrations.core``).

Both predict the step's peak before the first step (memfit's estimate on a fake copy of the model
and the first batch of ``train_dataloader``; a ``budget`` is planned the same way) and measure the
steady-state peak of each step that logs, adding ``memfit/predicted_peak_bytes`` and
``memfit/measured_peak_bytes`` to the Trainer's logs and warning when the run exceeds the
prediction. The reporters of ``report_to`` (TensorBoard, W&B, ...) come first in a Trainer's
callbacks: they get memfit's values from MemfitTrainer, or from a callback added with
``MemfitCallback(...).attach(trainer)``, which places it ahead of them (one given in
``callbacks=[...]`` adds them to the log history and to the callbacks after it).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_map
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations import core
from memfit.integrations.apply import apply, as_plan, hf_loss
from memfit.integrations.core import ERROR, MEASURED, PREDICTED
from memfit.integrations.export import HF_CALLBACK_APPLIES, hf_unmapped_of, to_hf
from memfit.memory.measure import PeakWindow
from memfit.plans import TECHNIQUES, Plan
from memfit.techniques.base import Export
from memfit.techniques.half_weights import adapter_parameters
from memfit.techniques.precision import AdapterBase, Autocast, BF16Pure

__all__ = ["ERROR", "MEASURED", "PREDICTED", "MemfitCallback", "MemfitTrainer"]
CALLBACK_APPLIES = HF_CALLBACK_APPLIES
"""Techniques that act on the model alone (and the step's contexts): a callback applies them (through
``memfit.apply``). What else a plan holds, TrainingArguments carry (the technique's own ``export``
says) or MemfitTrainer runs."""
STEP_OWNS = ("gradient_checkpointing", "torch_compile")
"""Trainer settings that would apply a technique a second time on top of MemfitTrainer's step."""


class MemfitCallback(TrainerCallback):
    """Predict, measure and log the peak of a Trainer's step for ``plan`` (a Plan, a plan file or
    a dict of plan keys) or for a ``budget`` ("6GiB", bytes) planned on the Trainer's model and
    first batch. ``tolerance``: how far the measured peak may exceed the prediction before a warning."""

    def __init__(self, plan=None, *, budget: str | int | None = None, tolerance: float = 0.01):
        if (plan is None) == (budget is None):
            raise UserError("MemfitCallback: give plan= (a plan file, a dict of plan keys or a Plan) or budget= "
                            "(e.g. '6GiB'), one of the two")
        self.plan: Plan | None = as_plan(plan) if plan is not None else None
        self.budget = budget
        self.peaks = core.PeakLog("MemfitCallback", tolerance)
        self.trainer: MemfitTrainer | None = None
        """The MemfitTrainer that runs the plan's step; None: the Trainer runs its own."""
        self._fresh, self._logs, self._contexts, self._stack, self._window, self._range = False, {}, (), None, None, None
        self._inputs_bytes = self._baseline = 0

    predicted_peak_bytes = property(lambda self: self.peaks.predicted_peak_bytes)
    measured_peak_bytes = property(lambda self: self.peaks.measured_peak_bytes)
    """The last step measured (None before the second step)."""

    def attach(self, trainer: Trainer) -> MemfitCallback:
        """Add this callback to a plain ``trainer`` right after its DefaultFlowCallback, ahead of the
        reporting integrations (``report_to``), so the values it adds to the logs reach them."""
        callbacks = trainer.callback_handler.callbacks
        flow = next((i for i, c in enumerate(callbacks) if isinstance(c, DefaultFlowCallback)), -1)
        callbacks.insert(flow + 1, self)
        return self

    def setup(self, model, args, dataloader, *, trainer: MemfitTrainer | None = None):
        """Plan (for a budget) and predict on ``model`` and the first batch; with ``trainer`` build
        memfit's step on ``model`` and return it, else apply the plan's model-side techniques."""
        if getattr(args, "world_size", 1) > 1 or getattr(args, "n_gpu", 1) > 1:
            raise UserError("MemfitCallback: this integration runs one process on one device; for several ranks use "
                            "memfit train --nproc N")
        device, batch_size = _device(args), args.per_device_train_batch_size * args.gradient_accumulation_steps
        example = _example_batches(dataloader, torch.device(args.device))
        step = dict(batch_size=batch_size, loss_fn=(lambda m, b: trainer.compute_loss(m, b)) if trainer else hf_loss,
                    optimizer_factory=_optimizer_factory(trainer, args, model), device=device)
        given = trainer.memfit_given if trainer is not None else _given(args)
        if self.plan is None:
            fixed = core.taken_values(given) if trainer is not None else _trainer_runs(given, model)
            self.plan = core.plan_for_budget(model, self.budget, example=example, fixed=fixed, who="MemfitCallback",
                                        hint="a smaller per_device_train_batch_size" + (
                                            "" if trainer else ", or use MemfitTrainer(budget=...)"), **step)
        if trainer is None:
            _check_args_run(self.plan, given, Plan(**_trainer_runs(given, model)), args, batch_size)
        self.peaks.predict(model, self.plan, example_batch=example, **step)
        self._inputs_bytes = core.storage_bytes(example(batch_size))
        if trainer is not None:
            return apply(model, self.plan, **step)
        model_side = {k: v for c in self.plan.techniques if c.technique.name in CALLBACK_APPLIES and not (
            c.technique.name == "checkpointing" and args.gradient_checkpointing) for k, v in c.values().items()}
        self._contexts = apply(model, model_side, batch_size=batch_size, device=device).contexts
        return None

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if self.trainer is None and self.predicted_peak_bytes is None:
            self.setup(model, args, train_dataloader)

    # NOTE [ Measuring inside a Trainer ]
    # On a GPU: ``torch.cuda.max_memory_allocated`` over the step. On a CPU: what ``memfit profile``
    # measures, every live byte at the step's peak from the profiler's allocator events. ``profile``
    # starts its profiler before the model exists; a Trainer's model exists long before a step, so the
    # storages live when the step begins (parameters, buffers, gradients, optimizer states, EMA, the
    # batch, counted from the tensors) are added to the profiler's running peak over the step. The rest
    # of the process (the dataset, a batch prefetched) is in neither number. The first step is never
    # measured: the optimizer's states appear during it.
    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._close(state, measured=False)  # (what a step that raised left open)
        self._stack = contextlib.ExitStack()
        for make in self._contexts:
            self._stack.enter_context(make())
        nxt = state.global_step + 1
        logs = args.logging_strategy == "steps" and state.logging_steps and nxt % state.logging_steps == 0
        if nxt < 2 or not (logs or nxt == state.max_steps):
            return
        step = self.trainer.memfit_step if self.trainer is not None else None
        self._window = PeakWindow(get_device(_device(args)))
        if self._window.cpu:  # NOTE [ Measuring inside a Trainer ]
            opt = step.optimizer if step is not None else optimizer
            self._baseline = self._inputs_bytes + core.storage_bytes(
                model, getattr(opt, "state", {}), step.ema.state_dict() if step is not None else {})
        self._window.__enter__()
        self._range = self._window.step(nxt)
        self._range.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self._close(state, measured=True)

    def on_train_end(self, args, state, control, **kwargs):
        self._close(state, measured=False)

    def _close(self, state, *, measured: bool) -> None:
        window, stack, self._window, self._stack = self._window, self._stack, None, None
        if window is not None:
            self._range.__exit__(None, None, None)
            if measured:
                peak = window.finish(state.global_step) + (self._baseline if window.cpu else 0)
                self._logs, self._fresh = self.peaks.record(state.global_step, peak, self.plan), True
            else:
                window.__exit__(None, None, None)
        if stack is not None:
            stack.close()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.trainer is None and logs is not None:  # (a MemfitTrainer adds them in its log())
            self.add_to(logs)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update({k: v for k, v in logs.items() if k.startswith("memfit/")})

    def add_to(self, logs: dict) -> None:
        """Put the prediction, and the measurement not logged yet, into a Trainer's ``logs``."""
        if self.predicted_peak_bytes is not None:
            logs[PREDICTED] = self.predicted_peak_bytes
        if self._fresh:
            logs.update(self._logs)
            self._fresh = False


class MemfitTrainer(Trainer):
    """A Trainer whose step is memfit's TrainStep for ``plan`` or ``budget`` (see the module's
    docstring); a :class:`MemfitCallback` in ``callbacks`` may give them instead."""

    def __init__(self, model=None, args=None, *rest, plan=None, budget: str | int | None = None, **kwargs):
        if args is not None:  # the Trainer's hyperparameters go into the plan; its own autocast stays off
            self.memfit_given = _given(args)
            args = dataclasses.replace(args, bf16=False, fp16=False) if args.bf16 or args.fp16 else args
        super().__init__(model, args, *rest, **kwargs)
        if args is None:
            self.memfit_given = _given(self.args)
        given = [c for c in self.callback_handler.callbacks if isinstance(c, MemfitCallback)]
        if len(given) > 1 or (given and (plan is not None or budget is not None)):
            raise UserError("MemfitTrainer: give the plan once, as plan=/budget= or as one MemfitCallback in callbacks")
        self.memfit = given[0] if given else MemfitCallback(plan, budget=budget)
        if not given:
            self.add_callback(self.memfit)
        self.memfit.trainer = self
        self.memfit_step = None
        """memfit's TrainStep that runs the Trainer's batches (built when training starts)."""
        _check_trainer_args(self.args, self.memfit.plan, user_optimizer=self.optimizer is not None)
        if self.memfit.plan is not None:
            self.memfit.plan = core.take_arguments(self.memfit.plan, self.memfit_given, "hf", who="MemfitTrainer",
                                              device=get_device(_device(self.args)))

    def create_optimizer(self, model=None):
        if self.memfit_step is None:
            self.memfit_step = self.memfit.setup(self.model, self.args, self.get_train_dataloader(), trainer=self)
            self.optimizer = core.StepOptimizer(self.memfit_step)
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward and backward through memfit's step (its precision, micro-batches, contexts and
        loss); the Trainer's ``optimizer.step()`` then runs the step's update."""
        model.train()
        return self.memfit_step.forward_backward(self._prepare_inputs(inputs))

    def _clip_grad_norm(self, model):
        return None  # the plan clips in the step's update (max_grad_norm), with every gradient there

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm  # (the Trainer would compute the norm of gradients the plan may have freed)

    def log(self, logs, *args, **kwargs):
        self.memfit.add_to(logs)
        super().log(logs, *args, **kwargs)


def _device(args) -> str:
    return "cuda" if args.device.type == "cuda" else "cpu"


def _given(args) -> Export:
    """The TrainingArguments' values, as the techniques' ``from_arguments`` read them."""
    return Export(args.per_device_train_batch_size, hf={f.name: getattr(args, f.name) for f in dataclasses.fields(args)})


def _trainer_runs(given: Export, model) -> dict:
    """The plan values the Trainer's own step runs with these arguments: every technique the
    arguments set, the rest at its default, but for the model-side ones a callback applies (bf16
    with a model loaded in bf16 runs bf16-pure; with peft's adapter in fp32 over a bf16 or fp16 model, bf16-base or fp16-base;
    neither bf16 nor fp16 over such a model: the same without autocast, bf16-base-noautocast)."""
    configs = core.trainer_configs(given)
    precision = configs.get("precision")
    dtype = next(model.parameters()).dtype
    _, adapter = adapter_parameters(model)  # (get_peft_model keeps an adapter in fp32 over a 16-bit model)
    fp32_adapter = bool(adapter) and all(p.dtype == torch.float32 for p in adapter)
    if isinstance(precision, Autocast) and dtype == precision.torch_dtype:
        if fp32_adapter:
            configs["precision"] = AdapterBase(precision.dtype)
        elif precision.dtype == "bf16":
            configs["precision"] = BF16Pure()
    elif precision is None and fp32_adapter and dtype in (torch.bfloat16, torch.float16):
        configs["precision"] = AdapterBase("bf16" if dtype == torch.bfloat16 else "fp16", autocast_on=False)
    return {k: v for t in TECHNIQUES if t.name not in CALLBACK_APPLIES or t.name in configs
            for k, v in configs.get(t.name, t.default).values().items()}


def _check_args_run(plan: Plan, given: Export, runs: Plan, args, batch_size: int) -> None:
    """A plain Trainer runs ``plan`` only if its arguments carry what they can and the rest acts on
    the model alone; else one line naming the arguments or MemfitTrainer."""
    step_side = [c for c in plan.techniques if not c.is_default and c.technique.name not in CALLBACK_APPLIES
                 and (c.technique.name == "shard" or hf_unmapped_of(c, batch_size))]
    if step_side:
        keys = "; ".join(f"{k}: {v}" for c in step_side for k, v in c.values().items())
        raise UserError(f"MemfitCallback: a callback cannot apply {keys} (they change the Trainer's step); use "
                        "memfit.integrations.transformers.MemfitTrainer(..., plan=...) to run memfit's step")
    device = get_device(_device(args))
    wrong, set_here = [], core.trainer_configs(given)
    for name in (t.name for t in TECHNIQUES):
        if name in CALLBACK_APPLIES and name not in set_here:
            continue  # (the callback applies the plan's)
        theirs, ours = runs.config(name).resolve(device), plan.config(name).resolve(device)
        if theirs != ours and not (name == "accumulation" and runs.micro_batches(batch_size) ==
                                   plan.micro_batches(batch_size)):
            wrong.append(f"{theirs.values()} (the plan: {ours.values()})")
    if wrong:
        raise UserError(f"MemfitCallback: the Trainer's arguments run {', '.join(sorted(wrong))}; use "
                        f"{to_hf(plan, batch_size, device).python()} (what memfit plan --format hf writes)")


def _check_trainer_args(args, plan: Plan | None, *, user_optimizer: bool) -> None:
    """What MemfitTrainer refuses before training: Trainer settings that would apply a technique a
    second time on top of memfit's step, or that it cannot honour."""
    name = "MemfitTrainer"
    if user_optimizer:
        raise UserError(f"{name}: the plan builds the optimizer (it may step it in backward or offload its states); "
                        "instead of optimizers=(...), choose it with TrainingArguments(optim=...) or "
                        "optimizer_cls_and_kwargs=(cls, kwargs)")
    if args.gradient_accumulation_steps > 1:
        why = ("the plan steps the optimizer in backward, which cannot accumulate gradients" if plan is not None
               and plan.optimizer_in_backward else "memfit's step accumulates the plan's micro-batches itself")
        raise UserError(f"{name}: gradient_accumulation_steps={args.gradient_accumulation_steps} in TrainingArguments, "
                        f"but {why}; set gradient_accumulation_steps=1 and per_device_train_batch_size to the whole "
                        "batch (the plan's micro_batch_size splits it)")
    for flag in STEP_OWNS:
        if getattr(args, flag):
            raise UserError(f"{name}: {flag}=True in TrainingArguments would apply a technique a second time on top "
                            f"of memfit's step; set {flag}=False (the plan decides)")


def _optimizer_factory(trainer, args, model):
    """The optimizer the Trainer would build (``optim`` and its hyperparameters, weight decay
    grouped as the Trainer groups it) for any subset of the parameters."""
    given = getattr(trainer, "optimizer_cls_and_kwargs", None)
    cls, kwargs = given if given is not None else Trainer.get_optimizer_cls_and_kwargs(args, model)
    names = set(trainer.get_decay_parameter_names(model) if trainer is not None else ())
    decay = {id(p) for n, p in model.named_parameters() if n in names}

    def build(params):
        params = list(params)
        groups = [{"params": [p for p in params if id(p) in decay], "weight_decay": args.weight_decay},
                  {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0}]
        return cls([g for g in groups if g["params"]], **kwargs)
    return build



def _example_batches(dataloader, device: torch.device):
    """``batch(n)``: the first ``n`` samples of the Trainer's data, collated as its data loader does
    (a new copy each call, so a fake trace copies it into fake tensors). The sampler is not touched."""
    cache: dict = {}

    def batch(n: int):
        if n not in cache:
            ds, collate = getattr(dataloader, "dataset", None), getattr(dataloader, "collate_fn", None)
            if collate is None or not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
                raise UserError("MemfitCallback: the training data has no first samples to predict with (an iterable "
                                "dataset); give a plan, or a map-style train_dataset")
            if len(ds) < n:
                raise UserError(f"MemfitCallback: the training dataset has {len(ds)} samples, fewer than one batch "
                                f"of {n}; use a smaller per_device_train_batch_size")
            with unset_fake_temporarily():  # (real tensors, also when a fake trace asks first)
                cache[n] = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                                    collate([ds[i] for i in range(n)]))
        return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, cache[n])
    return batch
