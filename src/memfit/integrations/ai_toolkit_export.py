"""A plan as an ai-toolkit job: ``memfit plan ... --format ai-toolkit`` prints the YAML of an ai-toolkit
(ostris) training job that runs the plan memfit chose (the inverse of memfit.integrations.ai_toolkit's table),
what ai-toolkit has no field for, and what the user's own setup must hold.

Each technique writes its own fields (``Config.export``'s ``ai_toolkit``, by ``section.key`` of the job's
training process; what it cannot carry is listed as plan keys); here the model follows: its ``arch`` and
``name_or_path`` (a built-in as the hub id ai-toolkit loads), its text encoders (cached, in the step, or
trained), a Wan clip's frames, swapped blocks as ``layer_offloading`` of their share of the denoiser's blocks,
the dataset's bucket, and what ai-toolkit runs its own way (the LoRA in fp32 without autocast:
``bf16-base-noautocast``; ``bf16-pure`` and ``bf16-base`` with an adapter are not carried). Each value is the one
:func:`memfit.integrations.ai_toolkit.map_config` reads back into the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import yaml

from memfit.devices import Device
from memfit.errors import UserError
from memfit.integrations.ai_toolkit import ARCHS, EDITS, FLOW, HOLD_TEXT, LAYER_OFFLOADED, UNETS
from memfit.integrations.export import carried_by, export
from memfit.plans import Plan
from memfit.techniques.precision import BF16Pure
from memfit.workloads.config_overrides import parse_overrides, split_overrides

CLASSES = {"FluxTransformer2DModel": "flux", "SD3Transformer2DModel": "sd3", "Lumina2Transformer2DModel": "lumina2",
           "QwenImageTransformer2DModel": "qwen_image", "Flux2Transformer2DModel": "flux2",
           "WanTransformer3DModel": "wan21", "ZImageTransformer2DModel": "zimage",
           "HiDreamImageTransformer2DModel": "hidream"}
"""ai-toolkit's arch of each denoiser class memfit reads (UNets: sd1 or sdxl by their added conditioning)."""
OWN_KEYS = ("text_encoders", "t5", "t5_tokens", "text_layers", "frames", "experts", "switch", "low_vram",
            "control_images", "control_px", "force_inference_output")
"""Workload keys the job says in its own fields (the text encoders' mode, a Wan clip's frames, Wan 2.2's experts), or
that its arch implies (HiDream's routed experts on their training path)."""
EXPERT_ARCHS = {"dit-wan": "wan22_14b", "dit-wan-i2v": "wan22_14b_i2v"}
"""The built-ins whose ``experts=2`` is ai-toolkit's Wan 2.2 A14B arch (memfit.workloads.wan_experts)."""
BUILT_IN_IDS: dict[str, tuple[str, str]] = {}
BY_BASE: dict[str, tuple[str, str]] = {}
for _arch, _ids in ARCHS.items():
    for _name, _workload in _ids.items():
        BUILT_IN_IDS.setdefault(_workload, (_arch, _name))
        BY_BASE.setdefault(split_overrides(_workload)[0], (_arch, _name))
"""memfit's built-ins as the hub ids ai-toolkit loads (the first id of each, as published); by the built-in's
name alone, for one given other sizes."""


@dataclass(frozen=True)
class AiToolkitJob:
    """A plan's ai-toolkit job, and what it cannot carry."""

    process: dict
    """The training process (``config.process[0]``): its ``model``, ``network``, ``train`` and ``datasets``."""
    unmapped: tuple[str, ...]
    """Plan settings ai-toolkit has no field for (as plan keys)."""
    notes: tuple[str, ...]
    """What the rest of the user's setup must hold."""

    def yaml(self) -> str:
        """The job as ai-toolkit reads it (``python run.py job.yaml``)."""
        job = {"job": "extension", "config": {"name": "memfit_plan", "process": [self.process]}}
        return yaml.safe_dump(job, sort_keys=False).rstrip()


def to_ai_toolkit(plan: Plan, batch_size: int, model: str, model_class: str | None,
                  resolution: int | tuple[int, int] | None = None, device: Device | str | None = None,
                  text: dict | None = None) -> AiToolkitJob:
    """``plan`` at ``batch_size`` (global) for ``model`` (a workload as named: ``dit-flux:text_encoders=frozen``) of
    ``model_class`` (its diffusers class) as an ai-toolkit job. ``text``: the workload's ``text_encoders``, ``t5``,
    ``frames`` and ``cross_attention_dim`` (its config: memfit.workloads.text_encoders, memfit.workloads.video_dits),
    and ``blocks``: the denoiser's blocks (:attr:`memfit.planner.stacks.Stacks.tail`), whose swapped share is
    ai-toolkit's ``layer_offloading``."""
    into = export(plan, batch_size, device)
    fields, unmapped, notes = dict(into.ai_toolkit), list(into.ai_toolkit_unmapped), list(into.ai_toolkit_notes)
    text = text or {}
    arch, name = _model(model, model_class, text, notes)
    process: dict = {"type": "sd_trainer", "training_folder": "output", "device": "cuda:0",
                     "model": {"name_or_path": name, "arch": arch}, "train": {}}
    fields.update(_experts(model, plan, batch_size))
    if fields.get("train.dtype") is None:
        fields.pop("train.dtype", None)
        unmapped.append(f"precision: {plan.to_dict()['precision']} (ai-toolkit runs the model in train.dtype, without "
                        "autocast" + (", its LoRA in fp32: bf16-base-noautocast)" if "network.type" in fields else ")"))
    elif "network.type" in fields and isinstance(plan.config("precision"), BF16Pure):
        unmapped.append("precision: bf16-pure (ai-toolkit keeps a LoRA in fp32 over the bf16 model, without autocast: "
                        "bf16-base-noautocast)")
    if fields.get("network.transformer_only") and arch in UNETS:  # (a UNet's LoRA: every linear layer)
        del fields["network.transformer_only"]
        unmapped.append(f"adapter: {plan.to_dict()['adapter']} (ai-toolkit adapts every linear layer of a UNet: "
                        "targets=all-linear)")
    fields.setdefault("train.gradient_checkpointing", False)  # (ai-toolkit's default is on)
    if fields.get("train.optimizer") == "adafactor":  # (ai-toolkit clips nothing with adafactor)
        fields.pop("train.max_grad_norm", None)
        notes = [n for n in notes if not n.startswith("max_grad_norm:")]
    if arch in FLOW:  # (ai-toolkit's default is ddpm's)
        fields["train.noise_scheduler"] = "flowmatch"
    if fields.get("train.gradient_accumulation") == 1:
        del fields["train.gradient_accumulation"]
    swapped, blocks = fields.pop("model.swapped_blocks", 0), text.get("blocks")
    if swapped and blocks and swapped <= blocks and arch in LAYER_OFFLOADED:  # (ai_toolkit._layer_offloading)
        fields.update({"model.layer_offloading": True,
                       "model.layer_offloading_transformer_percent": round(swapped / blocks, 4),
                       "model.layer_offloading_text_encoder_percent": 0.0})
        notes.append(f"swap_blocks: {swapped} of the denoiser's {blocks} blocks is written as ai-toolkit's "
                     "layer_offloading of that share of its linear layers (drawn at random: about the same bytes)")
    elif swapped:
        unmapped.append(f"swap_blocks: {swapped} (ai-toolkit's layer_offloading streams Qwen-Image's, FLUX.2's and "
                        "Wan's layers" + ("" if arch not in LAYER_OFFLOADED else ", a share of blocks unknown here") + ")")
    if "network.linear_alpha" in fields:
        alpha = fields["network.linear_alpha"]
        fields["network.linear_alpha"] = int(alpha) if float(alpha).is_integer() else alpha
    for key, value in fields.items():
        section, field = key.split(".", 1)
        process.setdefault(section, {})[field] = value
    mode = text.get("text_encoders") or "cached"
    if mode == "cached" or arch not in HOLD_TEXT:
        process["train"]["cache_text_embeddings"] = True
    elif mode == "trained":
        process["train"]["train_text_encoder"] = True
    if text.get("t5") == "cached":
        unmapped.append("t5: cached (ai-toolkit caches every text encoder's outputs or none)")
    if fields.get("model.quantize"):  # (the encoders load beside the transformer even to cache their outputs)
        process["model"]["quantize_te"] = True
    process["datasets"] = [_dataset(resolution, text.get("frames"), notes)]
    for k in range(text.get("control_images") or 0):  # (the edit models' pairs: references named as the targets)
        process["datasets"][0][f"control_path{k + 1 if k else ''}"] = f"/path/to/control/images{k + 1 if k else ''}"
    if arch == "qwen_image_edit_plus2509" and not text.get("control_px"):  # (references at the target's size)
        process["model"].setdefault("model_kwargs", {})["match_target_res"] = True
    notes.append("datasets: your folder_path and captions; cache_latents_to_disk as memfit's batch is the cached "
                 "latents" + ("" if "cache_text_embeddings" not in process["train"] else " and text states"))
    notes.append("train: your steps, lr and sampling (memfit plans memory and speed; ai-toolkit's sample step "
                 "runs outside the predicted step)")
    return AiToolkitJob(process, tuple(unmapped), tuple(notes))


def runs_in_ai_toolkit(batch_size: int, model: str, model_class: str | None, resolution=None, device=None,
                       text: dict | None = None, fixed: dict | None = None) -> Callable[[Plan], bool]:
    """Whether ai-toolkit's fields carry a plan (``memfit plan --format ai-toolkit`` searches only those): every
    setting :func:`to_ai_toolkit` cannot carry is one of the ``fixed`` fields the user gave. A model ai-toolkit
    does not train is refused here, before a search."""
    return carried_by(lambda plan: to_ai_toolkit(plan, batch_size, model, model_class, resolution, device, text), fixed)


def _experts(model: str, plan: Plan, batch_size: int) -> dict:
    """Wan 2.2's two experts (``experts=2``) in ai-toolkit's fields: which it trains (``switch=none``: the
    high-noise one), how often it switches (``step``: every 10 steps' batches, a whole number of steps) and
    ``low_vram``."""
    values = parse_overrides(split_overrides(model)[1], model) if ":" in model else {}
    if values.get("experts") != 2:
        return {}
    switch, batches = values.get("switch", "batch"), plan.micro_batches(batch_size)[1]
    return {"model.low_vram": bool(values.get("low_vram", False)),
            "model.model_kwargs": {"train_high_noise": True, "train_low_noise": switch != "none"},
            "train.switch_boundary_every": 10 * batches if switch == "step" else 1}


def _edit_arch(base: str, overrides: str) -> str | None:
    """ai-toolkit's edit arch of a built-in with reference images: Qwen-Image-Edit-2509's where several or 1 MP ones."""
    values = parse_overrides(overrides, base) if overrides else {}
    count = values.get("control_images", 0)
    if not count:
        return None
    if base == "dit-qwenimage" and (count > 1 or "control_px" in values):
        return "qwen_image_edit_plus2509"
    return next((a for a, b in EDITS.items() if b == base), None)


def _model(model: str, model_class: str | None, text: dict, notes: list[str]) -> tuple[str, str]:
    """(ai-toolkit's arch, ``name_or_path``): a built-in's published id, else the hub id or folder itself."""
    base, overrides = split_overrides(model)
    if base in EXPERT_ARCHS and "experts=2" in overrides.split(","):
        arch = EXPERT_ARCHS[base]
        return arch, next(iter(ARCHS[arch]))
    edit = _edit_arch(base, overrides)
    if edit:  # (FLUX.1 Kontext, Qwen-Image-Edit and its 2509: memfit.workloads.packed_dits)
        kept = [kv for kv in overrides.split(",") if kv and kv.split("=", 1)[0] not in (*OWN_KEYS, "caption_tokens")]
        if not kept:
            return edit, next(iter(ARCHS[edit]))
    hidream = base == "dit-hidream" or model_class == "HiDreamImageTransformer2DModel"
    if hidream and "force_inference_output=false" not in overrides.lower().split(","):
        notes.append("model: ai-toolkit's HiDream runs the routed experts' training path (force_inference_output=false), "
                     "which keeps their activations: more than this plan's step (plan dit-hidream:force_inference_output="
                     "false for its own)")
    kept = ",".join(kv for kv in overrides.split(",") if kv and kv.split("=", 1)[0] not in OWN_KEYS)
    built_in = BUILT_IN_IDS.get(f"{base}:{kept}" if kept else base)
    if built_in is not None:
        return built_in
    if base in BY_BASE:
        arch, name = BY_BASE[base]
        notes.append(f"model: {name} is {base}'s published checkpoint; memfit's sizes ({kept}) are not its own: "
                     "give the folder or hub id you train")
        return arch, name
    arch = CLASSES.get(model_class or "")
    if model_class == "UNet2DConditionModel":  # (SD 1.x's cross-attention is 768 wide, SDXL's 2048; SD 2's 1024: none)
        arch = {768: "sd1", 2048: "sdxl"}.get(text.get("cross_attention_dim"))
    if arch is None:
        raise UserError(f"--format ai-toolkit: memfit writes ai-toolkit jobs for FLUX.1, SD 1.x, SDXL, SD3, Lumina 2, "
                        f"Qwen-Image, FLUX.2 and Wan 2.1, not {model}" + (f" ({model_class})" if model_class else "")
                        + "; use --format yaml, hf or lightning")
    return arch, base


def _dataset(resolution, frames: int | None, notes: list[str]) -> dict:
    """The dataset's bucket: a square of the plan's side (ai-toolkit buckets by area, at most the side squared)."""
    dataset: dict = {"folder_path": "/path/to/images", "caption_ext": "txt", "cache_latents_to_disk": True}
    if isinstance(resolution, tuple):
        side = int((resolution[0] * resolution[1]) ** 0.5) // 16 * 16
        notes.append(f"resolution: ai-toolkit buckets by area; {side} holds {resolution[0]}x{resolution[1]} "
                     "images at most that area")
        resolution = side
    if resolution is not None:
        dataset["resolution"] = [resolution]
    if frames and frames > 1:
        dataset["num_frames"] = frames
    return dataset
