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
  arguments stay off (``gradient_accumulation_steps=1``, no ``bf16``/``fp16``/``gradient_checkpointing``)
  and ``max_grad_norm`` is the plan's (0.0: none), or it refuses before training.

Both predict the step's peak before the first step (memfit's estimate on a fake copy of the model
and the first batch of ``train_dataloader``; a ``budget`` is planned the same way) and measure the
steady-state peak of each step that logs, adding ``memfit/predicted_peak_bytes`` and
``memfit/measured_peak_bytes`` to the Trainer's logs (TensorBoard, W&B, ... get them through the
user's ``report_to``) and warning when the run exceeds the prediction.

NOTE [ Measuring inside a Trainer ]
On a GPU: ``torch.cuda.max_memory_allocated`` over the step. On a CPU: what ``memfit profile``
measures, every live byte at the step's peak from the profiler's allocator events. ``profile``
starts its profiler before the model exists; a Trainer's model exists long before a step, so the
storages live when the step begins (parameters, buffers, gradients, optimizer states, EMA, the
batch, counted from the tensors) are added to the profiler's running peak over the step. The rest
of the process (the dataset, a batch prefetched) is in neither number. The first step is never
measured: the optimizer's states appear during it.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_map
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

import memfit
from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.apply import as_plan, estimate_applied, hf_loss, workload_of
from memfit.memory.measure import PeakWindow
from memfit.planner.export import HF_CALLBACK_APPLIES, hf_unmapped_of, to_hf
from memfit.plans import Plan
from memfit.techniques.base import StepParts
from memfit.techniques.checkpointing import BlocksAC
from memfit.techniques.placement import HostPlacement

PREDICTED, MEASURED, ERROR = "memfit/predicted_peak_bytes", "memfit/measured_peak_bytes", "memfit/error_percent"
CALLBACK_APPLIES = HF_CALLBACK_APPLIES
"""Techniques that act on the model alone (and the step's contexts): a callback applies them. What
else a plan holds, TrainingArguments carry (the technique's own ``export`` says) or MemfitTrainer runs."""
ADAMW = ("adamw_torch", "adamw_torch_fused")


class MemfitCallback(TrainerCallback):
    """Predict, measure and log the peak of a Trainer's step for ``plan`` (a Plan, a plan file or
    a dict of plan keys) or for a ``budget`` ("6GiB", bytes) planned on the Trainer's model and
    first batch. ``tolerance``: how far the measured peak may exceed the prediction before a warning."""

    def __init__(self, plan=None, *, budget: str | int | None = None, tolerance: float = 0.01):
        if (plan is None) == (budget is None):
            raise UserError("MemfitCallback: give plan= (a plan file, a dict of plan keys or a Plan) or budget= "
                            "(e.g. '6GiB'), one of the two")
        self.plan: Plan | None = as_plan(plan) if plan is not None else None
        self.budget, self.tolerance = budget, tolerance
        self.trainer: MemfitTrainer | None = None
        """The MemfitTrainer that runs the plan's step; None: the Trainer runs its own."""
        self.predicted_peak_bytes: int | None = None
        self.measured_peak_bytes: int | None = None
        """The last step measured (None before the second step)."""
        self._fresh, self._contexts, self._stack, self._window, self._range = False, [], None, None, None
        self._inputs_bytes = self._baseline = 0

    def setup(self, model, args, dataloader, *, trainer: MemfitTrainer | None = None):
        """Plan (for a budget) and predict on ``model`` and the first batch; with ``trainer`` also
        build memfit's step on ``model`` and return it."""
        if getattr(args, "world_size", 1) > 1 or getattr(args, "n_gpu", 1) > 1:
            raise UserError("MemfitCallback: this integration runs one process on one device; for several ranks use "
                            "memfit train --nproc N")
        device, batch_size = _device(args), args.per_device_train_batch_size * args.gradient_accumulation_steps
        example = _example_batches(dataloader, torch.device(args.device))
        loss_fn = (lambda m, b: trainer.compute_loss(m, b)) if trainer else hf_loss
        factory = _optimizer_factory(trainer, args, model)
        if self.plan is None:
            self.plan = _plan_for_budget(model, self.budget, batch_size=batch_size, example=example, loss_fn=loss_fn,
                                         factory=factory, device=device, trainer=trainer is not None,
                                         fixed={"max_grad_norm": args.max_grad_norm or None} if trainer
                                         else _args_values(args, model))
        if trainer is None:
            _check_args_run(self.plan, args, model, batch_size)
        report = estimate_applied(model, self.plan, batch_size=batch_size, example_batch=example, loss_fn=loss_fn,
                                  optimizer_factory=factory, device=device)
        self.predicted_peak_bytes = report.measurable_peak_bytes
        self._inputs_bytes = _storage_bytes(example(batch_size))
        if trainer is not None:
            return memfit.apply(model, self.plan, batch_size=batch_size, loss_fn=loss_fn, optimizer_factory=factory,
                                device=device)
        self._contexts = _apply_to_model(self.plan, model, args, device, batch_size)
        return None

    def on_init_end(self, args, state, control, **kwargs):
        _go_before_reporters(self)

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if self.trainer is None and self.predicted_peak_bytes is None:
            self.setup(model, args, train_dataloader)

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
            self._baseline = self._inputs_bytes + _storage_bytes(
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
                self.measured_peak_bytes = window.finish(state.global_step) + (self._baseline if window.cpu else 0)
                self._fresh = True
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
        if self.predicted_peak_bytes is None:
            return
        logs[PREDICTED] = self.predicted_peak_bytes
        if not self._fresh:
            return
        self._fresh = False
        measured, predicted = self.measured_peak_bytes, self.predicted_peak_bytes
        logs[MEASURED] = measured
        logs[ERROR] = round(100.0 * (predicted - measured) / max(measured, 1), 3)
        if measured > predicted * (1 + self.tolerance):
            warnings.warn(f"memfit: the step's measured peak {measured / 2**20:.1f} MiB exceeds the predicted "
                          f"{predicted / 2**20:.1f} MiB by {100 * (measured / predicted - 1):.1f}%", stacklevel=2)


class MemfitTrainer(Trainer):
    """A Trainer whose step is memfit's TrainStep for ``plan`` or ``budget`` (see the module's
    docstring); a :class:`MemfitCallback` in ``callbacks`` may give them instead."""

    def __init__(self, *args, plan=None, budget: str | int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
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

    def create_optimizer(self, model=None):
        if self.memfit_step is None:
            self.memfit_step = self.memfit.setup(self.model, self.args, self.get_train_dataloader(), trainer=self)
            self.optimizer = _StepOptimizer(self.memfit_step)
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


class _StepOptimizer(torch.optim.Optimizer):
    """What the Trainer, accelerate and the lr scheduler see as the optimizer: ``step()`` is the
    memfit step's update, ``zero_grad()`` its zero_grad; param groups and state are its optimizer's
    (per-parameter optimizers' groups when the plan steps in backward: the scheduler moves them all)."""

    def __init__(self, step):  # (no Optimizer.__init__: the param groups are the step's own)
        self.memfit_step = step

    param_groups = property(lambda self: self.memfit_step.optimizer.param_groups)
    defaults = property(lambda self: self.memfit_step.optimizer.defaults)
    state = property(lambda self: self.memfit_step.optimizer.state)

    def state_dict(self) -> dict:
        """The optimizer's state dict, with the rest of memfit's step state the Trainer's checkpoint
        must keep (the EMA, the loss scaler) under ``memfit``."""
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

    def step(self, closure=None):
        self.memfit_step.update()

    def zero_grad(self, set_to_none: bool = True):
        self.memfit_step.zero_grad()


def _device(args) -> str:
    return "cuda" if args.device.type == "cuda" else "cpu"


def _args_values(args, model) -> dict:
    """The plan the Trainer's own step runs with these arguments: every key at its default except
    what the arguments set (the planner searches checkpointing and attention, which a callback applies)."""
    bf16 = "bf16-pure" if next(model.parameters()).dtype == torch.bfloat16 else "bf16"  # (a model loaded in bf16)
    values = {k: v for k, v in Plan().to_dict().items() if k not in ("checkpointing", "attention")}
    values.update(precision="fp16" if args.fp16 else bf16 if args.bf16 else "fp32", max_grad_norm=args.max_grad_norm or None,
                  compile="full" if args.torch_compile else "none",
                  micro_batch_size=args.per_device_train_batch_size if args.gradient_accumulation_steps > 1 else None)
    if args.gradient_checkpointing:
        values["checkpointing"] = "blocks"
    return values


def _check_args_run(plan: Plan, args, model, batch_size: int) -> None:
    """A plain Trainer runs ``plan`` only if its arguments carry what they can and the rest acts on
    the model alone; else one line naming the arguments or MemfitTrainer."""
    step_side = [c for c in plan.techniques if not c.is_default and c.technique.name not in CALLBACK_APPLIES
                 and (c.technique.name == "shard" or hf_unmapped_of(c, batch_size))]
    if step_side:
        keys = "; ".join(f"{k}: {v}" for c in step_side for k, v in c.values().items())
        raise UserError(f"MemfitCallback: a callback cannot apply {keys} (they change the Trainer's step); use "
                        "memfit.integrations.transformers.MemfitTrainer(..., plan=...) to run memfit's step")
    device = get_device(_device(args))
    ours = _args_values(args, model)
    here_micro = Plan(micro_batch_size=ours["micro_batch_size"]).micro_batches(batch_size)
    optim = str(getattr(args.optim, "value", args.optim))
    exported = to_hf(plan, batch_size, device)
    pairs = [("precision", ours["precision"], plan.config("precision").resolve(device).values()["precision"]),
             ("micro-batches", "{1} of {0}".format(*here_micro), "{1} of {0}".format(*plan.micro_batches(batch_size))),
             ("max_grad_norm", ours["max_grad_norm"], plan.max_grad_norm), ("compile", ours["compile"], plan.compile),
             ("optim", optim, optim if optim in ADAMW and exported.kwargs["optim"] in ADAMW else exported.kwargs["optim"]),
             ("gradient_checkpointing", args.gradient_checkpointing,
              args.gradient_checkpointing and plan.config("checkpointing") == BlocksAC())]
    wrong = [f"{key} {here} (the plan: {planned})" for key, here, planned in pairs if here != planned]
    if wrong:
        raise UserError(f"MemfitCallback: the Trainer's arguments run {', '.join(wrong)}; use "
                        f"{exported.python()} (what memfit plan --format hf writes)")


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
    for flag, what in (("bf16", "precision"), ("fp16", "precision"), ("gradient_checkpointing", "checkpointing"),
                       ("torch_compile", "compile")):
        if getattr(args, flag):
            raise UserError(f"{name}: {flag}=True in TrainingArguments would apply a second {what} on top of memfit's "
                            f"step; set {flag}=False (the plan's {what} key decides)")
    if plan is not None and (args.max_grad_norm or None) != plan.max_grad_norm:
        raise UserError(f"{name}: max_grad_norm={args.max_grad_norm} in TrainingArguments but the plan's max_grad_norm "
                        f"is {plan.max_grad_norm}; set max_grad_norm={plan.max_grad_norm or 0.0} (0.0: no clipping) "
                        "or change the plan")


def _apply_to_model(plan: Plan, model, args, device: str, batch_size: int) -> list:
    """Apply the plan's model-side techniques (checkpointing, attention) to the Trainer's model in
    place, as build_step does; returns the contexts to hold around each step."""
    parts = StepParts(model=model, device=get_device(device), device_type=device, batch_size=batch_size,
                      placement=HostPlacement(), loss_fn=hf_loss, optimizer_factory=None, plan=plan)
    for config in plan.techniques:
        if config.technique.name not in CALLBACK_APPLIES or config.is_default:
            continue
        if config.technique.name == "checkpointing" and args.gradient_checkpointing:
            continue  # the Trainer checkpoints every block itself (checked: the plan's blocks)
        config.apply(parts)
    return list(parts.contexts)


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


def _plan_for_budget(model, budget, *, batch_size, example, loss_fn, factory, device, fixed, trainer) -> Plan:
    from memfit.planner.search import plan as make_plan
    workload = workload_of(model, batch_size=batch_size, loss_fn=loss_fn, optimizer_factory=factory,
                           example_batch=example, copies=True)  # (the planner times and traces copies)
    found = make_plan(workload, budget=budget, batch_size=batch_size, device=device, fixed=fixed)
    if found.chosen is None:
        smallest = found.smallest
        hint = f"; the smallest found needs {smallest.used_bytes / 2**30:.2f} GiB" if smallest is not None else ""
        raise UserError(f"MemfitCallback: no plan the Trainer can run fits the budget {budget}{hint}: give a larger "
                        "budget or a smaller per_device_train_batch_size" + ("" if trainer else
                                                                             ", or use MemfitTrainer(budget=...)"))
    return found.chosen.plan


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


def _storage_bytes(*roots) -> int:
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


def _go_before_reporters(callback: MemfitCallback) -> None:
    """Move ``callback`` right after the Trainer's DefaultFlowCallback, ahead of the reporting
    integrations (TensorBoard, W&B, ...), so the values it adds to ``logs`` reach them. The handler
    is the caller of ``on_init_end`` (a callback is given no reference to it)."""
    frame = sys._getframe(1)
    while frame is not None and not isinstance(frame.f_locals.get("self"), CallbackHandler):
        frame = frame.f_back
    if frame is None:  # (then the callbacks listed after it and the log history get memfit's values)
        return
    callbacks = frame.f_locals["self"].callbacks
    callbacks.remove(callback)
    flow = next((i for i, c in enumerate(callbacks) if isinstance(c, DefaultFlowCallback)), -1)
    callbacks.insert(flow + 1, callback)
