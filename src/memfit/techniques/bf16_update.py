"""bf16-pure updates that do not lose small steps.

With weights in bf16 (8 bits of mantissa) an update smaller than about 1/256 of a weight rounds
away: late in training most updates are that small, so the weights stop moving. Two remedies,
both computing the update in fp32 and storing bf16:

- ``stochastic``: round the new fp32 weight up or down at random, with probabilities that make
  the rounding unbiased; small updates survive on average. No extra memory.
- ``kahan``: keep a bf16 compensation buffer per weight holding what rounding lost, and add it
  back at the next update (Kahan summation, as in AnyPrecisionAdamW). Costs N/2 bytes more.

The math runs over flat chunks of ``CHUNK`` elements, so its fp32 temporaries stay small even for
a large embedding. Optimizer states are bf16 (as the weights), like most bf16 fine-tuning recipes.

Plan key ``bf16_update``: ``nearest`` (:class:`NearestUpdate`: the optimizer's own rounding),
``stochastic`` / ``kahan`` (:class:`CompensatedUpdate`); with ``precision: bf16-pure`` and the
AdamW or SGD optimizer only, or ``stochastic`` with torchao's low-bit AdamW (its own
``bf16_stochastic_round``, inside its compiled update).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.errors import UserError
from memfit.techniques.base import Config, Export, Key, Technique, choice, register
from memfit.techniques.optimizer_variant import WorkloadOptimizer, hyperparameters, regroup
from memfit.techniques.optimizers import SGDMomentum
from memfit.techniques.precision import BF16Pure

CHUNK = 1 << 20
ROUNDINGS = ("nearest", "stochastic", "kahan")


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Unbiased rounding of fp32 to bf16: round up with probability (dropped bits) / 2**16."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32, generator=generator)
    truncated = bits & -65536  # 0xFFFF0000: the bf16 towards zero
    rounded = torch.where(noise < (bits & 0xFFFF), truncated + 65536, truncated)
    return rounded.view(torch.float32).to(torch.bfloat16)


class BF16Optimizer(torch.optim.Optimizer):
    """AdamW, Adam (weight decay added to the gradient) or SGD (with or without momentum) for bf16
    weights, fp32 math, stochastic or Kahan write-back. Param groups as torch's optimizers take them."""

    def __init__(self, params, kind: str, rounding: str, lr: float, weight_decay: float = 0.0,
                 betas=(0.9, 0.999), eps: float = 1e-8, momentum: float = 0.0):
        if kind not in ("adamw", "adam", "sgd") or rounding not in ("stochastic", "kahan"):
            raise UserError(f"BF16Optimizer: kind {kind!r} / rounding {rounding!r} not supported")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps,
                                      momentum=momentum))
        self.kind, self.rounding = kind, rounding

    def _init_state(self, p: torch.Tensor, momentum: float) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = 0
            names = ("exp_avg", "exp_avg_sq") if self.kind != "sgd" else ("momentum_buffer",) if momentum else ()
            for n in names:
                st[n] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if self.rounding == "kahan":
                st["compensation"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self._init_state(p, group["momentum"])
                st["step"] += 1
                t = st["step"]
                flat = {"p": p.view(-1), "g": p.grad.reshape(-1)}
                flat.update({k: v.view(-1) for k, v in st.items() if torch.is_tensor(v)})
                for start in range(0, p.numel(), CHUNK):
                    c = {k: v[start:start + CHUNK] for k, v in flat.items()}
                    g = c["g"].float()
                    w = c["p"].float()
                    if self.rounding == "kahan":
                        w += c["compensation"].float()
                    if self.kind != "sgd":
                        if self.kind == "adam" and wd:  # Adam's L2 penalty goes into the gradient
                            g.add_(w, alpha=wd)
                        m = c["exp_avg"].float().lerp_(g, 1 - b1)
                        v = c["exp_avg_sq"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                        c["exp_avg"].copy_(m)
                        c["exp_avg_sq"].copy_(v)
                        denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
                        if self.kind == "adamw":  # decoupled weight decay
                            w.mul_(1 - lr * wd)
                        w.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
                    else:
                        g.add_(w, alpha=wd) if wd else None
                        if group["momentum"]:
                            buf = c["momentum_buffer"].float()
                            buf = g if t == 1 else buf.mul_(group["momentum"]).add_(g)
                            c["momentum_buffer"].copy_(buf)
                            g = buf
                        w.add_(g, alpha=-lr)
                    if self.rounding == "kahan":
                        new = w.to(torch.bfloat16)
                        c["compensation"].copy_(w - new.float())
                        c["p"].copy_(new)
                    else:
                        c["p"].copy_(stochastic_round_to_bf16(w))
        return None


def compensated(factory, rounding: str):
    """Wrap an optimizer factory for bf16-pure weights: ``nearest`` keeps it as is."""
    if rounding == "nearest":
        return factory

    def build(params):
        like = factory(params)
        if getattr(like, "bf16_stochastic_round", None) is not None:  # torchao's low-bit AdamW: its own
            like.bf16_stochastic_round = True  # rounding in its compiled update (CompensatedUpdate.check: not kahan)
            return like
        d = like.defaults
        if isinstance(like, torch.optim.AdamW) or (isinstance(like, torch.optim.Adam)
                                                    and d.get("decoupled_weight_decay")):
            kind = "adamw"
        elif isinstance(like, torch.optim.Adam):
            kind = "adam"
        elif isinstance(like, torch.optim.SGD) and not d.get("nesterov") and not d.get("dampening"):
            kind = "sgd"
        else:
            raise UserError(f"bf16_update: {rounding} is implemented for AdamW, Adam and SGD (without nesterov or "
                            f"dampening), not this {type(like).__name__}; use bf16_update: nearest")
        groups = regroup(params, like, lambda g: {**hyperparameters(g), "momentum": float(g.get("momentum", 0.0))})
        return BF16Optimizer(groups, kind, rounding, lr=hyperparameters(d)["lr"])
    return build


class BF16Update(Config):
    rounding = "nearest"

    def values(self) -> dict:
        return {"bf16_update": self.rounding}


@dataclass(frozen=True)
class NearestUpdate(BF16Update):
    """The optimizer rounds its fp32 result to the nearest bf16 (small updates may be lost)."""


@dataclass(frozen=True)
class CompensatedUpdate(BF16Update):
    """Updates computed in fp32 and written back with stochastic rounding or Kahan compensation."""

    rounding: str = "stochastic"
    """stochastic (no extra memory) | kahan (a bf16 compensation buffer per weight)."""

    @property
    def numerics(self) -> str:
        return "stochastic rounding of bf16 updates" if self.rounding == "stochastic" else "Kahan-compensated bf16 updates"

    def check(self, plan) -> None:
        if not isinstance(plan.config("precision"), BF16Pure):
            raise UserError(f"plan: bf16_update: {self.rounding} applies to precision: bf16-pure only")
        from memfit.techniques.optimizers_torchao import TorchaoAdamW
        if self.rounding == "stochastic" and isinstance(plan.config("optimizer"), TorchaoAdamW):
            return  # (torchao's bf16_stochastic_round)
        if not isinstance(plan.config("optimizer"), (WorkloadOptimizer, SGDMomentum)):
            raise UserError(f"plan: bf16_update: {self.rounding} is implemented for adamw and sgd; "
                            f"use bf16_update: nearest with {plan.optimizer}")

    def apply(self, parts) -> None:
        parts.optimizer_factory = compensated(parts.optimizer_factory, self.rounding)

    def export(self, into: Export) -> None:
        into.not_carried(self)


def parse(values: dict) -> BF16Update:
    rounding = choice("bf16_update", values["bf16_update"], ROUNDINGS)
    return NearestUpdate() if rounding == "nearest" else CompensatedUpdate(rounding)


TECHNIQUE = register(
    Technique("bf16_update", (Key("bf16_update", "nearest", "With bf16-pure: how the update is rounded into bf16 "
                                  "weights: nearest | stochastic | kahan.", metavar="BF16"),),
              parse),
    BF16Update, NearestUpdate, CompensatedUpdate)
