"""Optimizer variants and optimizer-in-backward.

Memory/compute trade-off, per parameter of N bytes in fp32:
- ``adamw`` keeps two fp32 moments (2N). The workload's own optimizer is used as is.
- ``adamw8bit`` keeps both moments block-quantised to 8 bits (N/2 plus small per-block scales);
  the update dequantises one block at a time. Lossy, well tested on LLM training. Needs
  bitsandbytes: without it the step runs fp32 AdamW, and memfit predicts (and labels) that.
- ``adafactor`` keeps factored second moments (row and column statistics, ~0 for matrices) and
  no first moment: the smallest state, a slightly different optimizer.
- ``sgd`` with momentum keeps one buffer (N).
Hyperparameters (lr, weight decay, betas, eps) are taken from the workload's optimizer.

``optimizer_in_backward`` steps each parameter as soon as its gradient has been accumulated and
frees that gradient at once (``register_post_accumulate_grad_hook``, as in torchtune), so at most
a few gradients exist at any time instead of all of them. It cannot accumulate gradients over
micro-batches, unscale fp16 gradients, or clip by the global norm: the Plan refuses those.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from memfit.errors import UserError

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"
    """adamw | adamw8bit | adafactor | sgd."""
    in_backward: bool = False
    """Step and free each gradient as soon as it is accumulated."""


def hyperparameters(opt: torch.optim.Optimizer) -> dict:
    d = opt.defaults
    return {"lr": float(d.get("lr", 1e-4)), "weight_decay": float(d.get("weight_decay", 0.0)),
            "betas": tuple(d.get("betas", (0.9, 0.999))), "eps": float(d.get("eps", 1e-8))}


def variant_factory(name: str, workload_factory: Factory, params: list[torch.nn.Parameter]) -> Factory:
    """A function building the ``name`` optimizer for a list of parameters."""
    if name == "adamw":
        return workload_factory
    hp = hyperparameters(workload_factory(params[:1]))
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=hp["lr"], momentum=0.9, weight_decay=hp["weight_decay"])
    if name == "adafactor":
        return lambda ps: torch.optim.Adafactor(ps, lr=hp["lr"], weight_decay=hp["weight_decay"])
    if name == "adamw8bit":
        return _adamw8bit_factory(hp)
    raise UserError(f"unknown optimizer {name!r}")


ADAMW8BIT_FALLBACK = ("optimizer adamw8bit needs bitsandbytes (pip install bitsandbytes), which is not installed "
                      "here: the step runs torch.optim.AdamW with fp32 states instead")


def bitsandbytes_available() -> bool:
    """Can ``adamw8bit`` run in this environment (bitsandbytes and its 8-bit AdamW import)?

    A missing or broken install counts as unavailable: the planner then leaves adamw8bit out and
    an explicit adamw8bit plan runs, and is estimated, as its fallback (fp32 AdamW)."""
    import logging
    # bitsandbytes warns at import about a 4-bit CPU matmul kernel memfit does not use
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
        from bitsandbytes.optim import AdamW8bit  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken install
        return False
    return True


def _adamw8bit_factory(hp: dict) -> Factory:
    if not bitsandbytes_available():
        warnings.warn(f"{ADAMW8BIT_FALLBACK}; memory predictions are for that fallback", stacklevel=2)
        return lambda ps: torch.optim.AdamW(ps, lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                            weight_decay=hp["weight_decay"])
    from bitsandbytes.optim import AdamW8bit
    # min_8bit_size: tensors smaller than this keep fp32 states (bitsandbytes' default is 4096)
    return lambda ps: AdamW8bit(ps, lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                weight_decay=hp["weight_decay"], min_8bit_size=4096)


class PerParameterOptimizers:
    """One optimizer per parameter, acting as one optimizer: ``state``, ``param_groups`` and
    ``state_dict()`` gather the per-parameter optimizers (what in-backward stepping and
    offloading one parameter's states at a time both need)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], factory: Factory):
        self.params = list(params)
        self.optimizers = {p: factory([p]) for p in self.params}
        self.param_groups = [g for opt in self.optimizers.values() for g in opt.param_groups]
        self.defaults = next(iter(self.optimizers.values())).defaults

    @property
    def state(self) -> dict:
        return {p: opt.state[p] for p, opt in self.optimizers.items() if p in opt.state}

    def state_dict(self) -> dict:
        return {"per_param": [opt.state_dict() for opt in self.optimizers.values()]}

    def load_state_dict(self, state: dict) -> None:
        for opt, sd in zip(self.optimizers.values(), state["per_param"]):
            opt.load_state_dict(sd)


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
