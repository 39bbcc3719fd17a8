"""Optimizer variants: smaller optimizer states.

Memory/compute trade-off, per parameter of N bytes in fp32:
- ``adamw`` (:class:`WorkloadOptimizer`) keeps two fp32 moments (2N). The workload's own
  optimizer is used as is.
- ``adamw8bit`` (:class:`AdamW8bit`) keeps both moments block-quantised to 8 bits (N/2 plus small
  per-block scales); the update dequantises one block at a time. Lossy, well tested on LLM
  training. Needs bitsandbytes: without it the step runs fp32 AdamW, and memfit predicts (and
  labels) that.
- ``adafactor`` (:class:`Adafactor`) keeps factored second moments (row and column statistics, ~0
  for matrices) and no first moment: the smallest state, a slightly different optimizer.
- ``sgd`` (:class:`SGDMomentum`) with momentum keeps one buffer (N).
- ``adamw8bit-ao`` / ``adamw4bit-ao`` / ``adamwfp8-ao``: torchao's low-bit AdamW (8-bit, 4-bit and fp8
  moments: N/2, N/4, N/2), in :mod:`memfit.techniques.optimizers_torchao`. Need torchao (``memfit[ao]``).
- ``adamw8bit-paged`` / ``adamw-paged``: bitsandbytes' paged AdamW (8-bit and fp32 moments) with its
  large states in CUDA managed memory, outside PyTorch's allocator, in
  :mod:`memfit.techniques.optimizers_paged`. Need bitsandbytes.
- ``galore`` / ``galore8bit`` / ``apollo`` / ``apollo-mini``: low-rank and state-light optimizers
  (different optimizers, searched only when named), in :mod:`memfit.techniques.optimizers_lowrank`.
  Need ``memfit[galore]`` / ``memfit[apollo]``.
- ``prodigy``: Prodigy, Adam with a learned step size (a different optimizer, searched only when named; four
  states a parameter), in :mod:`memfit.techniques.optimizers_prodigy`. Needs ``memfit[prodigy]``.
- ``lion8bit``: bitsandbytes' Lion with one 8-bit momentum (a different optimizer, searched only when named:
  N bytes), in :mod:`memfit.techniques.optimizers_lion`. Needs bitsandbytes.
Hyperparameters (lr, weight decay, betas, eps) are taken from the workload's optimizer, group by
group: a workload that gives its biases and norms no weight decay keeps that (:func:`regroup`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from memfit.techniques.base import Key, SearchContext, Technique, choice, register
from memfit.techniques.bnb_optim import bitsandbytes_available, real_quantization_tables
from memfit.techniques.optimizer_variant import (
    Factory,
    OptimizerVariant,
    WorkloadOptimizer,
    hyperparameters,
    regroup,
)
from memfit.techniques.optimizers_lion import Lion8bit
from memfit.techniques.optimizers_lowrank import VARIANTS as LOWRANK_VARIANTS
from memfit.techniques.optimizers_lowrank import parse_lowrank
from memfit.techniques.optimizers_paged import VARIANTS as PAGED_VARIANTS
from memfit.techniques.optimizers_prodigy import Prodigy, parse_prodigy
from memfit.techniques.optimizers_torchao import VARIANTS as TORCHAO_VARIANTS
from memfit.techniques.optimizers_torchao import torchao_problem

NAMES = ("adamw", "adamw8bit", "adafactor", "sgd", "adamw8bit-ao", "adamw4bit-ao", "adamwfp8-ao", "adamw8bit-paged",
         "adamw-paged", "galore", "galore8bit", "apollo", "apollo-mini", "prodigy", "lion8bit")
ADAMW_CLASS = ("adamw", "adamw8bit", "adamw8bit-ao", "adamw4bit-ao", "adamwfp8-ao", "adamw8bit-paged", "adamw-paged")
"""``--optimizers adamw-class``: AdamW at any state precision, its states offloaded, paged or not. The
planner's default for GPU presets, but the torchao variants with adamw8bit's state bytes where
bitsandbytes is there (NOTE [ Same states, a slower update ]). On the CPU, where the planner times
real steps, torchao's updates compile with inductor first and nothing is paged, the default is adamw
and adamw8bit."""
CPU_DEFAULT = ("adamw", "adamw8bit")


def default_optimizers(device) -> tuple[str, ...]:
    """The optimizer variants the planner searches unless told (``--optimizers``)."""
    return ADAMW_CLASS if device.is_gpu else CPU_DEFAULT
ADAMW8BIT_FALLBACK = ("optimizer adamw8bit needs bitsandbytes (pip install bitsandbytes), which is not installed "
                      "here: the step runs torch.optim.AdamW with fp32 states instead")


@dataclass(frozen=True)
class SGDMomentum(OptimizerVariant):
    """SGD with momentum 0.9: one state buffer."""

    name = "sgd"
    rank = 1
    numerics = "different optimizer: SGD with momentum"

    def factory(self, workload_factory, params):
        like = workload_factory(params)
        return lambda ps: torch.optim.SGD(regroup(ps, like, _lr_and_decay), lr=hyperparameters(like.defaults)["lr"],
                                          momentum=0.9)


@dataclass(frozen=True)
class Adafactor(OptimizerVariant):
    """torch.optim.Adafactor: factored second moments, no first moment."""

    name = "adafactor"
    rank = 2
    numerics = "different optimizer: Adafactor (factored second moments)"

    def factory(self, workload_factory, params):
        like = workload_factory(params)
        return lambda ps: torch.optim.Adafactor(regroup(ps, like, _lr_and_decay),
                                                lr=hyperparameters(like.defaults)["lr"])


@dataclass(frozen=True)
class AdamW8bit(OptimizerVariant):
    """bitsandbytes' 8-bit AdamW (fp32 AdamW, with a warning, where bitsandbytes is missing)."""

    name = "adamw8bit"
    rank = 1
    state_bytes_at_least = 2.0  # two 8-bit moments (and a scale per 256)
    numerics = "8-bit AdamW states"

    def factory(self, workload_factory, params):
        like = workload_factory(params)
        build = adamw8bit_factory(hyperparameters(like.defaults))
        return lambda ps: build(regroup(ps, like, hyperparameters))

    def notes(self) -> list[str]:
        return [] if bitsandbytes_available() else [f"{ADAMW8BIT_FALLBACK}; this estimate is for that fallback"]

    def trace_context(self) -> contextlib.AbstractContextManager:
        return real_quantization_tables()



def _lr_and_decay(group: dict) -> dict:
    hp = hyperparameters(group)
    return {"lr": hp["lr"], "weight_decay": hp["weight_decay"]}


def adamw8bit_factory(hp: dict) -> Factory:
    if not bitsandbytes_available():
        warnings.warn(f"{ADAMW8BIT_FALLBACK}; memory predictions are for that fallback", stacklevel=2)
        return lambda ps: torch.optim.AdamW(ps, lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                            weight_decay=hp["weight_decay"])
    from bitsandbytes.optim import AdamW8bit as BnbAdamW8bit
    # min_8bit_size: tensors smaller than this keep fp32 states (bitsandbytes' default is 4096)
    return lambda ps: BnbAdamW8bit(ps, lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"per_param": [opt.state_dict() for opt in self.optimizers.values()]}

    def load_state_dict(self, state: dict) -> None:
        for opt, sd in zip(self.optimizers.values(), state["per_param"]):
            opt.load_state_dict(sd)


def parse(values: dict) -> OptimizerVariant:
    text = str(values["optimizer"])
    if text.partition(":")[0] in LOWRANK_VARIANTS:
        return parse_lowrank(text)
    if text.partition(":")[0] == "prodigy":
        return parse_prodigy(text)
    name = choice("optimizer", text, NAMES)
    if name in TORCHAO_VARIANTS:
        return TORCHAO_VARIANTS[name]()
    if name in PAGED_VARIANTS:
        return PAGED_VARIANTS[name]()
    return {"adamw": WorkloadOptimizer(), "adamw8bit": AdamW8bit(), "adafactor": Adafactor(),
            "sgd": SGDMomentum(), "lion8bit": Lion8bit()}[name]


def search(ctx: SearchContext) -> list[str]:
    names = list(ctx.options.get("optimizers") or default_optimizers(ctx.device))
    needs_bnb = [n for n in names if n in ("adamw8bit", "lion8bit") or n in PAGED_VARIANTS]
    if needs_bnb and not bitsandbytes_available():  # predicted = what runs: never plan a fallback
        for name in needs_bnb:
            names.remove(name)
        ctx.notes.append(f"{', '.join(needs_bnb)} left out: bitsandbytes is not installed here (pip install bitsandbytes)")
        warnings.warn(f"plan: {ctx.notes[-1]}", stacklevel=2)
    for name in [n for n in names if n in TORCHAO_VARIANTS or n in LOWRANK_VARIANTS or n.startswith("prodigy")]:
        missing = torchao_problem(name) if name in TORCHAO_VARIANTS else parse({"optimizer": name}).problem()
        if missing:
            names.remove(name)
            ctx.notes.append(f"{name} left out: {missing.removeprefix('plan: ')}")
    if not ctx.options.get("optimizers"):
        _leave_out_same_states_slower(names, ctx)
    return names


# NOTE [ Same states, a slower update ]
# On a GPU preset, torchao's adamw8bit-ao and adamwfp8-ao hold the same state bytes as bitsandbytes'
# adamw8bit (two 8-bit moments and a scale per 256 values; tensors under 4096 values in fp32 in
# all three), and step each parameter through a torch.compile'd call where bitsandbytes launches
# one fused kernel. Measured on an H100 (tests/data/h100.jsonl, GPT-2 124M at 8 x 1024, bf16-pure):
# 9.261 GiB allocated at peak with adamw8bit against 9.256 with adamw8bit-ao (rows 70 and 88), 73.5
# ms a step against 104.7; with micro-batches of 4, checkpointing and chunked loss 1.230 GiB against
# adamwfp8-ao's 1.229, 172.8 ms against 191.4 (rows 110 and 98). No budget they fit makes them the
# faster choice, and each cost the planner its compiles (one graph per parameter shape: 5 to 17 s
# of a worker on a cold cache, GPT-2's 2 GiB plan 84 s with them). So where adamw8bit is searched and
# the user named no optimizers, the torchao variants with states no smaller are left out, with a
# note; adamw4bit-ao (half the bytes) stays, and ``--optimizers`` (or a plan) names any of them.
def _leave_out_same_states_slower(names: list[str], ctx: SearchContext) -> None:
    """NOTE [ Same states, a slower update ] (GPU presets, the default optimizer list)."""
    if not ctx.device.is_gpu or "adamw8bit" not in names:
        return
    same = [n for n in names if n in TORCHAO_VARIANTS
            and TORCHAO_VARIANTS[n].state_bytes_at_least >= AdamW8bit.state_bytes_at_least]
    for name in same:
        names.remove(name)
    if same:
        ctx.notes.append(f"{', '.join(same)} left out: the same state bytes as adamw8bit (bitsandbytes) and a "
                         "slower update (a compiled call per parameter; measured on an H100); name them with "
                         "--optimizers to search them")


TECHNIQUE = register(
    Technique("optimizer", (Key("optimizer", "adamw", "adamw | adamw8bit (bitsandbytes) | adafactor | sgd | "
                                "adamw8bit-ao | adamw4bit-ao | adamwfp8-ao (torchao's 8-bit, 4-bit, fp8 states) | "
                                "adamw8bit-paged | adamw-paged (bitsandbytes' paged states, in CUDA managed memory) | "
                                "galore | galore8bit | apollo | apollo-mini (different optimizers, low-rank; options "
                                "as galore:rank=64,update_proj_gap=200,scale=0.25) | prodigy (a different optimizer: "
                                "Adam with a learned step size; prodigy:slice_p=11 keeps less) | lion8bit (a different "
                                "optimizer: Lion, one 8-bit momentum; bitsandbytes).",
                                metavar="OPTIMIZER"),),
              parse, search=search),
    OptimizerVariant, WorkloadOptimizer, SGDMomentum, Adafactor, AdamW8bit, *TORCHAO_VARIANTS.values(),
    *PAGED_VARIANTS.values(), *LOWRANK_VARIANTS.values(), Prodigy, Lion8bit)
