"""Gradient clipping by the global norm: what most fine-tuning recipes train with.

Hugging Face's Trainer clips at ``max_grad_norm: 1.0`` by default, Lightning at
``gradient_clip_val``, torchtune and torchtitan at ``max_norm``; a plan that fits without it is
not the training the user runs. Clipping rescales every gradient by ``min(1, max_norm / norm)``,
where ``norm`` is the 2-norm over all gradients together, after backward and before the optimizer
step (for fp16, after the GradScaler has unscaled them).

Memory/compute trade-off: it needs every gradient at once, so it cannot be combined with stepping
the optimizer inside backward (which frees each gradient as soon as it is ready); otherwise it
costs a read of every gradient and a write to scale them (memory-bound), and ``foreach`` norms
hold one small fp32 value per gradient tensor plus their stacked norm.

Plan key ``max_grad_norm``: null (:class:`NoClipping`) or a positive number (:class:`ClipGradNorm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.errors import UserError
from memfit.techniques.base import Config, Export, Key, Technique, register
from memfit.techniques.in_backward import StepInBackward


class GradClipping(Config):
    def values(self) -> dict:
        return {"max_grad_norm": self.max_norm}

    @classmethod
    def from_arguments(cls, given: Export) -> GradClipping | None:
        """``TrainingArguments(max_grad_norm=...)`` (0.0: none; the Trainer's default is 1.0),
        Lightning's ``Trainer(gradient_clip_val=...)`` by norm (unset: the plan decides)."""
        if "max_grad_norm" in given.hf:
            return parse({"max_grad_norm": given.hf["max_grad_norm"] or None})
        value = given.lightning.get("gradient_clip_val")
        if not value:
            return None
        if given.lightning.get("gradient_clip_algorithm", "norm") != "norm":
            raise UserError(f"Trainer(gradient_clip_algorithm={given.lightning['gradient_clip_algorithm']!r}): memfit "
                            "clips by the global norm only; use gradient_clip_algorithm='norm' or remove gradient_clip_val")
        return ClipGradNorm(float(value))


@dataclass(frozen=True)
class NoClipping(GradClipping):
    """Gradients reach the optimizer as backward made them."""

    max_norm = None

    def export(self, into: Export) -> None:
        into.hf["max_grad_norm"] = 0.0  # the Trainer clips at 1.0 unless told not to; Lightning does not clip
        into.kohya["max_grad_norm"] = 0.0  # (sd-scripts too)
        into.axolotl_notes.append("max_grad_norm: axolotl clips at the Trainer's default 1.0 where the plan clips nothing "
                                  "(the norms' few temporaries: plan with --max-grad-norm 1 to count them)")
        into.ai_toolkit_notes.append("max_grad_norm: ai-toolkit clips at its default 1.0 where the plan clips nothing "
                                     "(the norms' few temporaries: plan with --max-grad-norm 1 to count them)")


@dataclass(frozen=True)
class ClipGradNorm(GradClipping):
    """Scale all gradients together so that their global 2-norm is at most ``max_norm``."""

    max_norm: float = 1.0
    """The largest global gradient norm (> 0)."""
    adds_work = True

    def __post_init__(self) -> None:
        ok = isinstance(self.max_norm, (int, float)) and not isinstance(self.max_norm, bool) and self.max_norm > 0
        if not ok:
            raise UserError(f"plan: max_grad_norm must be null or a number > 0, got {self.max_norm!r}")
        object.__setattr__(self, "max_norm", float(self.max_norm))

    def check(self, plan) -> None:
        if isinstance(plan.config("optimizer_in_backward"), StepInBackward):
            raise UserError("plan: max_grad_norm needs every gradient at once, and optimizer_in_backward frees each "
                            "as soon as it is ready; set max_grad_norm: null or optimizer_in_backward: false")

    def apply(self, parts) -> None:
        parts.before_update.append(self._clip)

    def _clip(self, step) -> None:
        step.scaler.unscale_(step.optimizer)  # fp16: clip the true gradients (a no-op otherwise)
        # the gradients the optimizer steps with (host copies when its states are offloaded)
        params = [p for group in step.optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, self.max_norm)

    def label(self, batch_size):
        return f"clip={self.max_norm:g}"

    def export(self, into: Export) -> None:
        into.hf["max_grad_norm"] = into.kohya["max_grad_norm"] = into.ai_toolkit["train.max_grad_norm"] = self.max_norm
        into.axolotl["max_grad_norm"] = self.max_norm
        into.lightning.update(gradient_clip_val=self.max_norm, gradient_clip_algorithm="norm")


def _text(text: str):
    if text in ("null", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise UserError(f"--max-grad-norm {text!r} is not a number; give e.g. 1.0, or null") from None


def parse(values: dict) -> GradClipping:
    value = values["max_grad_norm"]
    return NoClipping() if value is None else ClipGradNorm(value)


TECHNIQUE = register(
    Technique("max_grad_norm", (Key("max_grad_norm", None, "Clip gradients to this global 2-norm before the "
                                    "optimizer step (null = no clipping).", annotation="float | None",
                                    from_text=_text, metavar="NORM"),),
              parse),
    GradClipping, NoClipping, ClipGradNorm)
