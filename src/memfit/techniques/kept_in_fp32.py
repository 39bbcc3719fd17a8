"""What ``from_pretrained(dtype=...)`` keeps in fp32: transformers' ``_keep_in_fp32_modules``.

A transformers model class may name modules that a 16-bit load keeps in fp32, because they lose too much
in 16 bits: ``_keep_in_fp32_modules_strict`` for bf16 and fp16 alike (a mixture of experts' router bias
``e_score_correction_bias``, ERNIE's router ``gate.weight``, attention sinks, some audio towers),
``_keep_in_fp32_modules`` for fp16 only (T5's and mT5's feed-forward output ``wo``: a third of T5's
weights; gpt-oss's norms). The load applies them as a dtype plan: each state-dict key that a pattern
matches (``re.search``, ``*`` any characters) is loaded in fp32, the rest in ``dtype``
(``PreTrainedModel._get_dtype_plan``, applied in ``transformers.core_model_loading``).

memfit's 16-bit precisions of a model that loads as a checkpoint (``bf16-pure``, ``bf16-base``,
``fp16-base``; memfit.techniques.precision) ask transformers' own plan of each outermost
``PreTrainedModel`` in the step's model, make those tensors fp32 on the meta device before they are
materialised (so they arrive in fp32, as the load brings them), and leave them there when the rest is
converted. A model the workload builds itself is converted whole, as ``model.to(dtype)`` converts it.
"""

from __future__ import annotations

import re

import torch


def kept_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """The floating-point parameters and persistent buffers (by ``id``) that a load in ``dtype`` keeps in
    fp32: those whose key, relative to the outermost transformers model holding it, matches its class's
    dtype plan (see the module docstring). Empty for a model that holds no transformers model."""
    out: dict[int, torch.Tensor] = {}
    for root in _outermost_transformers_models(model):
        plan = root._get_dtype_plan(dtype) if callable(getattr(root, "_get_dtype_plan", None)) else {}
        wanted = [k for k, v in plan.items() if v == torch.float32]
        if not wanted:
            continue
        pattern = re.compile("|".join(f"(?:{k.replace('*', '.*')})" for k in wanted))
        for name, t in root.state_dict(keep_vars=True).items():
            if t.is_floating_point() and pattern.search(name):
                out[id(t)] = t
    return out


def kept_ids(model: torch.nn.Module, dtype: torch.dtype, loaded: bool) -> set[int]:
    """:func:`kept_in_fp32`'s ids for a model loaded as a checkpoint (``loaded``); none for one the workload
    builds (converted whole)."""
    return set(kept_in_fp32(model, dtype)) if loaded else set()


def arrive_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> set[int]:
    """Make what a load in ``dtype`` keeps in fp32 fp32 on the meta device, before it is materialised (the
    tensors keep their identity: quantizers and block swap key them by it); returns their ids."""
    kept = kept_in_fp32(model, dtype)
    for t in kept.values():
        if t.device.type == "meta" and t.dtype != torch.float32:
            t.data = torch.empty_like(t, dtype=torch.float32)
    return set(kept)


def _outermost_transformers_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``transformers.PreTrainedModel`` modules of ``model`` that no other one holds (a nested one's
    plan is its parent's too: ``PreTrainedModel.post_init`` gathers its submodels' lists)."""
    import sys
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel
    out: list[torch.nn.Module] = []
    held: set[int] = set()
    for module in model.modules():
        if id(module) in held or not isinstance(module, PreTrainedModel):
            continue
        out.append(module)
        held.update(id(m) for m in module.modules())
    return out
