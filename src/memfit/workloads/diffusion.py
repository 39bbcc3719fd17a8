"""Latent-diffusion workloads: diffusers' DiTs and UNets built from their configs (no weights).

What is trained, and what is not. Fine-tuning an image model (full or LoRA) trains only the
denoiser: the VAE encodes each image to latents once (cached, or under ``no_grad``) and the text
encoders turn each caption into hidden states the same way. Their outputs are *inputs* here,
synthetic tensors of the right shapes, as in LoRA training with cached latents; their weights take
no memory in the step (the UNets, FLUX.1, SD3 and Lumina 2 can hold their text encoders instead: memfit.workloads.text_encoders). One step of diffusers' ``train_text_to_image`` (UNet: epsilon prediction)
or its rectified-flow scripts (DiT: velocity prediction):

    noisy = mix(latents, noise, t)     t: one timestep per sample
    loss  = mse(model(noisy, t, text hidden states[, pooled text, mask]), target)

Where memory goes. Latents are ``resolution / 8`` on a side (the VAE's factor); a DiT cuts them
into ``patch x patch`` tokens, so its sequence is ``(resolution / 16) ** 2`` tokens: 4096 at
1024 px, plus the caption's. Activations grow with that sequence (attention itself is
flash/efficient on a GPU, linear in it) and dominate once the weights are LoRA-frozen; halving
the resolution quarters them. A UNet's activations are largest at its first, full-resolution
level. ``--resolution`` sets the pixels; the default is the model's native resolution.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from memfit.errors import UserError, brief
from memfit.workload import Workload, WorkloadInfo
from memfit.workloads.checks import check_value, simple_types

VAE_FACTOR = 8
"""Pixels per latent on each side (the SD/SDXL/Flux/Lumina VAEs all downsample by 8)."""


@dataclass(frozen=True)
class ImageModel:
    """A diffusers denoiser at a published size, and how one training batch for it looks."""

    arch: str
    class_name: str
    defaults: dict
    """Config values that differ from the class's own defaults (the released checkpoint's)."""
    resolution: int
    """Native resolution in pixels (the default of ``--resolution``)."""
    caption_tokens: int
    """Tokens of text hidden states per sample (the pipeline's max_sequence_length)."""
    doc: str
    vae_factor: int = VAE_FACTOR
    """Pixels per latent on each side (Wan 2.2's 5B VAE: 16)."""
    text_configs: tuple = ()
    """A diffusers pipeline folder's own text-encoder configs (memfit.workloads.text_encoders.pipeline_configs),
    used where the step holds its text encoders; else they are built from the denoiser's widths."""
    native_from_config: bool = True
    """Whether a diffusers config's ``sample_size`` (in latents) is the native resolution of a hub id or folder
    (AuraFlow's 64 is not: its pipeline makes 1024 px)."""


LUMINA2 = ImageModel(
    "dit-lumina2", "Lumina2Transformer2DModel",
    # Lumina-Image-2.0: the class defaults (2304 wide, 26 layers, 24 heads, 8 KV heads) and Gemma-2-2B captions.
    {"cap_feat_dim": 2304}, 1024, 256,
    "Lumina-Image-2.0 DiT, 2.6B (diffusers Lumina2Transformer2DModel; flow matching, 1024px)")
SD3 = ImageModel(
    "dit-sd3", "SD3Transformer2DModel",
    # Stable Diffusion 3 medium: 24 joint blocks of 24 heads x 64; CLIP-L/G (77) + T5 (256) tokens.
    {"num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536, "pos_embed_max_size": 192},
    1024, 77 + 256,
    "Stable Diffusion 3 medium MMDiT, 2B (diffusers SD3Transformer2DModel; flow matching, 1024px)")
SDXL = ImageModel(
    "unet-sdxl", "UNet2DConditionModel",
    {"sample_size": 128, "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
     "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
     "block_out_channels": (320, 640, 1280), "transformer_layers_per_block": (1, 2, 10),
     "attention_head_dim": (5, 10, 20), "cross_attention_dim": 2048, "use_linear_projection": True,
     "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
     "projection_class_embeddings_input_dim": 2816},
    1024, 77,
    "Stable Diffusion XL UNet, 2.6B (diffusers UNet2DConditionModel; epsilon prediction, 1024px)")
SD15 = ImageModel(
    "unet-sd15", "UNet2DConditionModel", {"sample_size": 64, "cross_attention_dim": 768}, 512, 77,
    "Stable Diffusion 1.5 UNet, 860M (diffusers UNet2DConditionModel; epsilon prediction, 512px)")

MODELS = {m.arch: m for m in (LUMINA2, SD3, SDXL, SD15)}


def model_class(name: str) -> type:
    """diffusers' model class ``name``, imported without the log lines its optional backends write
    on first import (torch's pytree deprecations, bitsandbytes' and torchao's kernel notices): they
    are not the user's, and a command's output (or its one error line) stays clean."""
    import logging

    from memfit.quiet import silenced_warnings
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with silenced_warnings():
            import diffusers
            diffusers.utils.logging.set_verbosity_error()
            return getattr(diffusers, name)  # diffusers imports its modules lazily, here
    except ImportError:
        raise UserError("built-in diffusion workloads need diffusers; install it with pip install diffusers") from None
    finally:
        logging.disable(previous)


# -- config with overrides -------------------------------------------------------------------------
def config_of(m: ImageModel, overrides: dict) -> tuple[type, dict]:
    """The model class and its constructor's keyword arguments: the class's defaults, the published
    size's, then the user's overrides (checked one by one against the constructor's signature).
    A tuple field takes ``/``-separated values (``unet-sdxl:block_out_channels=32/64/64``): commas
    separate the overrides themselves."""
    cls = model_class(m.class_name)
    params = {n: p for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}
    kwargs = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    kwargs.update(m.defaults)
    for key, value in overrides.items():
        if key not in params:
            raise UserError(f"{m.arch}: {m.class_name} has no field {key!r}; see diffusers' {m.class_name} for valid "
                            "names")
        default = kwargs.get(key)
        if isinstance(default, (tuple, list)) and isinstance(value, (str, int)):
            kwargs[key] = _tuple_value(m.arch, key, value, default)
            continue
        allowed = simple_types(params[key].annotation)
        if allowed is not None:
            value = check_value(m.arch, key, value, allowed, example=default)
        kwargs[key] = value
    return cls, kwargs


def _tuple_value(arch: str, key: str, value: Any, default: tuple) -> Any:
    """``32/64/64`` -> (32, 64, 64); a single number stays a number (diffusers repeats it per level)."""
    import yaml
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    parts = [yaml.safe_load(p) for p in str(value).split("/")]
    kinds = {type(d) for d in default}
    if any(type(p) not in kinds for p in parts):
        example = "/".join(str(d) for d in default)
        raise UserError(f"{arch}: {key} takes values separated by '/', like its default, got {value!r}; "
                        f"write e.g. {arch}:{key}={example}")
    return tuple(parts)


def model_builder(m: ImageModel, cls: type, kwargs: dict, overrides: dict):
    """The denoiser built from ``kwargs``. A deprecation diffusers warns of inside its own classes (Chroma's
    ``FluxPosEmbed`` from its old module) is not the user's to act on: it is not shown."""
    def model():
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")
                warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)
                return cls(**kwargs)
        except Exception as e:  # noqa: BLE001 - the defaults build; a failure is the overrides'
            if not overrides:
                raise
            shown = ",".join(f"{k}={v}" for k, v in overrides.items())
            raise UserError(f"{m.arch}:{shown}: {m.class_name} cannot be built ({type(e).__name__}: "
                            f"{brief(e, 160)}); change the overrides") from None
    return model


# -- resolution ------------------------------------------------------------------------------------
def latent_step(multiple: int, vae_factor: int = VAE_FACTOR) -> int:
    """Pixels between two resolutions a model takes: the VAE's factor times ``multiple`` latents
    (its patch size, or its UNet's halvings)."""
    return vae_factor * multiple


def latent_size(m: ImageModel, resolution: int | None, multiple: int, why: str, flag: str = "--resolution ") -> int:
    """Latent pixels on a side for ``resolution`` (default: the model's native one); the image must
    divide into whole latents and then into ``multiple`` of them (patches, or the UNet's halvings).
    ``flag``: how the user gave the size (``--resolution `` or a video's ``width=``)."""
    res = m.resolution if resolution is None else resolution
    if not isinstance(res, int) or isinstance(res, bool) or res < 1:
        where = "" if flag.startswith("--") else f"{m.arch}: "
        raise UserError(f"{where}{flag.strip().rstrip('=')} must be a positive whole number of pixels, got {res!r}")
    step = latent_step(multiple, m.vae_factor)
    if res % step:
        lower, upper = res // step * step, (res // step + 1) * step
        use = f"{lower} or {upper}" if lower else str(upper)
        raise UserError(f"{m.arch}: {flag}{res} is not a multiple of {step} (the VAE's factor {m.vae_factor} x "
                        f"{why} {multiple}); use {flag}{use}")
    return res // m.vae_factor


def given_width(overrides: dict) -> tuple[dict, Any]:
    """(``overrides`` without ``width=``, the width given or None): an image's width is no config field
    (NOTE [ A resolution's width ] in memfit.workloads.checks)."""
    rest = dict(overrides)
    return rest, rest.pop("width", None)


class Sides(NamedTuple):
    """An image's latent rows and columns, and whether its width was given (else it is square)."""

    high: int
    wide: int
    given: bool


def latent_sides(m: ImageModel, resolution: int | None, width: Any, multiple: int, why: str) -> Sides:
    """The latent sides of an image ``resolution`` pixels high (default: the model's native) and ``width``
    wide (default: square), each a whole number of ``multiple`` latents (see :func:`latent_size`)."""
    high = latent_size(m, resolution, multiple, why)
    if width is None:
        return Sides(high, high, False)
    width = check_value(m.arch, "width", width, (int,), example=high * m.vae_factor)
    return Sides(high, latent_size(m, width, multiple, why, flag="width="), True)


def image_info(m: ImageModel, res: int, kwargs: dict, sizes: tuple[str, ...], multiple: int,
               sides: Sides | None = None) -> WorkloadInfo:
    """``res``: the image's height in pixels; ``sides``: its latent sides, whose width, where one was given,
    is said (then ``--resolution max`` grows the height alone: memfit.planner.sized)."""
    wide = {"width": sides.wide * m.vae_factor, "fixed_width": True} if sides is not None and sides.given else {}
    return WorkloadInfo(arch=m.arch, resolution=res, resolution_step=latent_step(multiple, m.vae_factor),
                        config={"model_class": m.class_name, "latent": res // m.vae_factor, **wide,
                                **{k: kwargs[k] for k in sizes if k in kwargs}})


def image_workload(m: ImageModel, model, batch, loss, res: int, info: WorkloadInfo) -> Workload:
    """A diffusers denoiser, loaded as ``from_pretrained`` loads it: built on the meta device, each
    weight made on the device in its final form (memfit.techniques.loading), so a QLoRA or bf16-pure
    plan never holds the full-precision model there. Named by its size where it is not the native
    square (``dit-flux 512px``, ``dit-flux 1216x832px``: width by height)."""
    width = info.config.get("width", res)
    name = (m.arch if res == width == m.resolution else f"{m.arch} {res}px" if res == width
            else f"{m.arch} {width}x{res}px")
    return Workload(model=model, batch=batch, loss=loss, name=name, default_batch_size=1, info=info,
                    from_checkpoint=True)


def held_workload(m: ImageModel, model, batch, loss, res: int, info: WorkloadInfo, encoders: list, wrapper,
                  text: str, t5: str | None = None) -> Workload:
    """The denoiser's workload (:func:`image_workload`), or, with ``encoders`` (text configs), ``wrapper``'s model:
    the denoiser with its text encoders in the step (memfit.workloads.text_encoders), named so."""
    if not encoders:
        return image_workload(m, model, batch, loss, res, info)
    from memfit.workloads.text_encoders import labelled
    return labelled(image_workload(m, lambda: wrapper(model(), encoders, text == "trained"), batch, loss, res, info),
                    text, t5)


def no_seq_len(arch: str, seq_len: int | None) -> None:
    if seq_len is not None:
        raise UserError(f"{arch}: --seq-len does not apply to an image model; give --resolution PIXELS instead")


def flow_matching(latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, data_at_one: bool):
    """Rectified flow: a straight line between noise and data; the target is its velocity (one ``t``
    a sample, for image ``[B, C, H, W]`` and video ``[B, C, F, H, W]`` latents alike)."""
    s = t.view(-1, *[1] * (latents.dim() - 1))
    if data_at_one:  # Lumina-Image-2.0: t = 1 is the image
        return s * latents + (1 - s) * noise, latents - noise
    return (1 - s) * latents + s * noise, noise - latents  # SD3: t = 1 is pure noise


def alphas_cumprod(t: torch.Tensor, steps: int = 1000) -> torch.Tensor:
    """``alphas_cumprod`` at timesteps ``t`` of the DDPM schedule epsilon and v-prediction models train on (SD's
    scaled-linear one, spanned from its first to its last value; the values cost no memory, their shape does)."""
    return torch.linspace(0.9991, 0.0047, steps)[t]


def _mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.float(), target.float())


def transformer_loss(model, batch: dict) -> torch.Tensor:
    """A DiT's denoising loss: every batch entry but the target is a keyword of its forward. Where reference
    images' tokens follow the noisy ones (an edit model's: NOTE [ Kontext's reference image ] in
    memfit.workloads.packed_dits), the output is cut to the target's tokens first."""
    inputs = {k: v for k, v in batch.items() if k != "target"}
    out, target = model(**inputs, return_dict=False)[0], batch["target"]
    return _mse(out if out.shape[1] == target.shape[1] else out[:, :target.shape[1]], target)


# -- the workloads ---------------------------------------------------------------------------------
def lumina2(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = LUMINA2) -> Workload:
    """Lumina 2's step on cached latents and Gemma-2 states, or with Gemma-2 in the step (``text_encoders=``:
    memfit.workloads.text_encoders)."""
    from memfit.workloads import text_encoders as te
    no_seq_len(m.arch, seq_len)
    overrides, width = given_width(overrides)
    overrides, text_mode, layers = te.text_mode(m.arch, overrides)
    cls, kw = config_of(m, overrides)
    high, wide, _ = sides = latent_sides(m, resolution, width, kw["patch_size"], "patch size")
    channels, caption, text = kw["in_channels"], m.caption_tokens, kw["cap_feat_dim"]
    encoders = te.chosen(m.text_configs, te.lumina_configs(text, layers), layers) if text_mode != "cached" else []

    def batch(b: int) -> dict:
        latents, noise, t = torch.randn(b, channels, high, wide), torch.randn(b, channels, high, wide), torch.rand(b)
        noisy, target = flow_matching(latents, noise, t, data_at_one=True)
        out = {"hidden_states": noisy, "timestep": t, "encoder_attention_mask": torch.ones(b, caption, dtype=torch.bool),
               "target": target}
        return {**out, "ids": te.gemma_token_ids(b, caption, encoders[0].vocab_size)} if encoders else \
            {**out, "encoder_hidden_states": torch.randn(b, caption, text)}

    res = high * VAE_FACTOR
    info = image_info(m, res, kw, ("hidden_size", "num_layers", "num_attention_heads", "cap_feat_dim"),
                      kw["patch_size"], sides)
    return held_workload(m, model_builder(m, cls, kw, overrides), batch, transformer_loss, res, info, encoders,
                         te.LuminaWithTextEncoders, text_mode)


def sd3(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = SD3) -> Workload:
    """SD3's step on cached latents and text states (77 CLIP tokens and ``t5_tokens``, default 256, of T5), or
    with CLIP-L, CLIP-G and T5-XXL in the step (``text_encoders=``, ``t5=``: memfit.workloads.text_encoders)."""
    from memfit.workloads import text_encoders as te
    no_seq_len(m.arch, seq_len)
    overrides, width = given_width(overrides)
    overrides, text, layers = te.text_mode(m.arch, overrides, t5=True)
    overrides, t5 = te.t5_mode(m.arch, overrides, text)
    overrides, t5_tokens = te.t5_tokens(m.arch, overrides)
    cls, kw = config_of(m, overrides)
    high, wide, _ = sides = latent_sides(m, resolution, width, kw["patch_size"], "patch size")
    most = (kw["pos_embed_max_size"] or 0) * kw["patch_size"] * VAE_FACTOR
    for flag, side in (("--resolution ", high), ("width=", wide)):
        if most and side * VAE_FACTOR > most:
            raise UserError(f"{m.arch}: {flag}{side * VAE_FACTOR} exceeds the position table "
                            f"(pos_embed_max_size={kw['pos_embed_max_size']}, {most}px); use {flag}<= {most}")
    channels, joint = kw["in_channels"], kw["joint_attention_dim"]
    tokens = t5_tokens or m.caption_tokens - te.CAPTION_TOKENS
    encoders = te.chosen(m.text_configs, te.sd3_configs(kw["pooled_projection_dim"], joint, t5 == "frozen", layers),
                         layers) if text != "cached" else []

    def batch(b: int) -> dict:
        latents, noise, t = torch.randn(b, channels, high, wide), torch.randn(b, channels, high, wide), torch.rand(b)
        noisy, target = flow_matching(latents, noise, t, data_at_one=False)
        out = {"hidden_states": noisy, "timestep": t * 1000, "target": target}
        if not encoders:
            return {**out, "encoder_hidden_states": torch.randn(b, te.CAPTION_TOKENS + tokens, joint),
                    "pooled_projections": torch.randn(b, kw["pooled_projection_dim"])}
        out["ids"] = te.t5_token_ids(b, 2, tokens if t5 == "frozen" else None)
        return {**out, "t5_states": torch.randn(b, tokens, joint)} if t5 == "cached" else out

    res = high * VAE_FACTOR
    info = image_info(m, res, kw, ("num_layers", "num_attention_heads", "attention_head_dim", "joint_attention_dim"),
                      kw["patch_size"], sides)
    if t5_tokens:
        info.config["t5_tokens"] = t5_tokens
    return held_workload(m, model_builder(m, cls, kw, overrides), batch, transformer_loss, res, info, encoders,
                         te.SD3WithTextEncoders, text, t5)


def unet_builder(m: ImageModel):
    def build(overrides: dict, seq_len: int | None, resolution: int | None) -> Workload:
        from memfit.workloads import text_encoders as te
        no_seq_len(m.arch, seq_len)
        overrides, width = given_width(overrides)
        overrides, text, text_layers = te.text_mode(m.arch, overrides)
        cls, kw = config_of(m, overrides)
        levels = len(kw["block_out_channels"]) if isinstance(kw["block_out_channels"], (tuple, list)) else 1
        halvings = 2 ** (levels - 1)
        high, wide, _ = sides = latent_sides(m, resolution, width, halvings, "the UNet's downsampling")
        channels, cross = kw["in_channels"], kw["cross_attention_dim"]
        text_time = kw.get("addition_embed_type") == "text_time"
        time_ids = 6  # SDXL: original size, crop offset, target size (2 numbers each)
        pooled = (kw["projection_class_embeddings_input_dim"] - time_ids * kw["addition_time_embed_dim"]
                  if text_time else 0)
        if text_time and pooled < 1:
            raise UserError(f"{m.arch}: projection_class_embeddings_input_dim must exceed 6 x addition_time_embed_dim "
                            "(the pooled text embedding is the rest); change the overrides")

        encoders = te.chosen(m.text_configs, te.encoder_configs(cross, pooled, text_time, text_layers),
                             text_layers) if text != "cached" else []

        def batch(b: int) -> dict:
            latents, noise = torch.randn(b, channels, high, wide), torch.randn(b, channels, high, wide)
            t = torch.randint(0, 1000, (b,))
            alpha = alphas_cumprod(t).view(-1, 1, 1, 1)
            out = {"sample": alpha.sqrt() * latents + (1 - alpha).sqrt() * noise, "timestep": t, "target": noise}
            if encoders:  # (the captions' tokens: the encoders run in the step)
                out["ids"] = te.token_ids(b, len(encoders))
            else:
                out["encoder_hidden_states"] = torch.randn(b, m.caption_tokens, cross)
            if text_time:
                out["time_ids"] = torch.rand(b, time_ids) * 1024
                if not encoders:
                    out["text_embeds"] = torch.randn(b, pooled)
            return out

        def loss(model, batch: dict) -> torch.Tensor:
            if "ids" in batch:
                return _mse(model(batch["sample"], batch["timestep"], batch["ids"], batch.get("time_ids")),
                            batch["target"])
            added = {k: batch[k] for k in ("text_embeds", "time_ids") if k in batch}
            pred = model(batch["sample"], batch["timestep"], batch["encoder_hidden_states"],
                         added_cond_kwargs=added or None, return_dict=False)[0]
            return _mse(pred, batch["target"])

        res = high * VAE_FACTOR
        info = image_info(m, res, kw, ("block_out_channels", "layers_per_block", "cross_attention_dim"), halvings,
                          sides)
        return held_workload(m, model_builder(m, cls, kw, overrides), batch, loss, res, info, encoders,
                             te.WithTextEncoders, text)
    return build


BUILDERS = {
    "dit-lumina2": (lumina2, LUMINA2.doc),
    "dit-sd3": (sd3, SD3.doc),
    "unet-sdxl": (unet_builder(SDXL), SDXL.doc),
    "unet-sd15": (unet_builder(SD15), SD15.doc),
}
"""Built-ins that take ``--resolution``: ``builder(overrides, seq_len, resolution)`` (and those of
memfit.workloads.packed_dits)."""
