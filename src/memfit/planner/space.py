"""The search space: every valid combination of techniques for a workload, device and batch.

Dimensions and the values tried (each only where it applies to the model and device):
precision (fp32, bf16 or fp16 per the device, bf16-pure), checkpointing (none, blocks:every=2,
selective, blocks; needs repeated blocks), optimizer (the workload's AdamW, adamw8bit; more with
``optimizers=``), optimizer_in_backward, offload (GPU presets only: on the CPU the host *is* the
device), loss_chunks (Hugging Face causal LMs), attention (auto, chunked; models with attention, CPU only),
and micro-batch size x accumulation keeping the global batch fixed. Invalid combinations are
dropped by the Plan's own validation.

Each dimension's values are ordered by how much memory they save (``rank``); the search uses
that order to prune plans that save less than one that already did not fit.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field

import torch

from memfit.devices import Device
from memfit.errors import UserError
from memfit.plans import Plan
from memfit.workload import Workload

# memory-saving rank of each value (higher saves more); values of equal rank are not compared
RANK = {
    "precision": {"fp32": 0, "bf16": 1, "fp16": 1, "bf16-pure": 2},
    "checkpointing": {"none": 0, "blocks:every=2": 1, "selective": 1, "blocks": 2},
    "optimizer": {"adamw": 0, "sgd": 1, "adamw8bit": 1, "adafactor": 2},
    "optimizer_in_backward": {False: 0, True: 1},
    "offload": {(): 0, ("optimizer_states",): 1, ("activations",): 1},
    "loss_chunks": {0: 0, 8: 1},
    "attention": {"auto": 0, "chunked": 1},
}


@dataclass(frozen=True)
class ModelFacts:
    has_blocks: bool
    causal_lm: bool
    has_attention: bool
    n_params: int


@dataclass
class SearchSpace:
    values: dict[str, list] = field(default_factory=dict)
    micro_batches: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Values left out because they cannot run here, and why."""

    def size(self) -> int:
        n = len(self.micro_batches)
        for v in self.values.values():
            n *= len(v)
        return n


def model_facts(workload: Workload) -> ModelFacts:
    """Look at the model's structure on the meta device (no memory, no fake tensors needed)."""
    from memfit.step import _call_workload
    from memfit.techniques.checkpointing import find_blocks
    from memfit.techniques.chunked_loss import check_supported
    with torch.device("meta"):
        model = _call_workload("model()", workload.model)
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"workload model() must return an nn.Module, got {type(model).__name__}")
    try:
        check_supported(model)
        causal = True
    except UserError:
        causal = False
    attention = any(isinstance(m, torch.nn.MultiheadAttention) or "attention" in type(m).__name__.lower()
                    for m in model.modules())
    return ModelFacts(has_blocks=bool(find_blocks(model)), causal_lm=causal, has_attention=attention,
                      n_params=sum(p.numel() for p in model.parameters()))


def default_space(facts: ModelFacts, device: Device, batch_size: int,
                  optimizers: tuple[str, ...] = ("adamw", "adamw8bit")) -> SearchSpace:
    notes = []
    if "adamw8bit" in optimizers:
        from memfit.techniques.optimizers import bitsandbytes_available
        if not bitsandbytes_available():  # predicted = what runs: never plan a technique that falls back
            optimizers = tuple(o for o in optimizers if o != "adamw8bit")
            notes.append("adamw8bit left out: it needs bitsandbytes, which is not installed here "
                         "(pip install bitsandbytes)")
            warnings.warn(f"plan: {notes[-1]}", stacklevel=2)
    precisions = ["fp32", "bf16" if device.bf16 else "fp16"] + (["bf16-pure"] if device.bf16 else [])
    values = {
        "precision": precisions,
        "checkpointing": ["none", "blocks:every=2", "selective", "blocks"] if facts.has_blocks else ["none"],
        "optimizer": list(optimizers),
        "optimizer_in_backward": [False, True],
        "offload": [(), ("optimizer_states",), ("activations",)] if device.is_gpu else [()],
        "loss_chunks": [0, 8] if facts.causal_lm else [0],
        # On CUDA, SDPA's fused kernels never hold the T x T matrix, so chunking only adds work;
        # on the CPU the math path (e.g. with attention dropout) does, and chunking helps.
        "attention": ["auto", "chunked"] if facts.has_attention and not device.is_gpu else ["auto"],
    }
    micro = [m for m in (batch_size, batch_size // 2, batch_size // 4, batch_size // 8)
             if m >= 1 and batch_size % m == 0]
    return SearchSpace(values=values, micro_batches=sorted(set(micro), reverse=True), notes=notes)


def candidates(space: SearchSpace, batch_size: int) -> list[Plan]:
    names = list(space.values)
    out = []
    for combo in itertools.product(*(space.values[n] for n in names), space.micro_batches):
        fields = dict(zip(names, combo[:-1]))
        micro = combo[-1]
        if micro != batch_size:
            fields["micro_batch_size"] = micro
        try:
            out.append(Plan(**fields))
        except UserError:
            continue  # an invalid combination, refused by the Plan itself
    return out


def saves_no_more_than(a: Plan, b: Plan, batch_size: int) -> bool:
    """True if plan ``a`` saves no more memory than ``b`` in every dimension (so if ``b`` does not
    fit, neither does ``a``). Values of equal rank but different kind are not comparable."""
    for name, ranks in RANK.items():
        va, vb = getattr(a, name), getattr(b, name)
        if va == vb:
            continue
        ra, rb = ranks.get(va), ranks.get(vb)
        if ra is None or rb is None or ra >= rb:
            return False
    ma = a.micro_batch_size or batch_size
    mb = b.micro_batch_size or batch_size
    return ma >= mb
