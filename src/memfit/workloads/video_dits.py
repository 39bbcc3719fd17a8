"""Video diffusion transformers: Wan 2.1 (diffusers' ``WanTransformer3DModel``, built from its config; no
weights), text-to-video, trained on cached latents as musubi-tuner and diffusers' Wan LoRA scripts train it.

Where memory goes. Wan's VAE compresses 4x in time and 8x on each side, and the DiT cuts the latents
into 1x2x2 patches, so a clip of ``F`` frames at ``R`` px a side is ``((F - 1) / 4 + 1) * (R / 16) ** 2``
tokens: 81 frames at 480 px are 21 x 30 x 30 = 18,900 tokens, against FLUX's 4,096 at 1024 px. Activations
grow with them (attention is flash/efficient on a GPU, linear in them) and dominate once the weights are
LoRA-frozen: fewer frames cut them in steps of 4. At 14B the weights reach a consumer card only in fp8 or
streamed block by block, so the model loads as a checkpoint does (memfit.techniques.loading).

The frame count is the workload's ``frames`` (``dit-wan:frames=33``; ``4k + 1``, the VAE's first frame
alone then groups of 4); ``--resolution`` is the side of a square clip.
"""

from __future__ import annotations

import torch

from memfit.errors import UserError
from memfit.workload import Workload
from memfit.workloads.checks import check_value
from memfit.workloads.diffusion import (
    VAE_FACTOR,
    ImageModel,
    config_of,
    flow_matching,
    image_info,
    image_workload,
    latent_size,
    model_builder,
    no_seq_len,
    transformer_loss,
)

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

FRAMES = 81
"""Frames a clip (Wan's default ``num_frames``: 5 s at 16 fps)."""
TIME_FACTOR = 4
"""Frames per latent frame after the first (Wan's VAE: the first frame alone, then groups of 4)."""


def latent_frames(arch: str, frames) -> int:
    frames = check_value(arch, "frames", frames, (int,), example=FRAMES)
    if frames < 1 or (frames - 1) % TIME_FACTOR:
        lower = max(1, (frames - 1) // TIME_FACTOR * TIME_FACTOR + 1)
        raise UserError(f"{arch}: frames={frames} is not 4k + 1 (the VAE keeps the first frame, then groups of "
                        f"{TIME_FACTOR}); use frames={lower} or frames={lower + TIME_FACTOR}")
    return (frames - 1) // TIME_FACTOR + 1


def wan(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = WAN) -> Workload:
    """Wan 2.1 text-to-video as musubi-tuner and diffusers' Wan LoRA scripts train it: latents and UMT5's
    caption states cached, so the batch is the noisy video latents ``[B, 16, F', H', W']``, the caption
    states (padded to 512 tokens, as the pipeline pads them) and the timestep on the 0-1000 scale; rectified
    flow (t = 1 is noise), the target the velocity ``noise - latents``. Loaded as a checkpoint is."""
    no_seq_len(m.arch, seq_len)
    overrides = dict(overrides)
    frames = overrides.pop("frames", FRAMES)
    depth = latent_frames(m.arch, frames)
    cls, kw = config_of(m, overrides)
    p_t, p_h, p_w = kw["patch_size"]
    if p_h != p_w or depth % p_t:
        raise UserError(f"{m.arch}: patch_size {kw['patch_size']} must be square on a side and divide the "
                        f"{depth} latent frames; change the overrides")
    side = latent_size(m, resolution, p_h, "patch size")
    channels = kw["in_channels"]

    def batch(b: int) -> dict:
        shape = (b, channels, depth, side, side)
        latents, noise, t = torch.randn(shape), torch.randn(shape), torch.rand(b)
        noisy, target = flow_matching(latents, noise, t, data_at_one=False)
        return {"hidden_states": noisy, "timestep": t * 1000,
                "encoder_hidden_states": torch.randn(b, m.caption_tokens, kw["text_dim"]), "target": target}

    res = side * VAE_FACTOR
    info = image_info(m, res, kw, ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim"), p_h)
    info.config.update(frames=frames, latent_frames=depth)
    wl = image_workload(m, model_builder(m, cls, kw, overrides), batch, transformer_loss, res, info)
    if frames != FRAMES:
        wl.name += f" {frames} frames"
    wl.from_checkpoint = True
    return wl


BUILDERS = {
    "dit-wan": (wan, WAN.doc),
    "dit-wan-1.3b": (lambda o, s, r: wan(o, s, r, m=WAN_1_3B), WAN_1_3B.doc),
}
"""Built-ins that take ``--resolution``: ``builder(overrides, seq_len, resolution)``."""
