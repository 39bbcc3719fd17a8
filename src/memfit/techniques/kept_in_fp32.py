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
converted. A model the workload builds itself is converted whole, as ``model.to(dtype)`` converts it, and so
are the transformers models a module names in ``converted_whole`` (a diffusion model's text encoders: kohya's
and diffusers' scripts cast them with ``.to(dtype)`` after loading). transformers releases without
``_get_dtype_plan`` (4.x) match each name as a whole component of a key, as their loading did.
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
        pattern = _pattern(root, dtype)
        if pattern is None:
            continue
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


def _pattern(root: torch.nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """What ``root``'s load in ``dtype`` keeps in fp32, as one expression over its state-dict keys; None for
    nothing."""
    if callable(getattr(root, "_get_dtype_plan", None)):
        wanted = [k for k, v in root._get_dtype_plan(dtype).items() if v == torch.float32]
        return re.compile("|".join(f"(?:{k.replace('*', '.*')})" for k in wanted)) if wanted else None
    wanted = list(getattr(root, "_keep_in_fp32_modules_strict", None) or []) if dtype in (
        torch.float16, torch.bfloat16) else []
    wanted += list(getattr(root, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else []
    return re.compile("|".join(rf"(?:(^|\.){re.escape(k)}($|\.))" for k in wanted)) if wanted else None


def _outermost_transformers_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``transformers.PreTrainedModel`` modules of ``model`` that no other one holds (a nested one's
    plan is its parent's too: ``PreTrainedModel.post_init`` gathers its submodels' lists), but those a module
    names in its ``converted_whole`` attribute (see the module docstring)."""
    import sys
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel
    out: list[torch.nn.Module] = []
    held: set[int] = set()
    for module in model.modules():
        for name in getattr(module, "converted_whole", ()):
            held.update(id(m) for m in module.get_submodule(name).modules())
        if id(module) in held or not isinstance(module, PreTrainedModel):
            continue
        out.append(module)
        held.update(id(m) for m in module.modules())
    return out
