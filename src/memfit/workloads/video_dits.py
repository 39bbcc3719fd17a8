"""Video diffusion transformers: Wan 2.1 and 2.2 (diffusers' ``WanTransformer3DModel``) and HunyuanVideo
(``HunyuanVideoTransformer3DModel``, ``dit-hunyuan-video``), built from their configs (no weights), trained on
cached latents as musubi-tuner and diffusers' LoRA scripts train them:

- ``dit-wan``: Wan 2.1 T2V 14B, which is also the shape of each of Wan 2.2 T2V A14B's two experts (a LoRA
  trains one expert at a time, the high-noise or the low-noise one); ``dit-wan-1.3b``: Wan 2.1 T2V 1.3B.
  ``experts=2``: both experts as ai-toolkit trains them in one run (memfit.workloads.wan_experts).
- ``dit-wan-i2v``: one expert of Wan 2.2 I2V A14B. The first frame's latents and its mask ride along the
  noisy latents as 20 more input channels (36 in, 16 out). Wan 2.1's I2V also takes CLIP's image states
  through extra attention: ``dit-wan-i2v:image_dim=1280,added_kv_proj_dim=5120`` (257 tokens a clip), and
  Wan 2.1 FLF2V (first and last frame) the states of both frames: ``...,pos_embed_seq_len=514``.
- ``dit-wan-5b``: Wan 2.2 TI2V 5B. Its VAE compresses 16x on each side into 48 channels, and its pipeline
  gives every token its own timestep (``expand_timesteps``), so the timestep's projection is a
  ``[B, tokens, 6, 3072]`` tensor, not ``[B, 6, 3072]``. Native: 121 frames at 1280 x 704.

Where memory goes. Wan's VAE compresses 4x in time and 8x on each side, and the DiT cuts the latents
into 1x2x2 patches, so a clip of ``F`` frames at ``R`` px a side is ``((F - 1) / 4 + 1) * (R / 16) ** 2``
tokens: 81 frames at 480 px are 21 x 30 x 30 = 18,900 tokens, against FLUX's 4,096 at 1024 px. Activations
grow with them (attention is flash/efficient on a GPU, linear in them) and dominate once the weights are
LoRA-frozen: fewer frames cut them in steps of 4. At 14B the weights reach a consumer card only in fp8 or
streamed block by block, so the model loads as a checkpoint does (memfit.techniques.loading).

The frame count is the workload's ``frames`` (``dit-wan:frames=33``; ``4k + 1``, the VAE's first frame
alone then groups of 4). ``--resolution`` is the clip's height, and its width the workload's ``width``
(``dit-wan:width=832 --resolution 480``, Wan's 480p; default: square, but 1280 for ``dit-wan-5b``);
``--resolution max`` searches the height at that width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.errors import UserError
from memfit.workload import Workload
from memfit.workloads.checks import check_value
from memfit.workloads.diffusion import (
    ImageModel,
    config_of,
    flow_matching,
    image_info,
    image_workload,
    latent_sides,
    model_builder,
    no_seq_len,
    transformer_loss,
)
from memfit.workloads.image_text import split_images
from memfit.workloads.wan_experts import TwoExperts, experts_options

WAN = ImageModel(
    "dit-wan", "WanTransformer3DModel",
    # Wan2.1-T2V-14B: the class defaults (40 blocks of 5120, 40 heads x 128, FFN 13824; UMT5-XXL's 4096-wide
    # states as captions, 512 tokens), trained at 480 px.
    {}, 480, 512,
    "Wan 2.1 T2V 14B video DiT (diffusers WanTransformer3DModel; flow matching, 81 frames at 480px)")

WAN_1_3B = ImageModel(
    "dit-wan-1.3b", "WanTransformer3DModel",
    # Wan2.1-T2V-1.3B: 30 blocks of 1536, 12 heads x 128, FFN 8960.
    {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}, 480, 512,
    "Wan 2.1 T2V 1.3B video DiT (diffusers WanTransformer3DModel; flow matching, 81 frames at 480px)")

WAN_I2V = ImageModel(
    "dit-wan-i2v", "WanTransformer3DModel",
    # Wan2.2-I2V-A14B, one expert: Wan 2.1 14B's blocks, 36 input channels (16 noisy + 4 mask + 16 image).
    {"in_channels": 36}, 480, 512,
    "Wan 2.2 I2V A14B video DiT, one expert (diffusers WanTransformer3DModel; first frame as 20 more "
    "input channels; 81 frames at 480px)")

WAN_5B = ImageModel(
    "dit-wan-5b", "WanTransformer3DModel",
    # Wan2.2-TI2V-5B: 30 blocks of 3072 (24 heads x 128), FFN 14336, 48 latent channels (the 16x VAE).
    {"num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48, "out_channels": 48},
    704, 512,
    "Wan 2.2 TI2V 5B video DiT (diffusers WanTransformer3DModel; 16x VAE, a timestep per token; 121 frames "
    "at 1280x704)", vae_factor=16)


HUNYUAN_VIDEO = ImageModel(
    "dit-hunyuan-video", "HunyuanVideoTransformer3DModel",
    # HunyuanVideo (T2V 720p): the class defaults (20 double-stream + 40 single-stream blocks of 3072, 24 heads x 128;
    # a 2-layer token refiner over LLaVA-Llama-3-8B's 4096-wide states, 256 tokens; CLIP-L's pooled 768; the
    # guidance embedding), trained as musubi-tuner's examples train it: 960 x 544, 33 frames.
    {}, 544, 256,
    "HunyuanVideo T2V 13B video DiT (diffusers HunyuanVideoTransformer3DModel; flow matching with guidance, "
    "33 frames at 960x544)")


@dataclass(frozen=True)
class Clip:
    """What a Wan model trains on by default, beside its config."""

    frames: int = 81
    """Frames a clip (Wan's default ``num_frames``: 5 s at 16 fps; 2.2's 5B: 121, 5 s at 24 fps)."""
    width: int | None = None
    """Pixels wide (None: as high as ``--resolution``)."""
    token_timesteps: bool = False
    """A timestep per latent token, as Wan 2.2 TI2V's pipeline gives them (``expand_timesteps``)."""


WAN22_CLIP = Clip(frames=121, width=1280, token_timesteps=True)
HUNYUAN_CLIP = Clip(frames=33, width=960)
"""HunyuanVideo's clip in musubi-tuner's examples (the pipeline's own default, 129 frames at 1280 x 720, is 118,800
tokens: inference's, not a LoRA's)."""
HUNYUAN_GUIDANCE = 1.0
"""The guidance value a HunyuanVideo step embeds (musubi-tuner's ``--guidance_scale`` default; the pipeline feeds
it times 1000)."""
"""Wan 2.2 TI2V 5B's, which comes with the 16x VAE (also for a model folder of it)."""
IMAGE_TOKENS = 257
"""CLIP ViT-H/14's image states a clip (Wan 2.1 I2V's ``image_dim`` path; first-last-frame: twice that)."""
FRAMES = Clip.frames
TIME_FACTOR = 4
"""Frames per latent frame after the first (Wan's VAE: the first frame alone, then groups of 4)."""


def latent_frames(arch: str, frames, per: int = TIME_FACTOR, example: int = FRAMES) -> int:
    """Latent frames of a clip of ``frames`` through a VAE that keeps the first frame alone and then groups of
    ``per`` (Wan's and CogVideoX's 4, LTX-Video's 8); one line where ``frames`` is not ``per * k + 1``."""
    frames = check_value(arch, "frames", frames, (int,), example=example)
    if frames < 1 or (frames - 1) % per:
        lower = max(1, (frames - 1) // per * per + 1)
        raise UserError(f"{arch}: frames={frames} is not {per}k + 1 (the VAE keeps the first frame, then groups of "
                        f"{per}); use frames={lower} or frames={lower + per}")
    return (frames - 1) // per + 1


def wan(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = WAN) -> Workload:
    """Wan as musubi-tuner and diffusers' Wan LoRA scripts train it: latents and UMT5's caption states cached,
    so the batch is the noisy video latents ``[B, C, F', H', W']`` (for image-to-video with the first frame's
    mask and latents concatenated on the channels), the caption states (padded to 512 tokens, as the pipeline
    pads them), CLIP's image states where the config takes them, and the timestep on the 0-1000 scale (one
    per token for 2.2's 5B); rectified flow (t = 1 is noise), the target the velocity ``noise - latents``.
    Loaded as a checkpoint is."""
    no_seq_len(m.arch, seq_len)
    clip = WAN22_CLIP if m.vae_factor == WAN_5B.vae_factor else Clip()
    overrides, experts = experts_options(m.arch, overrides)
    if experts and m.vae_factor == WAN_5B.vae_factor:
        raise UserError(f"{m.arch}: experts=2 is Wan 2.2 A14B's (dit-wan, dit-wan-i2v); TI2V 5B is one model")
    frames = overrides.pop("frames", clip.frames)
    width = overrides.pop("width", clip.width)
    depth = latent_frames(m.arch, frames)
    cls, kw = config_of(m, overrides)
    p_t, p_h, p_w = kw["patch_size"]
    if p_h != p_w or depth % p_t:
        raise UserError(f"{m.arch}: patch_size {kw['patch_size']} must be square on a side and divide the "
                        f"{depth} latent frames; change the overrides")
    high, wide, _ = latent_sides(m, resolution, width, p_h, "patch size")
    out, extra = kw["out_channels"] or kw["in_channels"], kw["in_channels"] - (kw["out_channels"] or kw["in_channels"])
    if extra < 0:
        raise UserError(f"{m.arch}: in_channels {kw['in_channels']} is fewer than out_channels {out}; change the overrides")
    tokens = depth // p_t * (high // p_h) * (wide // p_w)
    # (first-last-frame, Wan 2.1 FLF2V: ``pos_embed_seq_len`` set, the pipeline encodes both frames and hands
    # their states in pairs, ``[2B, 257, 1280]``, which the image embedding views as ``[B, 514, 1280]``)
    pairs = kw.get("pos_embed_seq_len")
    images, image_tokens = ((2, pairs // 2) if pairs else (1, IMAGE_TOKENS)) if kw.get("image_dim") else (0, 0)

    def batch(b: int) -> dict:
        shape = (b, out, depth, high, wide)
        latents, noise, t = torch.randn(shape), torch.randn(shape), torch.rand(b)
        noisy, target = flow_matching(latents, noise, t, data_at_one=False)
        if extra:  # (image-to-video: the first frame's mask and latents, as the pipeline concatenates them)
            noisy = torch.cat([noisy, torch.randn(b, extra, depth, high, wide)], dim=1)
        timestep = (t * 1000)[:, None].expand(b, tokens).contiguous() if clip.token_timesteps else t * 1000
        out_batch = {"hidden_states": noisy, "timestep": timestep,
                     "encoder_hidden_states": torch.randn(b, m.caption_tokens, kw["text_dim"]), "target": target}
        if image_tokens:
            out_batch["encoder_hidden_states_image"] = torch.randn(b * images, image_tokens, kw["image_dim"])
        return out_batch

    res = high * m.vae_factor
    info = image_info(m, res, kw, ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim"), p_h)
    info.config.update(frames=frames, latent_frames=depth, width=wide * m.vae_factor, tokens=tokens,
                       fixed_width=width is not None)
    make = model_builder(m, cls, kw, overrides)
    wl = image_workload(m, (lambda: TwoExperts(make, **experts)) if experts else make, batch, transformer_loss, res,
                        info)
    wl.warmup_steps = 1 if experts and experts["switch"] != "none" else 0  # (each expert's states: memfit.workloads.wan_experts)
    if images > 1:  # (FLF2V's image states, two rows a sample, split with their samples into micro-batches)
        wl.split = split_images
    square = clip.width is None and (width is None or width == res)
    wl.name = (m.arch if res == m.resolution and width == clip.width else f"{m.arch} {res}px" if square
               else f"{m.arch} {wide * m.vae_factor}x{res}px")
    if frames != clip.frames:
        wl.name += f" {frames} frames"
    if experts:
        wl.name += " 2 experts" + (f" switch={experts['switch']}" if experts["switch"] != "batch" else "") + (
            " low_vram" if experts["low_vram"] else "")
    return wl


def hunyuan_video(overrides: dict, seq_len: int | None, resolution: int | None,
                  m: ImageModel = HUNYUAN_VIDEO) -> Workload:
    """HunyuanVideo as musubi-tuner and diffusers' pipeline feed it: latents and both text encoders' outputs cached,
    so the batch is the noisy video latents ``[B, 16, F', H', W']`` (Wan's VAE factors: 4x in time, 8x a side),
    LLaVA-Llama-3's caption states (256 tokens) with their mask, CLIP-L's pooled vector, the guidance value times
    1000 and the timestep on the 0-1000 scale; rectified flow (t = 1 is noise), the target ``noise - latents``.
    Its forward turns the caption mask into a ``[B, 1, 1, N]`` attention mask over the joined sequence. ``frames=``
    and ``width=`` size the clip as ``dit-wan``'s. Loaded as a checkpoint is."""
    no_seq_len(m.arch, seq_len)
    clip = HUNYUAN_CLIP
    overrides = dict(overrides)
    frames = overrides.pop("frames", clip.frames)
    width = overrides.pop("width", clip.width)
    depth = latent_frames(m.arch, frames)
    cls, kw = config_of(m, overrides)
    p_t, p = kw["patch_size_t"], kw["patch_size"]
    if depth % p_t:
        raise UserError(f"{m.arch}: patch_size_t {p_t} must divide the {depth} latent frames; change the overrides")
    high, wide, _ = latent_sides(m, resolution, width, p, "patch size")
    channels = kw["in_channels"]

    def batch(b: int) -> dict:
        shape = (b, channels, depth, high, wide)
        latents, noise, t = torch.randn(shape), torch.randn(shape), torch.rand(b)
        noisy, target = flow_matching(latents, noise, t, data_at_one=False)
        guidance = {"guidance": torch.full((b,), HUNYUAN_GUIDANCE * 1000)} if kw["guidance_embeds"] else {}
        return {"hidden_states": noisy, "timestep": t * 1000, **guidance,
                "encoder_hidden_states": torch.randn(b, m.caption_tokens, kw["text_embed_dim"]),
                "encoder_attention_mask": torch.ones(b, m.caption_tokens, dtype=torch.long),
                "pooled_projections": torch.randn(b, kw["pooled_projection_dim"]), "target": target}

    res = high * m.vae_factor
    tokens = depth // p_t * (high // p) * (wide // p)
    info = image_info(m, res, kw, ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim"), p)
    info.config.update(frames=frames, latent_frames=depth, width=wide * m.vae_factor, tokens=tokens, fixed_width=True)
    wl = image_workload(m, model_builder(m, cls, kw, overrides), batch, transformer_loss, res, info)
    wl.name = clip_name(m, res, wide * m.vae_factor, frames, clip)
    return wl


def clip_name(m: ImageModel, high_px: int, wide_px: int, frames: int, clip: Clip) -> str:
    """A video model's workload name: the built-in's where the clip is its default, else with the clip's sides
    (width by height) and frames where they differ (``dit-hunyuan-video 480x320px 17 frames``)."""
    name = m.arch if high_px == m.resolution and wide_px == clip.width else f"{m.arch} {wide_px}x{high_px}px"
    return name if frames == clip.frames else f"{name} {frames} frames"


def template(config: dict) -> ImageModel:
    """The built-in a Wan ``config.json`` is shaped like: 2.2's 5B where its output latents have 48
    channels (its 16x VAE's), else the 14B (its fields replace the size)."""
    out = config.get("out_channels", 16) or config.get("in_channels", 16)  # (diffusers: None is in_channels)
    return WAN_5B if out == WAN_5B.defaults["out_channels"] else WAN


BUILDERS = {
    "dit-wan": (wan, WAN.doc),
    "dit-wan-1.3b": (lambda o, s, r: wan(o, s, r, m=WAN_1_3B), WAN_1_3B.doc),
    "dit-wan-i2v": (lambda o, s, r: wan(o, s, r, m=WAN_I2V), WAN_I2V.doc),
    "dit-wan-5b": (lambda o, s, r: wan(o, s, r, m=WAN_5B), WAN_5B.doc),
    "dit-hunyuan-video": (hunyuan_video, HUNYUAN_VIDEO.doc),
}
"""Built-ins that take ``--resolution``: ``builder(overrides, seq_len, resolution)``."""
