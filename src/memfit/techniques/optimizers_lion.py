"""Lion with 8-bit states: bitsandbytes' ``Lion8bit``, a different optimizer with a quarter of AdamW's state bytes.

Memory/compute trade-off, per trained parameter of N elements:
- AdamW keeps two fp32 moments: 8N bytes (``adamw8bit``: two 8-bit ones, 2N).
- ``lion8bit`` (:class:`Lion8bit`: ``bitsandbytes.optim.Lion8bit``; Chen et al., "Symbolic Discovery of
  Optimization Algorithms", 2023) keeps one momentum, block-quantised to 8 bits (N bytes and a scale per 256
  values; tensors under 4096 values keep it in fp32). Its update is the sign of an interpolation of the
  momentum and the gradient: every weight moves by the learning rate, so Lion wants a learning rate 3-10x
  smaller than AdamW's (the workload's is kept: set yours), and a larger weight decay.
kohya's sd-scripts (``optimizer_type = "Lion8bit"``) and ai-toolkit (``optimizer: lion8bit``) run it for LoRAs.
A different optimizer: the planner searches it only when named. Needs bitsandbytes (``memfit[bnb]``); without
it the plan is refused (no fallback: another optimizer is not this one).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from memfit.errors import UserError
from memfit.techniques.bnb_optim import bitsandbytes_available, real_quantization_tables
from memfit.techniques.optimizer_variant import (
    OptimizerVariant,
    hyperparameters,
    regroup,
    trained_and_workloads,
)


@dataclass(frozen=True)
class Lion8bit(OptimizerVariant):
    """bitsandbytes' Lion8bit with the workload's learning rate, betas (Lion's default 0.9, 0.99 where the
    workload's are AdamW's 0.9, 0.999) and weight decay."""

    name = "lion8bit"
    rank = None  # (a different optimizer: not ordered by memory against AdamW's variants)
    numerics = "different optimizer: Lion (sign of the momentum) with 8-bit states"

    def label(self, batch_size):
        return self.name

    def problem(self) -> str | None:
        """Why Lion8bit cannot run here (None: it can): bitsandbytes is missing."""
        if not bitsandbytes_available():
            return ("plan: optimizer lion8bit needs bitsandbytes, which is not installed; pip install "
                    "'memfit[bnb]' (bitsandbytes)")
        return None

    def check(self, plan) -> None:
        problem = self.problem()
        if problem:
            raise UserError(problem)

    def apply(self, parts) -> None:
        found = trained_and_workloads(parts)
        if found is None:
            return
        like = found[1]
        from bitsandbytes.optim import Lion8bit as BnbLion8bit

        def group(g: dict) -> dict:
            hp = hyperparameters(g)
            betas = (0.9, 0.99) if hp["betas"] == (0.9, 0.999) else hp["betas"]  # (AdamW's default: Lion's own)
            return {"lr": hp["lr"], "betas": betas, "weight_decay": hp["weight_decay"]}
        parts.optimizer_factory = lambda ps: BnbLion8bit(regroup(ps, like, group), min_8bit_size=4096,
                                                         **group(like.defaults))

    def trace_context(self) -> contextlib.AbstractContextManager:
        return real_quantization_tables()


    def export(self, into) -> None:
        into.not_carried(self, kohya=False, ai_toolkit=False)
        into.kohya["optimizer_type"] = "Lion8bit"
        into.ai_toolkit["train.optimizer"] = "lion8bit"
