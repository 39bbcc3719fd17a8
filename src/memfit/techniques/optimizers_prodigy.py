"""Prodigy: Adam whose step size it learns itself (D-adaptation), a different optimizer with twice AdamW's states.

Memory/compute trade-off, per trained parameter of N elements of b bytes (its dtype):
- AdamW keeps ``exp_avg`` and ``exp_avg_sq``: 2Nb.
- ``prodigy`` (:class:`Prodigy`: ``prodigyopt.Prodigy``, Mishchenko and Defazio, 2023) keeps those two, and
  ``s`` (a decayed sum of the gradients) and ``p0`` (the parameter as it was at the first step), N/slice_p
  elements each: 4Nb at ``slice_p=1``, its default. ``prodigy:slice_p=11`` (the library's advice for
  memory) keeps every 11th value of ``s`` and ``p0``: about 2.2Nb. A parameter that is all zeros at the
  first step (a LoRA's B, which PEFT initialises to zeros) keeps a scalar ``p0``.
- Each step reads two sums back to the host per parameter (``.item()``: the estimate of the step size) and
  updates each parameter through one temporary of its size (the denominator), one parameter at a time.
Its ``lr`` is a multiplier of the step size it learns: 1.0, as kohya's sd-scripts (``optimizer_type =
"Prodigy"``) and ai-toolkit (``optimizer: prodigy``) run it for LoRAs; the workload's betas and weight decay
(decoupled) are kept, group by group. A different optimizer: the planner searches it only when named.
Optional extra: ``pip install 'memfit[prodigy]'``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import weakref
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.errors import UserError
from memfit.techniques.optimizer_variant import (
    OptimizerVariant,
    hyperparameters,
    refuse_sharded_or_offloaded,
    regroup,
    trained_and_workloads,
)

REQUIREMENT = "prodigyopt>=1.1,<1.2"
ZERO_AT_START = ("lora_B", "lora_embedding_A")
"""PEFT's LoRA matrices that start at zeros (``init_lora_weights=True``, its default): Prodigy's ``p0`` of
such a parameter is a scalar."""


@dataclass(frozen=True)
class Prodigy(OptimizerVariant):
    """prodigyopt's Prodigy with ``lr=1`` (see the module docstring)."""

    name = "prodigy"
    rank = None  # (a different optimizer: not ordered by memory against AdamW's variants)
    numerics = "different optimizer: Prodigy (Adam with a learned step size)"
    slice_p: int = 1
    """Prodigy's ``slice_p``: ``s`` and ``p0`` keep every slice_p-th value."""

    def values(self) -> dict:
        return {"optimizer": self.name + (f":slice_p={self.slice_p}" if self.slice_p != 1 else "")}

    def label(self, batch_size):
        return self.name

    def problem(self) -> str | None:
        """Why Prodigy cannot run here (None: it can): prodigyopt is missing."""
        if importlib.util.find_spec("prodigyopt") is None:
            return (f"plan: optimizer {self.name} needs prodigyopt, which is not installed; pip install "
                    f"'memfit[prodigy]' ({REQUIREMENT})")
        return None

    def check(self, plan) -> None:
        problem = self.problem()
        if problem:
            raise UserError(problem)
        if plan.optimizer_in_backward:
            raise UserError("plan: optimizer prodigy cannot step in backward: its step size is learned from every "
                            "parameter together, and in backward each parameter has an optimizer of its own; use "
                            "optimizer_in_backward: false with prodigy")
        refuse_sharded_or_offloaded(plan, self.name, "its step-size estimate sums over every parameter on every rank",
                                    " (memfit offloads AdamW's states); use offload: [] with prodigy, or an AdamW variant")

    def apply(self, parts) -> None:
        found = trained_and_workloads(parts)
        if found is None:
            return
        like = found[1]
        zero = frozenset(id(p) for n, p in parts.model.named_parameters()
                         if p.requires_grad and any(f".{k}." in f".{n}." for k in ZERO_AT_START))
        cls, slice_p = prodigy_class(), self.slice_p

        def group(g: dict) -> dict:
            hp = hyperparameters(g)
            return {"lr": 1.0 if hp["lr"] > 0 else 0.0, "betas": hp["betas"], "weight_decay": hp["weight_decay"]}

        def build(ps):
            optimizer = cls(regroup(ps, like, group), lr=1.0, eps=hyperparameters(like.defaults)["eps"],
                            slice_p=slice_p)
            _STARTS_AT_ZERO[optimizer] = zero
            return optimizer
        parts.optimizer_factory = build

    def trace_context(self) -> contextlib.AbstractContextManager:
        return answered_reads() if self.problem() is None else contextlib.nullcontext()

    def export(self, into) -> None:
        into.not_carried(self, kohya=self.slice_p != 1, ai_toolkit=self.slice_p != 1)
        into.kohya["optimizer_type"] = "Prodigy"
        into.ai_toolkit["train.optimizer"] = "prodigy"


def prodigy_class() -> type:
    from prodigyopt import Prodigy as ProdigyOptimizer
    return ProdigyOptimizer


def parse_prodigy(text: str) -> Prodigy:
    """``prodigy`` or ``prodigy:slice_p=11``."""
    _, _, options = str(text).partition(":")
    values = {}
    for part in filter(None, options.split(",")):
        key, _, value = part.partition("=")
        if key != "slice_p" or not value.isdigit() or int(value) < 1:
            raise UserError(f"plan: optimizer {text!r}: its option is slice_p, a whole number >= 1 (e.g. "
                            "prodigy:slice_p=11)")
        values["slice_p"] = int(value)
    return replace(Prodigy(), **values)


# NOTE [ Prodigy's reads on fake tensors ]
# Prodigy's step asks three things of values: at its first step, ``if p.any()`` (a parameter of zeros keeps
# a scalar ``p0``), then per parameter ``torch.dot(g, p0 - p).item()`` and ``s.abs().sum().item()``, whose
# total of the latter, if 0, returns before any parameter is updated. Fake tensors have no values, and the
# trace's general assumptions (NOTE [ Assumed scalars ] in memfit.memory.tracker: ``.any()`` False, a read
# 0) are a step of no gradient: every ``p0`` a scalar and no update. A real step has gradients. So during
# Prodigy's step the trace answers as a real first step does: ``p.any()`` is True but for the matrices PEFT
# starts at zeros (:data:`ZERO_AT_START`), and each sum is positive, so the update runs, with its
# temporaries. The answers decide which tensors exist, not their sizes; the values they feed (the step
# size) are scalars. A model built by code (no checkpoint) whose biases start at zeros keeps their ``p0``
# scalar in a real run and not here: a bound, a bias's size each.
_STARTS_AT_ZERO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each memfit-built Prodigy's parameters that start at zeros (by ``id``)."""
aten = torch.ops.aten
_SCALAR_READS = (aten._local_scalar_dense.default, aten.is_nonzero.default)


class _ProdigyReads(TorchDispatchMode):
    """NOTE [ Prodigy's reads on fake tensors ], during one step of ``optimizer``."""

    def __init__(self, optimizer):
        super().__init__()
        self.params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.zero = _STARTS_AT_ZERO.get(optimizer, frozenset())
        self.anys: list[tuple[torch.Tensor, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.any.default and id(args[0]) in self.params:
            out = func(*args, **kwargs)
            self.anys.append((out, id(args[0]) not in self.zero))
            return out
        if func in _SCALAR_READS and _is_fake(args[0]):
            answer = next((value for out, value in self.anys if out is args[0]), None)
            if answer is not None:
                return answer
            if args[0].is_floating_point():
                return 1.0
        return func(*args, **kwargs)


@contextlib.contextmanager
def answered_reads():
    """Prodigy's steps answered as a real step's (NOTE [ Prodigy's reads on fake tensors ]), for the trace."""
    cls = prodigy_class()
    original = cls.step

    def step(self, closure=None):
        if not any(_is_fake(p) for g in self.param_groups for p in g["params"]):
            return original(self, closure)
        with _ProdigyReads(self):
            return original(self, closure)
    cls.step = step
    try:
        yield
    finally:
        cls.step = original


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)
