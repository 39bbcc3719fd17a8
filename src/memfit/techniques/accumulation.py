"""Micro-batches with gradient accumulation: the same batch, a fraction of the activations.

Activations grow with the batch. Splitting a global batch of B samples into B/m micro-batches
of m, each run forward and backward before one optimizer step, keeps only one micro-batch's
activations alive at a time; the loss of each is divided by the number of micro-batches, so the
accumulated gradients equal those of the whole batch (the training is unchanged, up to float
summation order). The cost: smaller matmuls (lower GPU utilisation) and a kernel launch overhead
per micro-batch. Parameters, gradients and optimizer states are unchanged.

Plan keys ``micro_batch_size`` (m; null = the whole batch) and ``grad_accum_steps`` (k = B/m): give
one or the other, or both when they agree. This is also the first remedy of OOM adaptation: the
same batch, re-split into the largest micro-batch predicted to fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import UserError
from memfit.techniques.base import AdaptContext, Config, Export, Key, Technique, register, whole_number


@dataclass(frozen=True)
class Accumulation(Config):
    """Run the batch as micro-batches and accumulate their gradients."""

    micro_batch_size: int | None = None
    """Samples per forward/backward; None means the whole batch at once."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step."""

    def __post_init__(self) -> None:
        k, m = self.grad_accum_steps, self.micro_batch_size
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise UserError(f"plan: grad_accum_steps must be a whole number >= 1, got {k!r}")
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise UserError(f"plan: micro_batch_size must be null or a whole number >= 1, got {m!r}")

    def values(self) -> dict:
        return {"micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps}

    @property
    def accumulates(self) -> bool:
        """Whether gradients may be accumulated over several micro-batches."""
        return self.micro_batch_size is not None or self.grad_accum_steps > 1

    def micro_batches(self, batch_size: int) -> tuple[int, int]:
        """(micro_batch_size, number of micro-batches) for a global batch; raises if it does not divide."""
        if batch_size < 1:
            raise UserError(f"batch size must be >= 1, got {batch_size}")
        k, m = self.grad_accum_steps, self.micro_batch_size
        if m is None:
            if batch_size % k:
                raise UserError(f"batch size {batch_size} is not divisible into grad_accum_steps={k} micro-batches; "
                                f"pick a batch size that is a multiple of {k}")
            return batch_size // k, k
        if batch_size % m:
            raise UserError(f"batch size {batch_size} is not a multiple of micro_batch_size={m}; "
                            f"use a batch size that is a multiple of {m} or another micro_batch_size")
        n = batch_size // m
        if k != 1 and k != n:
            raise UserError(f"micro_batch_size={m} gives {n} micro-batches for batch size {batch_size} but "
                            f"grad_accum_steps={k}; give only one of them")
        return m, n

    def apply(self, parts) -> None:
        parts.micro_batch_size, parts.num_micro_batches = self.micro_batches(parts.batch_size)

    def saves_at_most(self, other: Config, batch_size: int) -> bool:
        return self.micro_batches(batch_size)[0] >= other.micro_batches(batch_size)[0]

    def frugal(self, ctx: AdaptContext):
        """The largest smaller micro-batch predicted to fit (``ctx.fits``), else half; none where the
        samples depend on each other (a contrastive loss: another objective)."""
        if ctx.coupled_samples:
            return None
        m, _ = self.micro_batches(ctx.batch_size)
        smaller = [d for d in range(m // 2, 0, -1) if ctx.batch_size % d == 0]
        candidates = []
        for d in smaller:
            try:  # a plan that cannot accumulate (optimizer in backward) refuses micro-batches
                candidates.append((d, ctx.plan.with_config(Accumulation(micro_batch_size=d))))
            except UserError:
                return None
        if not candidates:
            return None
        chosen, predicted = candidates[0], False
        if ctx.fits is not None:
            chosen = next((c for c in candidates if ctx.fits(c[1])), candidates[-1])
            predicted = ctx.fits(chosen[1])
        d = chosen[0]
        return (Accumulation(micro_batch_size=d),
                f"micro_batch_size {d} x {ctx.batch_size // d} accumulation steps (same effective batch"
                + ("; the largest predicted to fit)" if predicted else ")"))

    @classmethod
    def from_arguments(cls, given: Export) -> Accumulation | None:
        """``TrainingArguments(gradient_accumulation_steps=n)``: micro-batches of the batch per device;
        Lightning's ``accumulate_grad_batches`` accumulates whole DataLoader batches (no plan of one)."""
        if given.hf.get("gradient_accumulation_steps", 1) > 1:
            return Accumulation(micro_batch_size=given.hf["per_device_train_batch_size"])
        return None

    def label(self, batch_size):
        if not self.accumulates:
            return None
        return f"mb{self.micro_batches(batch_size)[0] if batch_size else self.micro_batch_size}"

    def ablations(self):
        return [("micro-batches", Accumulation())] if self.accumulates else []

    def export(self, into: Export) -> None:
        micro, n = self.micro_batches(into.batch_size)
        into.hf.update(per_device_train_batch_size=micro, gradient_accumulation_steps=n)
        into.axolotl.update(micro_batch_size=micro, gradient_accumulation_steps=n)
        into.kohya.update(train_batch_size=micro, gradient_accumulation_steps=n)
        into.ai_toolkit.update({"train.batch_size": micro, "train.gradient_accumulation": n})
        into.lightning["accumulate_grad_batches"] = n
        into.lightning_notes.append(f"DataLoader(batch_size={micro})" + (
            f": {n} of them make the plan's batch of {micro * n}" if n > 1 else ": the plan's batch"))


def _micro_batch_text(text: str):
    return None if text in ("null", "none") else whole_number("--micro-batch-size")(text)


def parse(values: dict) -> Accumulation:
    return Accumulation(micro_batch_size=values["micro_batch_size"], grad_accum_steps=values["grad_accum_steps"])


TECHNIQUE = register(
    Technique("accumulation", (
        Key("micro_batch_size", None, "Samples per forward/backward; None means the whole batch at once.",
            annotation="int | None", from_text=_micro_batch_text, metavar="MICRO"),
        Key("grad_accum_steps", 1, "Micro-batches accumulated per optimizer step.", annotation="int",
            from_text=whole_number("--grad-accum-steps"), metavar="GRAD"),
    ), parse, escalation=10),
    Accumulation)
