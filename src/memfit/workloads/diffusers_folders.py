"""diffusers models from a hub id or a folder: a pipeline's denoiser, built from its own config.json.

NOTE [ diffusers repositories ]
A diffusers repository (``stabilityai/stable-diffusion-xl-base-1.0``, ``black-forest-labs/FLUX.1-dev``,
or any fine-tune of one) has no config.json at its root. Its ``model_index.json`` names the pipeline's
components, and the denoiser's config is ``unet/config.json`` or ``transformer/config.json``: the
model class's constructor arguments, with ``_class_name``. memfit trains the denoiser, which is what
LoRA and full fine-tuning of a diffusion model train: the VAE's latents and the text encoders' outputs
are cached inputs, as for the built-ins (``--cache_latents``, ``--cache_text_encoder_outputs``). So a
hub id or folder costs two small files, ``model_index.json`` and the denoiser's ``config.json``. With
``text_encoders=frozen|trained`` (a UNet's, FLUX.1's, SD3's or Z-Image's, as for the built-ins) the step holds its text
encoders too, built from the pipeline's ``text_encoder*/config.json`` where the folder or the cache has them
(SD 2.x's OpenCLIP-H), else from the denoiser's widths.

The denoiser is built with the built-in of its class, every field as the file has it. The batch is
the built-in's (the same objective, caption tokens and conditioning), at the config's own resolution
(``sample_size`` latents; FLUX has none: 1024 px) unless ``--resolution`` gives another:

- ``UNet2DConditionModel``: SDXL's batch when ``addition_embed_type`` is ``text_time`` (``unet-sdxl``),
  else Stable Diffusion 1.x/2.x's (``unet-sd15``);
- ``SD3Transformer2DModel`` (SD3, SD3.5): ``dit-sd3``'s;
- ``FluxTransformer2DModel``: ``dit-flux``'s, with the guidance input only when the config embeds it
  (FLUX.1-dev does; FLUX.1-schnell does not);
- ``Lumina2Transformer2DModel``: ``dit-lumina2``'s;
- ``QwenImageTransformer2DModel`` (Qwen-Image, and Qwen-Image-Edit's denoiser built as Qwen-Image's):
  ``dit-qwenimage``'s;
- ``Flux2Transformer2DModel`` (FLUX.2-dev, and FLUX.2's smaller sizes): ``dit-flux2``'s, with the guidance
  input only when the config embeds it;
- ``WanTransformer3DModel`` (Wan 2.1 and 2.2): ``dit-wan``'s video batch (memfit.workloads.video_dits);
- ``ChromaTransformer2DModel`` (Chroma1-HD, Chroma1-Base): ``dit-chroma``'s;
- ``ZImageTransformer2DModel`` (Z-Image-Turbo, Z-Image): ``dit-zimage``'s;
- ``HunyuanVideoTransformer3DModel`` (HunyuanVideo T2V): ``dit-hunyuan-video``'s video batch;
- ``SanaTransformer2DModel`` (Sana 600M and 1600M, 512 to 4096 px): ``dit-sana``'s;
- ``PixArtTransformer2DModel`` (PixArt-Sigma, and PixArt-alpha with its micro-conditions where its config
  uses them): ``dit-pixart-sigma``'s;
- ``AuraFlowTransformer2DModel`` (AuraFlow v0.1-v0.3): ``dit-auraflow``'s, at 1024 px (its config's
  ``sample_size`` is not its pipeline's size);
- ``CogVideoXTransformer3DModel`` (CogVideoX-2B and 5B; not 1.5's frame patches): ``dit-cogvideox``'s clip;
- ``LTXVideoTransformer3DModel`` (LTX-Video 0.9 to 0.9.7): ``dit-ltx-video``'s clip;
- ``LTX2VideoTransformer3DModel`` (LTX-2, LTX-2.3): ``dit-ltx2``'s clip and audio, with the pipeline's own
  ``connectors/config.json`` where it has one;
- ``HiDreamImageTransformer2DModel`` (HiDream-I1 Full, Dev, Fast): ``dit-hidream``'s, loaded with
  ``force_inference_output=True`` as diffusers' LoRA script loads it.

Any other class is refused in one line. It loads as ``from_pretrained`` loads it (each weight made on
the device in its final form: memfit.techniques.loading).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

from memfit.errors import UserError, brief
from memfit.workload import Workload
from memfit.workloads import (
    caption_dits,
    cogvideo,
    diffusion,
    hidream,
    ltx2,
    ltx_video,
    packed_dits,
    video_dits,
    zimage,
)

DENOISERS = ("transformer", "unet")
"""The components of a diffusers pipeline that hold its denoiser, in the order they are looked for."""

_BY_CLASS = {"FluxTransformer2DModel": (packed_dits.FLUX, packed_dits.flux),
             "SD3Transformer2DModel": (diffusion.SD3, diffusion.sd3),
             "Lumina2Transformer2DModel": (diffusion.LUMINA2, diffusion.lumina2),
             "QwenImageTransformer2DModel": (packed_dits.QWEN_IMAGE, packed_dits.qwen_image),
             "Flux2Transformer2DModel": (packed_dits.FLUX2, packed_dits.flux2),
             "WanTransformer3DModel": (video_dits.WAN, video_dits.wan),
             "ChromaTransformer2DModel": (packed_dits.CHROMA, packed_dits.chroma),
             "ZImageTransformer2DModel": (zimage.ZIMAGE, zimage.zimage),
             "HunyuanVideoTransformer3DModel": (video_dits.HUNYUAN_VIDEO, video_dits.hunyuan_video),
             "SanaTransformer2DModel": (caption_dits.SANA, caption_dits.sana),
             "PixArtTransformer2DModel": (caption_dits.PIXART_SIGMA, caption_dits.pixart_sigma),
             "AuraFlowTransformer2DModel": (caption_dits.AURAFLOW, caption_dits.auraflow),
             "CogVideoXTransformer3DModel": (cogvideo.COGVIDEOX, cogvideo.cogvideox),
             "LTXVideoTransformer3DModel": (ltx_video.LTX_VIDEO, ltx_video.ltx_video),
             "LTX2VideoTransformer3DModel": (ltx2.LTX2, ltx2.ltx2),
             "HiDreamImageTransformer2DModel": (hidream.HIDREAM, hidream.hidream)}
CLASSES = ("UNet2DConditionModel", *_BY_CLASS)


def is_diffusers_config(data: dict) -> bool:
    """A diffusers model's config.json (``_class_name``), not a transformers one (``model_type``)."""
    return isinstance(data.get("_class_name"), str) and "model_type" not in data


def read_model_index(path: Path, where: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: model_index.json cannot be read ({brief(e, 120)}); download it again") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: model_index.json holds a {type(data).__name__}, not a JSON object; download it again")
    return data


def denoiser_name(index: dict, where: str) -> str:
    """The component of a pipeline's ``model_index.json`` that holds its denoiser."""
    name = next((n for n in DENOISERS if n in index), None)
    if name is None:
        kind = index.get("_class_name", "this pipeline")
        raise UserError(f"{where}: {kind}'s model_index.json names no unet or transformer (the denoiser memfit "
                        "trains); give the repository of a text-to-image pipeline, or a file workload "
                        "(path/to/file.py:NAME) that builds the model")
    return name


def pipeline_denoiser(path: Path, where: str) -> Path | None:
    """The denoiser's folder of a diffusers pipeline folder (one holding model_index.json), else None."""
    if not (path / "model_index.json").is_file() or (path / "config.json").is_file():
        return None
    name = denoiser_name(read_model_index(path / "model_index.json", where), where)
    if not (path / name / "config.json").is_file():
        raise UserError(f"{where}: {name}/config.json is missing (model_index.json names it); download it with "
                        f"the pipeline, e.g. `hf download ORG/NAME {name}/config.json`")
    return path / name


TEXT_KEYS = ("text_encoders", "t5", "t5_tokens", "text_layers", "t5_mask")
"""The text encoders a UNet's, FLUX.1's or SD3's step holds (memfit.workloads.text_encoders): built from the
pipeline folder's own ``text_encoder*/config.json`` where it has them; FLUX.1's T5 mask in its attention."""
def pipeline_of(given: Path, denoiser: Path) -> Path | None:
    """The pipeline folder of a denoiser's folder: the one given (a pipeline folder), or the folder above the
    denoiser's (a hub snapshot's ``unet/``) where it holds model_index.json; else None."""
    if given != denoiser:
        return given
    return denoiser.parent if (denoiser.parent / "model_index.json").is_file() else None


SIZE_KEYS = ("width", *TEXT_KEYS)
"""An image's width, given as an override of a diffusers folder or hub id as of the built-ins (not a
config.json field: NOTE [ A resolution's width ] in memfit.workloads.checks), and the text encoders in its step
(TEXT_KEYS); a Wan model's clip also takes ``frames=`` (CLIP_KEYS)."""
CLIP_KEYS = ("frames", "width")
EXPERT_KEYS = ("experts", "switch", "low_vram")
"""Wan 2.2 A14B's two experts in one step, as ai-toolkit trains them (memfit.workloads.wan_experts)."""
OWN_KEYS = {"WanTransformer3DModel": CLIP_KEYS + EXPERT_KEYS, "HunyuanVideoTransformer3DModel": CLIP_KEYS,
            "CogVideoXTransformer3DModel": CLIP_KEYS, "LTXVideoTransformer3DModel": CLIP_KEYS,
            "LTX2VideoTransformer3DModel": (*CLIP_KEYS, "connectors"),
            "ZImageTransformer2DModel": ("caption_tokens", "width", "text_encoders", "text_layers"),
            "HiDreamImageTransformer2DModel": ("caption_tokens", "width", "text_encoders", "text_layers",
                                               "force_inference_output")}
"""The size overrides of the classes that take others than SIZE_KEYS (Z-Image's longest caption and its Qwen3;
HiDream's routed experts' path, which no released config.json holds)."""


def size_overrides(data: dict, overrides: dict | None) -> dict:
    """The overrides of ``data`` (a diffusers config.json's object) that size its image or clip: ``width=``, a Wan
    model's ``frames=``, a Z-Image model's ``caption_tokens=``."""
    if not overrides or not is_diffusers_config(data):
        return {}
    keys = OWN_KEYS.get(data.get("_class_name"), SIZE_KEYS)
    return {k: overrides[k] for k in keys if k in overrides}


def diffusers_workload(data: dict, name: str, where: str, seq_len: int | None, resolution: int | None,
                       clip: dict | None = None, pipeline: Path | None = None) -> Workload:
    """The workload of a diffusers denoiser's config.json (see the module's NOTE); ``clip``: its
    :func:`size_overrides`; ``pipeline``: the pipeline folder holding it, whose text encoders' configs a step
    that holds them is built with."""
    class_name = data["_class_name"]
    if class_name == "UNet2DConditionModel":
        template = diffusion.SDXL if data.get("addition_embed_type") == "text_time" else diffusion.SD15
    elif class_name == "WanTransformer3DModel":
        template = video_dits.template(data)
        check_experts(clip or {}, pipeline, where)
    elif class_name in _BY_CLASS:
        template = _BY_CLASS[class_name][0]
    else:
        raise UserError(f"{where}: memfit builds the diffusers denoisers {', '.join(CLASSES)}, not {class_name}; "
                        "write a file workload (path/to/file.py:NAME) that builds it and its batch")
    params = inspect.signature(diffusion.model_class(class_name).__init__).parameters
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
              if not k.startswith("_") and k in params}
    sample = data.get("sample_size")
    native = (sample * template.vae_factor if template.native_from_config and isinstance(sample, int) and sample > 0
              else template.resolution)
    # The file's fields replace the template's published size, as given (diffusers checks them, not the
    # user's overrides' checks); the batch's layout stays the template's.
    template = dataclasses.replace(template, arch=name, resolution=native, defaults=fields)
    if pipeline is not None and (clip or {}).get("text_encoders", "cached") != "cached":
        from memfit.workloads.text_encoders import pipeline_configs
        index = read_model_index(pipeline / "model_index.json", where)
        template = dataclasses.replace(template, text_configs=pipeline_configs(pipeline, index, where))
    if class_name == "LTX2VideoTransformer3DModel" and pipeline is not None:
        template = dataclasses.replace(template, text_configs=ltx2.pipeline_connectors(pipeline, where))
    if class_name == "UNet2DConditionModel":
        return diffusion.unet_builder(template)(dict(clip or {}), seq_len, resolution)
    return _BY_CLASS[class_name][1](dict(clip or {}), seq_len, resolution, m=template)


# NOTE [ A Wan 2.2 pipeline's two experts ]
# Wan 2.2 A14B's pipeline folder (``Wan-AI/Wan2.2-T2V-A14B-Diffusers``, I2V's) names two denoisers in its
# model_index.json: ``transformer`` (the high-noise expert) and ``transformer_2`` (the low-noise one), with
# ``boundary_ratio``. memfit reads the first, as musubi-tuner trains one expert a run; ``experts=2`` (with
# ``switch=`` and ``low_vram=``) holds both in the step, as ai-toolkit trains them. Both experts are built
# from ``transformer/config.json`` (with the user's overrides): where the two files, as downloaded, differ in
# a field, the folder is refused, not predicted as two equal experts. A pipeline with one denoiser (Wan 2.1,
# Wan 2.2 TI2V 5B) refuses ``experts=2``; a transformer folder with no pipeline above it cannot say, and takes
# the user's word.
def check_experts(clip: dict, pipeline: Path | None, where: str) -> None:
    """A Wan denoiser's ``experts=2`` against its pipeline (NOTE [ A Wan 2.2 pipeline's two experts ])."""
    if clip.get("experts", 1) != 2 or pipeline is None or not (pipeline / "model_index.json").is_file():
        return
    index = read_model_index(pipeline / "model_index.json", where)
    if "transformer_2" not in index:
        raise UserError(f"{where}: experts=2 is for Wan 2.2 A14B's pipelines, whose model_index.json names "
                        "transformer and transformer_2; this one has one denoiser: drop experts=2")
    first, second = (pipeline / name / "config.json" for name in ("transformer", "transformer_2"))
    if not (first.is_file() and second.is_file()):
        return
    try:  # (the files as downloaded: ``data`` holds the user's overrides, which build both experts)
        one, other = (json.loads(f.read_text(encoding="utf-8")) for f in (first, second))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: a denoiser's config.json cannot be read ({brief(e, 120)}); download it again") from None
    differ = sorted(k for k in set(one) | set(other) if not k.startswith("_") and one.get(k) != other.get(k))
    if differ:
        raise UserError(f"{where}: its two experts differ in {', '.join(differ[:4])}; memfit builds experts=2 as two "
                        "copies of transformer/config.json: predict each expert alone (experts=1)")
