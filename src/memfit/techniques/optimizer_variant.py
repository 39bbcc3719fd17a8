"""What every optimizer variant of the plan key ``optimizer`` is (memfit.techniques.optimizers
lists the variants and their memory): how it takes the workload's hyperparameters and builds itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from memfit.techniques.base import Config, Export

HF_OPTIM_NAMES = {"adamw_bnb_8bit": "adamw8bit", "adafactor": "adafactor", "adamw_torch_8bit": "adamw8bit-ao",
                  "adamw_torch_4bit": "adamw4bit-ao", "paged_adamw_8bit": "adamw8bit-paged",
                  "paged_adamw_32bit": "adamw-paged"}
"""TrainingArguments' ``optim`` names of memfit's variants (what their exports write)."""
TRAINERS_OPTIM_NAMES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", **HF_OPTIM_NAMES,
                        "adamw_8bit": "adamw8bit"}
"""Every trainer optimizer name memfit runs -> its own: TrainingArguments' ``optim`` names and axolotl's
``adamw_8bit`` (bitsandbytes')."""

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def hyperparameters(group: dict) -> dict:
    """An optimizer param group's (or ``defaults``') lr, weight decay, betas and eps."""
    return {"lr": float(group.get("lr", 1e-4)), "weight_decay": float(group.get("weight_decay", 0.0)),
            "betas": tuple(group.get("betas", (0.9, 0.999))), "eps": float(group.get("eps", 1e-8))}


def regroup(params: list, like: torch.optim.Optimizer, options) -> list[dict]:
    """``params`` as param groups that follow ``like``'s (the workload's optimizer): each group's
    parameters with ``options(group)`` of the group they belong to there. Works for any subset
    (one parameter, as optimizer-in-backward and offloading build them)."""
    where = {p: i for i, g in enumerate(like.param_groups) for p in g["params"]}
    members: dict[int, list] = {}
    for p in params:
        members.setdefault(where.get(p, 0), []).append(p)
    return [{"params": ps, **options(like.param_groups[i])} for i, ps in members.items()]


def refuse_sharded_or_offloaded(plan, name: str, sharded: str, offloaded: str) -> None:
    """One line for optimizer ``name`` beside FSDP2 (``sharded``: why not) or offloaded states (``offloaded``: why
    not, and what to do)."""
    from memfit.errors import UserError
    if plan.config("shard").fsdp2:
        raise UserError(f"plan: optimizer {name} cannot be combined with shard (FSDP2): {sharded}; use shard: none, "
                        "or adamw with shard")
    states = plan.config("offload").states
    if states is not None:
        raise UserError(f"plan: optimizer {name} cannot be combined with offload: [{states}]{offloaded}")


def trained_and_workloads(parts) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer] | None:
    """The model's trained parameters and the workload's optimizer over them (whose groups a variant follows);
    None where nothing trains."""
    params = [p for p in parts.model.parameters() if p.requires_grad]
    return (params, parts.optimizer_factory(params)) if params else None


class OptimizerVariant(Config):
    """The plan key ``optimizer``: which optimizer the step builds, and what the planner asks of an
    optimizer alone (how it compiles, how fast it updates on the host, how small its states get)."""

    name = "adamw"
    compiles_per_weight_dtype: ClassVar[bool] = False
    """Compiles a graph per dtype of the weights (torchao's update: per parameter shape and
    dtype): the GPU-preset planner measures it once, at the smallest weights it searches (NOTE
    [ Compiled updates measured at the smallest weights ] in memfit.planner.baseline)."""
    slow_host_update: ClassVar[bool] = False
    """An optimizer whose update on host tensors (``offload: [optimizer_states]``, stepped on the
    host) is far slower than torch's fused host AdamW: torchao's low-bit update is a compiled,
    compute-bound CPU kernel (18.6 ns per element on 2 cores of an AMD EPYC, 47x torch's fused
    AdamW there: 125 s a step for 7B parameters). On the host its small states save no device
    memory, so the planner leaves that combination out (NOTE [ Low-bit states on the host ])."""
    state_bytes_at_least: ClassVar[float | None] = None
    """An optimizer's state bytes per trained parameter, at the least (None: not stated). With
    ``slow_host_update`` its states stay on the device in every searched plan, so the planner leaves
    it out where the weights in 16 bits and these states alone exceed the budget (NOTE [ States that
    cannot fit ])."""

    def values(self) -> dict:
        return {"optimizer": self.name}

    def factory(self, workload_factory: Factory, params: list[torch.nn.Parameter]) -> Factory:
        """A function building this optimizer for a list of parameters."""
        return workload_factory

    def apply(self, parts) -> None:
        params = [p for p in parts.model.parameters() if p.requires_grad]
        if params:  # (a model without trainable parameters is refused by build_step)
            parts.optimizer_factory = self.factory(parts.optimizer_factory, params)

    def label(self, batch_size):
        return self.name if self.name != "adamw" else None

    def ablations(self):
        return [(f"optimizer {self.name}", WorkloadOptimizer())] if self.name != "adamw" else []

    def states_aside(self) -> Config:
        return self.technique.default

    def ordered_in(self, plan) -> bool:
        """Offloaded states live on the host: their precision orders host memory, not the device's
        (a low-bit variant offloaded can even hold more on the device: its own temporaries)."""
        return plan.config("offload").states is None

    @classmethod
    def from_arguments(cls, given: Export) -> OptimizerVariant | None:
        """``TrainingArguments(optim=...)``: memfit's variants by the name their export writes; any
        other optimizer is the workload's own (the Trainer builds it, memfit's step too)."""
        optim = str(getattr(given.hf.get("optim"), "value", given.hf.get("optim")))
        if optim == "sgd" and "momentum" in str(given.hf.get("optim_args") or ""):
            return cls.technique.parse({"optimizer": "sgd"})
        name = HF_OPTIM_NAMES.get(optim)
        return cls.technique.parse({"optimizer": name}) if name else None

    def export(self, into: Export) -> None:
        into.hf["optim"] = {"adamw": "adamw_torch", "adamw8bit": "adamw_bnb_8bit", "adafactor": "adafactor",
                            "sgd": "sgd"}[self.name]
        into.axolotl["optimizer"] = into.hf["optim"]  # (axolotl's optimizer names are TrainingArguments')
        if self.name == "sgd":
            into.hf["optim_args"] = "momentum=0.9"  # SGDMomentum's one state buffer (the Trainer's default is 0)
        into.kohya["optimizer_type"] = {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "adafactor": "Adafactor",
                                        "sgd": "SGDNesterov"}[self.name]
        if self.name != "sgd":
            into.ai_toolkit["train.optimizer"] = self.name  # (ai-toolkit's names: adamw, adamw8bit, adafactor)
        if self.name != "adamw":  # Lightning: the LightningModule's configure_optimizers builds the optimizer
            into.not_carried(self, hf=False, kohya=False, ai_toolkit=self.name == "sgd", axolotl=False)


@dataclass(frozen=True)
class WorkloadOptimizer(OptimizerVariant):
    """The workload's own optimizer (default: AdamW)."""

    rank = 0


