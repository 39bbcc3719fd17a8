"""``memfit.apply``: a plan on the user's own model, optimizer and loss, for the user's own loop.

memfit's step is built in one place, ``build_step``, from a workload: functions that make the
model, the batch, the loss and the optimizer. ``apply`` makes that workload from what the user
already has (the model object, their loss, their optimizer factory) and calls ``build_step``: the
techniques are the same modules applied in the same order, and the step is the same TrainStep
that memfit's estimate, profile and ``memfit train`` run. A loop keeps its shape::

    step = memfit.apply(model, "plan.yaml", loss_fn=loss_fn, batch_size=32,
                        optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    for batch in loader:
        step.zero_grad()                       # optimizer.zero_grad()
        loss = step.forward_backward(batch)    # loss = loss_fn(model, batch); loss.backward()
        step.update()                          # optimizer.step()

(or ``loss = step(batch)`` for the three). ``step.model`` is the model as the plan changed it
(converted to bf16, blocks checkpointed, sharded), ``step.optimizer`` the optimizer it built.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from memfit.errors import UserError
from memfit.plans import Plan
from memfit.workload import Workload


def hf_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss of a model that computes its own (Hugging Face: ``model(**batch).loss``, with
    ``labels`` in the batch), or whose output is the loss."""
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None and isinstance(out, torch.Tensor) and out.numel() == 1:
        loss = out  # (a model that returns its loss)
    if not isinstance(loss, torch.Tensor):
        raise UserError("memfit.apply: the model's output has no loss (a Hugging Face model computes one when the "
                        "batch holds labels); pass loss_fn=lambda model, batch: ...")
    return loss


def workload_of(model: torch.nn.Module, *, batch_size: int, loss_fn=None, optimizer_factory=None,
                example_batch: Callable[[int], Any] | None = None, copies: bool = False) -> Workload:
    """A workload around a model that already exists: ``model()`` returns it (moved to the step's
    device), or, inside a fake trace (memfit's estimate) or under the meta device (the planner's
    look at the model's structure), a copy of it that holds no memory (its parameters and buffers
    become fake or meta tensors of the same shapes and dtypes). ``copies``: real steps get a deep
    copy too (what the planner times on a CPU, so that the user's model is left alone)."""
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"memfit.apply: model must be a torch.nn.Module, got {type(model).__name__}")

    def the_model() -> torch.nn.Module:
        from torch._guards import detect_fake_mode
        device = torch.get_default_device()  # (build_step builds under the step's device)
        if detect_fake_mode() is not None or device.type == "meta":
            return _fake_copy(model, device)
        return copy.deepcopy(model).to(device) if copies else model.to(device)

    def no_batch(n: int):
        raise UserError("memfit makes no batches of your data; pass example_batch=(batch_size -> batch) to estimate "
                        "this model's step")

    return Workload(model=the_model, batch=example_batch or no_batch, loss=loss_fn or hf_loss,
                    optimizer=optimizer_factory, name=type(model).__name__, default_batch_size=batch_size)


def _fake_copy(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` copied with new parameters and buffers made inside the trace (fake, and seen by
    memfit's tracker as the model's memory): copy.deepcopy with every tensor mapped to its new
    counterpart first, so no tensor data is copied."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:  # (tied weights stay tied)
            continue
        new = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
        memo[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(
            t, torch.nn.Parameter) else new
    return copy.deepcopy(model, memo)


def apply(model: torch.nn.Module, plan: Plan | str | Path | dict | None = None, *, batch_size: int,
          loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
          optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
          device: str = "auto", example_batch: Callable[[int], Any] | None = None, observer=None):
    """Apply ``plan`` to ``model`` and return its :class:`~memfit.step.TrainStep`.

    ``plan``: a Plan, a plan file (.yaml/.json), a dict of plan keys, or None (no technique).
    ``batch_size``: the samples of each batch the loop gives the step (a micro-batched plan splits
    it; with a sharded plan, this rank's batch). ``loss_fn(model, batch)``: default
    ``model(**batch).loss``. ``optimizer_factory(params)``: default AdamW(lr=1e-4); it is called on
    the parameters the plan leaves trainable, after the plan converted or sharded them (a plan may
    wrap it: per-parameter optimizers for in-backward updates, offloaded states). ``device``: auto
    (cuda when available), cpu or cuda; the model is moved there. ``example_batch(batch_size)``: a
    batch maker, for memfit's estimate of this step (:func:`estimate_applied`).
    """
    from memfit.step import build_step
    return build_step(target_of(model, plan, batch_size=batch_size, loss_fn=loss_fn,
                                optimizer_factory=optimizer_factory, device=device, example_batch=example_batch),
                      observer=observer)


def target_of(model: torch.nn.Module, plan=None, *, batch_size: int, loss_fn=None, optimizer_factory=None,
              device: str = "auto", example_batch=None):
    """The :class:`~memfit.target.Target` of :func:`apply`'s step (also what memfit estimates for it)."""
    from memfit.devices import get_device
    from memfit.target import Target

    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise UserError(f"memfit.apply: batch_size must be a whole number >= 1, got {batch_size!r}")
    plan = as_plan(plan)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise UserError(f"memfit.apply: device {device!r}: choose auto, cpu or cuda")
    ranks = plan.config("shard").world_size  # (the loop gives each rank its own share)
    workload = workload_of(model, batch_size=batch_size * ranks, loss_fn=loss_fn, optimizer_factory=optimizer_factory,
                           example_batch=example_batch)
    return Target.resolve(workload, plan, batch_size * ranks, get_device(device))


def estimate_applied(model: torch.nn.Module, plan=None, *, batch_size: int, example_batch, loss_fn=None,
                     optimizer_factory=None, device: str = "auto"):
    """memfit's prediction (a MemoryReport) of the step :func:`apply` builds for these arguments,
    traced on a fake copy of ``model``."""
    from memfit.memory.estimate import estimate_target
    return estimate_target(target_of(model, plan, batch_size=batch_size, loss_fn=loss_fn,
                                     optimizer_factory=optimizer_factory, device=device, example_batch=example_batch))


def as_plan(plan, who: str = "memfit.apply") -> Plan:
    """A Plan from what :func:`apply` takes: a Plan, a plan file, a dict of plan keys or None
    (``who``: the caller an error names)."""
    if plan is None:
        return Plan()
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise UserError(f"{who}: plan must be a Plan, a plan file or a dict of plan keys, got {type(plan).__name__}")
