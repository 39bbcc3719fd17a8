"""TrainStep: the one training-step path.

``estimate`` runs it on fake tensors, ``profile`` on real tensors under measurement, ``train`` in
a loop, and OOM adaptation rebuilds it for the adapted plan. A step is: zero_grad(set_to_none) ->
for each micro-batch: forward + loss under the plan's precision, backward (scaled for fp16) ->
hooks before the update (e.g. gradient clipping) -> optimizer step -> hooks after it (EMA).
Micro-batch losses are divided by the number of micro-batches, so accumulated gradients equal
those of the whole batch.

Techniques (``memfit.techniques``) are applied once, in :func:`build_step`, by one loop over the
plan's configs: each ``apply``-s itself to the :class:`~memfit.techniques.base.StepParts` under
construction (converting the model, wrapping how the optimizer is built or the loss, adding the
contexts the step holds), in the plan's order. There is no other step and no other place that
applies a technique: estimate, profile, train and adaptation all run this one.

An *observer* (memfit's memory tracker, the CPU budget guard) may watch the step: the step
announces its phases (``zero_grad``, ``forward``, ``backward``, ``optimizer``) through
``observer.phase(name)`` and techniques report host-resident copies through
``observer.host(tensors)`` (see memfit.observer).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from memfit.devices import Device
from memfit.errors import UserError, missing_kernel
from memfit.observer import NullObserver
from memfit.plans import Plan
from memfit.target import Target
from memfit.techniques.base import StepParts
from memfit.techniques.loading import Load, materialise, on_meta
from memfit.techniques.placement import HostPlacement
from memfit.techniques.timeline_marks import mark
from memfit.workload import Workload, call_workload, checked, split_batch

# NOTE [ Repeated micro-batches, traced once ]
# A step split into n micro-batches runs n forwards and backwards, and its fake trace costs n times one:
# a planner's search at batch 16 on a 12 GB card traced plans of 8 and 16 micro-batches at 5.5 s a
# shallow trace, against 0.6 s unsplit. Yet the memory does the same thing in every micro-batch between
# the second and the last: the first makes the gradients, each next one adds into them, and the last is
# followed by the update (and told it is the last: ``hook(index, n)``). So the planner's traces, shallow
# and full (memfit.planner.trace_job), run the first two and the last under ``repeats_skipped()``, with
# the whole batch in memory, and the second's ops stand for each skipped one
# (memfit.planner.ops.repeat_micro_batch). The peak, reserved bytes, ops and allocation stream are the
# whole step's (tests/unit/test_repeated_micro_batches.py). Nothing else skips: ``estimate``,
# ``profile`` and ``train`` run every micro-batch.
_SKIP_REPEATS = contextvars.ContextVar("memfit_skip_repeated_micro_batches", default=False)


@contextlib.contextmanager
def repeats_skipped():
    """Steps run in this context skip the micro-batches between the second and the last
    (NOTE [ Repeated micro-batches, traced once ])."""
    token = _SKIP_REPEATS.set(True)
    try:
        yield
    finally:
        _SKIP_REPEATS.reset(token)


RUN_WHEN_SKIPPING = 3
"""The micro-batches a step skipping repeats runs: the first, the second and the last."""


def has_repeats(n: int) -> bool:
    """A step of ``n`` micro-batches has some between the second and the last."""
    return n > RUN_WHEN_SKIPPING


def micro_batches_run(n: int) -> tuple[int, ...]:
    """The indices of the micro-batches a step of ``n`` runs (all, but under ``repeats_skipped``)."""
    return (0, 1, n - 1) if has_repeats(n) and _SKIP_REPEATS.get() else tuple(range(n))


class TrainStep:
    """One optimizer step of a target (workload, plan, batch, device). ``step(batch)`` returns the
    loss as a float; ``step.run(batch)`` returns it as a detached tensor (what fake-tensor tracing
    uses). Built by :func:`build_step`; nothing outside changes it (an adapted plan is a new step)."""

    def __init__(self, target: Target, parts: StepParts, optimizer: torch.optim.Optimizer,
                 observer=None):
        self.target = target
        self.model, self.optimizer, self.loss_fn = parts.model, optimizer, parts.loss_fn
        self.precision = parts.precision
        self.scaler = parts.precision.grad_scaler(parts.device_type)
        self.micro_batch_size, self.num_micro_batches = parts.micro_batch_size, parts.num_micro_batches
        self.placement = parts.placement
        self.ema = parts.ema
        self.updates_in_backward = parts.updates_in_backward
        """Parameters change during backward (an interrupted backward cannot be retried)."""
        self._device_type = parts.device_type
        self._contexts = tuple(parts.contexts)
        self._forward_contexts = tuple(parts.forward_contexts)
        self._before_backward = tuple(parts.before_backward)
        self._before_update = tuple(parts.before_update)
        self._after_update = tuple(parts.after_update)
        self.phase = "idle"
        """The phase running now (zero_grad, forward, backward, optimizer): an OOM handler needs it."""
        self._observer = NullObserver()
        if observer is not None:
            self._set_observer(observer)

    @property
    def contexts(self) -> tuple:
        """The context factories the step holds around forward and backward: what a trainer that
        runs its own forward and backward of ``model`` holds for this step's plan."""
        return self._contexts

    @property
    def plan(self) -> Plan:
        return self.target.plan

    @property
    def batch_size(self) -> int:
        return self.target.batch_size

    @property
    def rank_batch_size(self) -> int:
        """The samples this rank's step runs (the global batch unless the plan is sharded)."""
        return self.target.rank_batch_size

    @property
    def device(self) -> Device:
        return self.target.device

    @property
    def observer(self):
        return self._observer

    def _set_observer(self, observer) -> None:
        self._observer = observer
        self.placement.observer = observer

    @contextlib.contextmanager
    def observed_by(self, observer):
        """Let ``observer`` watch the step inside the block (the previous one after it)."""
        before = self._observer
        self._set_observer(observer)
        try:
            yield self
        finally:
            self._set_observer(before)

    def run(self, batch: Any) -> torch.Tensor:
        try:
            return self._run(batch)
        except RuntimeError as e:
            missing = missing_kernel(e, self.target.precision)
            if missing is None:
                raise
            raise missing from e

    def _run(self, batch: Any) -> torch.Tensor:
        self.zero_grad()
        total = self.forward_backward(batch)
        self.update()
        return total

    # The step's three parts, for a loop of the user's own (memfit.apply): ``step.zero_grad()``,
    # ``loss = step.forward_backward(batch)`` and ``step.update()`` in place of
    # ``optimizer.zero_grad()``, ``loss = loss_fn(model, batch); loss.backward()`` and
    # ``optimizer.step()``. ``run`` is the three in order.

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none``: their memory is freed until backward makes them)."""
        self.phase = "zero_grad"
        with self._observer.phase("zero_grad"):
            self.optimizer.zero_grad(set_to_none=True)
        self.phase = "idle"

    def forward_backward(self, batch: Any) -> torch.Tensor:
        """Forward and backward of ``batch`` (in the plan's micro-batches, under its precision and
        contexts, the loss scaled for fp16); gradients accumulate. Returns the batch's loss, detached."""
        obs, n = self._observer, self.num_micro_batches
        batch = self.precision.prepare_batch(batch)
        micro = (self.target.workload.split or split_batch)(batch, self.rank_batch_size, n) if n > 1 else [batch]
        total = None
        with contextlib.ExitStack() as around:
            for make in self._contexts:
                around.enter_context(make())
            for index in micro_batches_run(n):  # (all: NOTE [ Repeated micro-batches, traced once ])
                mb = micro[index]
                self.phase = "forward"
                with obs.phase("forward"), self.precision.autocast(self._device_type), contextlib.ExitStack() as fwd:
                    for make in self._forward_contexts:
                        fwd.enter_context(make())
                    loss = self.loss_fn(self.model, mb)
                    _check_loss(loss)
                    if n > 1:
                        loss = loss / n
                self.phase = "backward"
                for hook in self._before_backward:
                    hook(index, n)
                with obs.phase("backward"):
                    self.scaler.scale(loss).backward()
                total = loss.detach() if total is None else total + loss.detach()
                del loss
        self.phase = "idle"
        return total

    def update(self) -> None:
        """The optimizer step, with the hooks the plan runs before it (clipping) and after it (EMA,
        the loss scaler's update)."""
        self.phase = "optimizer"
        with self._observer.phase("optimizer"):
            for hook in self._before_update:
                hook(self)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            for hook in self._after_update:
                hook()
        self.phase = "idle"

    def __call__(self, batch: Any) -> float:
        return float(self.run(batch))

    def release(self) -> None:
        """Drop the model, optimizer and EMA (their memory is freed once nothing else holds them)."""
        self.model = self.optimizer = self.loss_fn = self.ema = None


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise UserError(f"loss(model, batch) must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise UserError(f"loss(model, batch) must return a scalar tensor, got shape {tuple(loss.shape)}; "
                        "reduce it (e.g. .mean())")
    if not loss.requires_grad:
        raise UserError("loss(model, batch) returned a tensor that does not require grad; "
                        "compute it from the model's output without .detach() or torch.no_grad()")


def build_step(workload: Workload | str | Target, plan: Plan | None = None, batch_size: int | None = None,
               device: Device | str | None = None, *, observer=None) -> TrainStep:
    """Build the model and optimizer of ``workload`` and apply ``plan``; returns the TrainStep.

    ``workload`` may be a resolved :class:`~memfit.target.Target` (then the other arguments are
    not given). The model is built under ``torch.device(...)`` (see memfit.devices.tensor_device),
    so calling this inside a ``FakeTensorMode`` builds it on fake tensors. ``observer`` watches
    the step from its first phase.
    """
    target = workload if isinstance(workload, Target) else Target.resolve(workload, plan, batch_size, device)
    wl = target.workload
    with torch.device(target.tensor_device), contextlib.ExitStack() as building:
        for config in target.plan.techniques:
            building.enter_context(config.build_context())
        record = building.enter_context(on_meta()) if wl.from_checkpoint else None
        model = call_workload("model()", wl.model)
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"workload model() must return an nn.Module, got {type(model).__name__}")
    if record is not None:
        record.host_tensors(model)
        # (a GPU preset traced on this CPU's fake tensors: the buffers' values matter to no one, and their
        # replay, on the host, would be counted as the device's; on a GPU, or a CPU device, it runs)
        preset_traced_here = target.device.kind == "cuda" and target.tensor_device == "cpu"
        _load(model, target, {} if preset_traced_here else record.buffer_values(model))
    with torch.device(target.tensor_device):
        model.train()
        parts = StepParts(model=model, device=target.device, device_type=target.tensor_device,
                          batch_size=target.rank_batch_size, placement=HostPlacement(),
                          loss_fn=checked("loss(model, batch)", wl.loss),
                          optimizer_factory=lambda ps: call_workload("optimizer(params)", wl.build_optimizer, ps),
                          plan=target.plan, loaded=wl.from_checkpoint)
        for config in target.plan.techniques:
            config.apply(parts)
        _bind_modules(parts)
        for finalize in parts.finalizers:
            finalize(parts)
        params = [p for p in parts.model.parameters() if p.requires_grad]
        if not params:
            quantized = not target.plan.config("base_weights").is_default and target.plan.config("adapter").is_default
            raise UserError("the workload's model has no trainable parameters" + (
                f" under base_weights {target.plan.base_weights} (quantized weights are frozen, and the model has no "
                "output layer left in full precision); train an adapter (adapter: lora:r=16)" if quantized else
                "; make some require grad in the workload's model(), or train an adapter (adapter: lora:r=16)"))
        optimizer = parts.make_optimizer(params, parts.optimizer_factory)
    return TrainStep(target, parts, optimizer, observer)


def _load(model: torch.nn.Module, target: Target, buffer_values: dict[str, torch.Tensor]) -> None:
    """The model built on the meta device, loaded as a checkpoint: the plan's conversions done while
    loading (quantizers), then each weight materialised on the step's device (NOTE in
    memfit.techniques.loading: Load as users load), the buffers the build computed given its values."""
    load = Load()
    for config in target.plan.techniques:
        config.on_load(model, load)
    for module in model.modules():  # NOTE [ Workload modules that place their own weights ]
        if hasattr(module, "memfit_on_load"):
            module.memfit_on_load(load)
    materialise(model, target.tensor_device, load, buffer_values)
    mark("loaded")  # (from_pretrained's own peak ends here: what the plan prepares after it is the build's)


# NOTE [ Workload modules that place their own weights ]
# Some trainers move weights between host and device as part of the step the user wrote: ai-toolkit's
# low_vram keeps the Wan 2.2 expert not running in host memory and swaps the two at a switch
# (memfit.workloads.wan_experts). That is the workload's behaviour, not a technique the plan chooses, so its
# module does it, through the same host placement the techniques use: a module with ``memfit_on_load(load)``
# says which of its weights a checkpoint's load leaves on the host, and one with ``memfit_bind(placement,
# device, loaded)`` is handed the step's placement (whose observer learns what is host memory) once the plan's
# techniques have prepared the model (its adapters exist by then).
def _bind_modules(parts: StepParts) -> None:
    device = torch.device(parts.device_type)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    for module in parts.model.modules():
        if hasattr(module, "memfit_bind"):
            module.memfit_bind(parts.placement, device, parts.loaded)


def make_batch(target: Target, *, whole: bool = False, device: str | None = None) -> Any:
    """One batch of what the target's step runs (one rank's share when sharded; ``whole``: the
    global batch all ranks share), on the step's device (or ``device``)."""
    with torch.device(device or target.tensor_device):
        batch = call_workload("batch(batch_size)", target.workload.batch,
                              target.batch_size if whole else target.rank_batch_size)
    if not any(isinstance(x, torch.Tensor) for x in tree_flatten(batch)[0]):
        raise UserError(f"the workload's batch(batch_size) returned {_kind(batch)} with no tensor in it; return a "
                        "tensor or a tuple/list/dict of tensors shaped [batch, ...]")
    return batch


def batch_bytes(target: Target) -> int:
    """The bytes of one batch of the target's step (one rank's share), from its shapes (built on the
    meta device: nothing is allocated)."""
    batch = make_batch(target, device="meta")
    return sum(x.numel() * x.element_size() for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor))


def _kind(obj: Any) -> str:
    text = repr(obj)
    return f"a {type(obj).__name__} ({text if len(text) <= 40 else text[:37] + '...'})"
