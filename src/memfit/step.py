"""TrainStep: the one training-step path.

``estimate`` runs it on fake tensors, ``profile`` on real tensors under measurement, ``train`` in
a loop. A step is: zero_grad(set_to_none) -> for each micro-batch: forward + loss under the
plan's precision, backward (scaled for fp16) -> optimizer step. Micro-batch losses are divided by
the number of micro-batches, so accumulated gradients equal those of the whole batch.

Techniques (``memfit.techniques``) are applied once, in :func:`build_step`: converters change the
model (precision, attention, checkpointing), the optimizer is chosen (variant, in backward,
offloaded states), the loss may be chunked, and the step holds the contexts they need (attention
around forward and backward, activation offload around forward) and runs ``after_step`` hooks
(EMA). There is no other step: estimate, profile and train all run this one.

An *observer* (memfit's memory tracker) may watch the step: the step announces its phases
(``zero_grad``, ``forward``, ``backward``, ``optimizer``) through ``observer.phase(name)`` and
techniques report host-resident copies through ``observer.host(tensors)``; the default observer
does nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from memfit.devices import Device, get_device
from memfit.errors import UserError
from memfit.kernel_errors import explain as explain_kernel_error
from memfit.plans import Plan
from memfit.techniques.attention import Attention
from memfit.techniques.bf16_pure import compensated
from memfit.techniques.checkpointing import CheckpointConfig, Checkpointing
from memfit.techniques.chunked_loss import ChunkedLoss
from memfit.techniques.ema import EMA, NoEMA
from memfit.techniques.offload import OffloadActivations, OffloadOptimizerStates
from memfit.techniques.optimizers import OptimizerInBackward, variant_factory
from memfit.techniques.placement import HostPlacement
from memfit.techniques.precision import build_precision
from memfit.workload import Workload


class NullObserver:
    """Watches nothing."""

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def host(self, tensors) -> None:
        pass


def split_batch(batch: Any, batch_size: int, n: int) -> list[Any]:
    """Split every tensor whose first dimension is the batch into ``n`` equal micro-batches."""
    leaves, spec = tree_flatten(batch)
    if not any(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch_size for x in leaves):
        raise UserError(f"cannot split the batch into micro-batches: no tensor in it has a first dimension of "
                        f"{batch_size} (the batch size); make batch(batch_size) return tensors shaped [batch, ...]")
    parts = [x.chunk(n) if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch_size
             else [x] * n for x in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(n)]


class TrainStep:
    """One optimizer step of a workload under a plan. ``step(batch)`` returns the loss as a float;
    ``step.run(batch)`` returns it as a detached tensor (what fake-tensor tracing uses)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn, plan: Plan,
                 batch_size: int, device: Device, precision, *, placement: HostPlacement | None = None,
                 contexts: tuple = (), forward_contexts: tuple = (), after_step: tuple = (), ema=None):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.plan, self.batch_size, self.device, self.precision = plan, batch_size, device, precision
        self.micro_batch_size, self.num_micro_batches = plan.micro_batches(batch_size)
        self.scaler = precision.grad_scaler()
        self.placement = placement or HostPlacement()
        self.contexts = contexts                # around forward and backward (backward may recompute)
        self.forward_contexts = forward_contexts  # around forward only (e.g. saved-tensor hooks)
        self.after_step = after_step
        self.ema = ema
        self.phase = "idle"
        """The phase running now (zero_grad, forward, backward, optimizer): an OOM handler needs it."""
        self.observer = NullObserver()

    @property
    def observer(self):
        return self._observer

    @observer.setter
    def observer(self, obs) -> None:
        self._observer = obs
        self.placement.observer = obs

    def run(self, batch: Any) -> torch.Tensor:
        try:
            return self._run(batch)
        except RuntimeError as e:
            missing = explain_kernel_error(e, self.plan.precision)
            if missing is None:
                raise
            raise missing from e

    def _run(self, batch: Any) -> torch.Tensor:
        obs, n = self.observer, self.num_micro_batches
        self.phase = "zero_grad"
        with obs.phase("zero_grad"):
            self.optimizer.zero_grad(set_to_none=True)
        batch = self.precision.prepare_batch(batch)
        micro = split_batch(batch, self.batch_size, n) if n > 1 else [batch]
        total = None
        with contextlib.ExitStack() as around:
            for make in self.contexts:
                around.enter_context(make())
            for mb in micro:
                self.phase = "forward"
                with obs.phase("forward"), self.precision.autocast(), contextlib.ExitStack() as fwd:
                    for make in self.forward_contexts:
                        fwd.enter_context(make())
                    loss = self.loss_fn(self.model, mb)
                    _check_loss(loss)
                    if n > 1:
                        loss = loss / n
                self.phase = "backward"
                with obs.phase("backward"):
                    self.scaler.scale(loss).backward()
                total = loss.detach() if total is None else total + loss.detach()
                del loss
        self.phase = "optimizer"
        with obs.phase("optimizer"):
            self.scaler.step(self.optimizer)
            self.scaler.update()
            for hook in self.after_step:
                hook()
        self.phase = "idle"
        return total

    def __call__(self, batch: Any) -> float:
        return float(self.run(batch))


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise UserError(f"loss(model, batch) must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise UserError(f"loss(model, batch) must return a scalar tensor, got shape {tuple(loss.shape)}; "
                        "reduce it (e.g. .mean())")
    if not loss.requires_grad:
        raise UserError("loss(model, batch) returned a tensor that does not require grad; "
                        "compute it from the model's output without .detach() or torch.no_grad()")


def tensor_device(device: Device) -> str:
    """Where the step's tensors live. NOTE [ GPU presets without a GPU ]: PyTorch's autograd
    engine cannot run backward on fake CUDA tensors without a CUDA driver (pytorch#92627), so a
    GPU preset is traced on fake CPU tensors here: CPU autocast op lists and CPU kernel choices
    apply, and the caching-allocator model replays the result."""
    if device.kind == "cuda" and not torch.cuda.is_available():
        return "cpu"
    return device.kind


def build_step(workload: Workload, plan: Plan | None = None, batch_size: int | None = None,
               device: Device | str | None = None) -> TrainStep:
    """Build the model and optimizer of ``workload`` and apply ``plan``; returns the TrainStep.

    The model is built under ``torch.device(...)`` (see :func:`tensor_device`), so calling this
    inside a ``FakeTensorMode`` builds it on fake tensors.
    """
    plan = plan or Plan()
    plan.check_implemented()
    dev = get_device(device)
    batch_size = batch_size or workload.default_batch_size
    plan.micro_batches(batch_size)
    precision = build_precision(plan.precision, dev, tensor_device(dev))
    placement = HostPlacement()
    with torch.device(tensor_device(dev)):
        model = _call_workload("model()", workload.model)
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"workload model() must return an nn.Module, got {type(model).__name__}")
        model = precision.apply(model)
        model.train()
        attention = Attention(plan.attention)
        attention.apply(model)
        recompute = (attention.context,) if plan.attention == "chunked" else ()
        Checkpointing(CheckpointConfig.parse(plan.checkpointing), recompute_contexts=recompute).apply(model)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise UserError("the workload's model has no trainable parameters")
        factory = variant_factory(plan.optimizer, lambda ps: _call_workload("optimizer(params)",
                                                                            workload.build_optimizer, ps), params)
        if plan.precision == "bf16-pure":
            factory = compensated(factory, plan.bf16_update)
        if plan.optimizer_in_backward:
            optimizer = OptimizerInBackward(params, factory)
        elif "optimizer_states" in plan.offload:
            optimizer = OffloadOptimizerStates(params, factory, placement)
        else:
            optimizer = factory(params)
    loss_fn = ChunkedLoss(plan.loss_chunks).wrap(_workload_fn("loss(model, batch)", workload.loss), model)
    ema = EMA(model, plan.ema, placement) if plan.ema else NoEMA()
    forward_contexts = (OffloadActivations(model, placement),) if "activations" in plan.offload else ()
    return TrainStep(model, optimizer, loss_fn, plan, batch_size, dev, precision, placement=placement,
                     contexts=(attention.context,), forward_contexts=forward_contexts,
                     after_step=(ema.update,), ema=ema)


def make_batch(workload: Workload, batch_size: int, device: Device) -> Any:
    with torch.device(tensor_device(device)):
        batch = _call_workload("batch(batch_size)", workload.batch, batch_size)
    if not any(isinstance(x, torch.Tensor) for x in tree_flatten(batch)[0]):
        raise UserError(f"the workload's batch(batch_size) returned {_kind(batch)} with no tensor in it; return a "
                        "tensor or a tuple/list/dict of tensors shaped [batch, ...]")
    return batch


def _kind(obj: Any) -> str:
    text = repr(obj)
    return f"a {type(obj).__name__} ({text if len(text) <= 40 else text[:37] + '...'})"


def _call_workload(what: str, fn, *args):
    """Call one of the workload's functions; a failure in the user's code becomes one line naming
    the function and where in the user's file it failed. Out-of-memory errors, fake-tensor trace
    failures and missing kernels pass through to their handlers (:func:`memfit.errors.passes_through`),
    as does a failure raised by memfit's own code or a built-in workload's (a bug to report)."""
    try:
        return fn(*args)
    except Exception as e:
        err = _workload_error(what, fn, e)
        if err is e:
            raise
        raise err from e


def _workload_fn(what: str, fn):
    """``fn`` wrapped by :func:`_call_workload` (a user's loss, called every micro-batch)."""
    if _builtin(fn):
        return fn

    def call(*args):
        return _call_workload(what, fn, *args)
    return call


def _workload_error(what: str, fn, e: Exception) -> BaseException:
    """The error to raise for exception ``e`` of the workload's ``what``: ``e`` itself, or a UserError."""
    from memfit.errors import brief, passes_through, raised_in_memfit, user_location
    if passes_through(e) or raised_in_memfit(e) or _builtin(fn):
        return e
    at = user_location(e, fn)
    msg = brief(e)
    return UserError(f"the workload's {what} raised {type(e).__name__}: {msg}{f' (at {at})' if at else ''}; "
                     "fix the workload (run with --debug for the traceback)")


def _builtin(fn) -> bool:
    """A built-in workload's function (memfit.workloads): its failures are reported there (overrides)."""
    return str(getattr(fn, "__module__", None) or "").startswith("memfit.workloads")
