"""Optimizer step in backward: no moment when every gradient exists at once.

Normally all gradients are alive together between backward and the optimizer step (N bytes for N
bytes of parameters). ``optimizer_in_backward`` steps each parameter as soon as its gradient has
been accumulated and frees that gradient at once (``register_post_accumulate_grad_hook``, as in
torchtune), so at most a few gradients exist at any time instead of all of them. The update does
the same arithmetic, so training is unchanged; it costs one optimizer per parameter (more, smaller
kernel launches).

It cannot accumulate gradients over micro-batches, unscale fp16 gradients (inf checks need all
gradients), or clip by the global norm: the plan refuses those combinations.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from memfit.errors import UserError
from memfit.techniques.base import Config, Export, Key, Technique, register
from memfit.techniques.optimizer_variant import Factory
from memfit.techniques.optimizers import PerParameterOptimizers


class OptimizerInBackward(PerParameterOptimizers):
    """Each parameter's optimizer is stepped from its post-accumulate-grad hook.

    As the step's optimizer, ``step()`` and ``zero_grad()`` do nothing: the work happened in backward.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], factory: Factory):
        super().__init__(params, factory)
        self._handles = [p.register_post_accumulate_grad_hook(self._step_param) for p in self.params]

    def _step_param(self, p: torch.nn.Parameter) -> None:
        opt = self.optimizers[p]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(self, closure=None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()


class UpdateTiming(Config):
    def values(self) -> dict:
        return {"optimizer_in_backward": isinstance(self, StepInBackward)}

    def states_aside(self) -> Config:
        return self.technique.default


@dataclass(frozen=True)
class StepAfterBackward(UpdateTiming):
    """The optimizer steps once, after backward (the default)."""

    rank = 0


@dataclass(frozen=True)
class StepInBackward(UpdateTiming):
    """Step and free each parameter's gradient as soon as it is accumulated."""

    rank = 1
    adds_work = True

    def check(self, plan) -> None:
        if plan.grad_accum_steps > 1:
            raise UserError("plan: optimizer_in_backward steps each gradient as soon as it is ready, so it "
                            "cannot accumulate micro-batches; set grad_accum_steps: 1 or optimizer_in_backward: false")
        if plan.micro_batch_size is not None:
            raise UserError("plan: optimizer_in_backward cannot accumulate micro-batches; remove micro_batch_size")
        if plan.config("precision").scaled:
            raise UserError("plan: optimizer_in_backward cannot unscale fp16 gradients with a GradScaler "
                            "(inf checks need all gradients); use bf16 or set optimizer_in_backward: false")

    def apply(self, parts) -> None:
        parts.make_optimizer = OptimizerInBackward
        parts.updates_in_backward = True

    def label(self, batch_size):
        return "inbw"

    def ablations(self):
        return [("optimizer in backward", StepAfterBackward())]

    def export(self, into: Export) -> None:
        into.kohya["fused_backward_pass"] = True  # (sd-scripts' full fine-tuning with Adafactor only: kohya_export)
        into.not_carried(self, kohya=False, ai_toolkit=True)


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise UserError(f"--optimizer-in-backward {text!r}: give true or false")
    return text.lower() in ("true", "1", "yes")


def parse(values: dict) -> UpdateTiming:
    value = values["optimizer_in_backward"]
    if not isinstance(value, bool):
        raise UserError(f"plan: optimizer_in_backward must be true or false, got {value!r}")
    return StepInBackward() if value else StepAfterBackward()


TECHNIQUE = register(
    Technique("optimizer_in_backward", (Key("optimizer_in_backward", False, "Step and free each parameter's "
                                            "gradient as soon as it is accumulated.", annotation="bool",
                                            from_text=_flag, metavar="BOOL"),),
              parse, search=lambda ctx: [False, True]),
    UpdateTiming, StepAfterBackward, StepInBackward)
