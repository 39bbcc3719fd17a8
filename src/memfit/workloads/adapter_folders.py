"""PEFT adapter checkpoints as workloads: a LoRA's hub id or folder trains that LoRA on its base model.

NOTE [ Adapter checkpoints ]
A LoRA shared on the hub, or saved by ``model.save_pretrained`` after PEFT training, is a folder with
``adapter_config.json`` and the adapter's weights, and no config.json: its ``base_model_name_or_path``
names the model it adapts. Continuing to train it (or training another of the same shape) is the
base model with that adapter, so memfit reads the two small config files, never the weights: the
base model's workload (a hub id or a folder, itself possibly a pre-quantized checkpoint: a QLoRA's
``unsloth/...-bnb-4bit`` base), and the adapter as the plan value ``lora:r=...,alpha=...,targets=...``
(``dora:`` for ``use_dora``; PEFT's ``lora_dropout``, ``modules_to_save`` and ``target_parameters`` as
``dropout``, ``save`` and ``params``). Every plan of it keeps that adapter, as a pre-quantized
checkpoint keeps its format (:attr:`memfit.workload.WorkloadInfo.adapter`). Other PEFT methods (IA3,
LoHa, prompt tuning, ...) and per-layer rank patterns are refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from memfit.errors import UserError, brief
from memfit.workload import Workload

CONFIG = "adapter_config.json"


def is_adapter_folder(path: Path) -> bool:
    return (path / CONFIG).is_file() and not (path / "config.json").is_file()


def adapter_workload(path: Path, name: str, where: str, load: Callable[..., Workload], seq_len: int | None,
                     resolution: int | None) -> Workload:
    """The base model's workload (``load(spec, seq_len=, resolution=)``: memfit.workloads.load_workload), with
    the adapter of ``path``'s adapter_config.json as its plan value."""
    try:
        data = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: {CONFIG} cannot be read ({brief(e, 120)}); download it again") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: {CONFIG} holds a {type(data).__name__}, not a JSON object; download it again")
    adapter = adapter_value(data, where)
    base = data.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise UserError(f"{where}: {CONFIG} names no base_model_name_or_path; add the base model's hub id or folder")
    base_wl = load(base, seq_len=seq_len, resolution=resolution)
    return dataclasses.replace(base_wl, name=name, info=dataclasses.replace(base_wl.info, adapter=adapter))


def adapter_value(data: dict, where: str) -> str:
    """The plan's ``adapter`` value of a PEFT LoRA/DoRA config (see the module's NOTE)."""
    kind = str(data.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise UserError(f"{where}: a {kind} adapter ({CONFIG}'s peft_type); memfit trains LoRA and DoRA adapters")
    if data.get("rank_pattern") or data.get("alpha_pattern"):
        raise UserError(f"{where}: {CONFIG} gives layers their own ranks (rank_pattern/alpha_pattern), which memfit's "
                        "adapter value cannot say; plan it with --adapter lora:r=... over the base model")
    r, alpha = data.get("r", 8), data.get("lora_alpha", 8)
    options = [f"r={r}", f"alpha={alpha:g}" if isinstance(alpha, (int, float)) else ""]
    targets = data.get("target_modules")
    if isinstance(targets, str):
        if targets != "all-linear":
            raise UserError(f"{where}: {CONFIG}'s target_modules is a regular expression ({targets!r}), which memfit's "
                            "adapter value cannot say; plan it with --adapter lora:r=...,targets=a+b over the base model")
        options.append("targets=all-linear")
    elif targets:
        options.append("targets=" + "+".join(sorted(targets)))
    if data.get("lora_dropout"):
        options.append(f"dropout={data['lora_dropout']:g}")
    for key, option in (("modules_to_save", "save"), ("target_parameters", "params")):
        if data.get(key):
            options.append(f"{option}=" + "+".join(data[key]))
    return ("dora:" if data.get("use_dora") else "lora:") + ",".join(o for o in options if o)
