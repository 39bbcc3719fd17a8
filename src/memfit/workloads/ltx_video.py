"""LTX-Video (diffusers' ``LTXVideoTransformer3DModel``), built from its config (no weights), trained as finetrainers
and diffusers' LTX LoRA recipes train it.

``dit-ltx-video``: LTX-Video 0.9 (1.9B, 28 blocks of 2048, 32 heads x 64). Its VAE compresses 8x in time and 32x on
each side into 128 channels (the first frame alone, then groups of 8), and the DiT takes each latent as one token
(1x1x1 patches), packed ``[B, F' * H' * W', 128]`` as its pipeline packs them. So finetrainers' bucket, 49 frames at
768 x 512, is only 7 x 16 x 24 = 2,688 tokens, beside 128 T5-XXL caption tokens with their mask in each block's
cross-attention: a much smaller step than Wan's or CogVideoX's at the same clip, and its later, larger versions
(0.9.7's 13B) are the same class at other sizes, built from their hub config.

The batch is the packed noisy latents, the cached caption states and mask, and the timestep on the 0-1000 scale;
the loss calls the model with the latent grid's frames, height and width and the rotary interpolation scale its
pipeline passes (``(8 / frame_rate, 32, 32)`` at 25 fps), rectified flow (t = 1 is noise), the target
``noise - latents``. ``frames=`` (8k + 1) and ``width=`` size the clip; ``--resolution`` is its height.
"""

from __future__ import annotations

import torch

from memfit.errors import UserError
from memfit.workload import Workload
from memfit.workloads.diffusion import (
    ImageModel,
    config_of,
    flow_matching,
    image_info,
    image_workload,
    latent_sides,
    model_builder,
    no_seq_len,
)
from memfit.workloads.video_dits import Clip, clip_name, latent_frames

LTX_VIDEO = ImageModel(
    "dit-ltx-video", "LTXVideoTransformer3DModel",
    # LTX-Video 0.9: the class defaults (28 blocks of 32 heads x 64, 128 latent channels, T5-XXL's 4096-wide states).
    {}, 512, 128,
    "LTX-Video 0.9 video DiT, 1.9B (diffusers LTXVideoTransformer3DModel; 32x VAE, flow matching, 49 frames at "
    "768x512)", vae_factor=32)
FRAMES, WIDTH, TIME_FACTOR, FRAME_RATE = 49, 768, 8, 25
"""finetrainers' LTX bucket (49 x 512 x 768), the VAE's frames a latent frame after the first, the pipeline's fps."""


def one_token_a_latent(m: ImageModel, kw: dict) -> None:
    """LTX's pipelines (LTX-Video's and LTX-2's) pack one latent a token: 1x1x1 patches, else one line."""
    if kw["patch_size"] != 1 or kw["patch_size_t"] != 1:
        raise UserError(f"{m.arch}: patch_size {kw['patch_size']} and patch_size_t {kw['patch_size_t']}: the pipeline "
                        "packs one latent a token (1 and 1); change the overrides")


def ltx_video(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = LTX_VIDEO) -> Workload:
    """LTX-Video's LoRA step on cached latents and T5 caption states (module docstring); loaded as a checkpoint is."""
    no_seq_len(m.arch, seq_len)
    overrides = dict(overrides)
    frames = overrides.pop("frames", FRAMES)
    depth = latent_frames(m.arch, frames, per=TIME_FACTOR, example=FRAMES)
    width = overrides.pop("width", WIDTH)
    cls, kw = config_of(m, overrides)
    one_token_a_latent(m, kw)
    high, wide, _ = latent_sides(m, resolution, width, 1, "patch size")
    channels, tokens = kw["in_channels"], depth * high * wide
    scale = (TIME_FACTOR / FRAME_RATE, m.vae_factor, m.vae_factor)

    def batch(b: int) -> dict:
        latents, noise, t = torch.randn(b, tokens, channels), torch.randn(b, tokens, channels), torch.rand(b)
        noisy, target = flow_matching(latents, noise, t, data_at_one=False)
        return {"hidden_states": noisy, "timestep": t * 1000,
                "encoder_hidden_states": torch.randn(b, m.caption_tokens, kw["caption_channels"]),
                "encoder_attention_mask": torch.ones(b, m.caption_tokens, dtype=torch.long), "target": target}

    def loss(model, batch: dict) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "target"}
        out = model(**inputs, num_frames=depth, height=high, width=wide, rope_interpolation_scale=scale,
                    return_dict=False)[0]
        return torch.nn.functional.mse_loss(out.float(), batch["target"].float())

    res = high * m.vae_factor
    info = image_info(m, res, kw, ("num_layers", "num_attention_heads", "attention_head_dim", "caption_channels"), 1)
    info.config.update(frames=frames, latent_frames=depth, width=wide * m.vae_factor, tokens=tokens, fixed_width=True)
    wl = image_workload(m, model_builder(m, cls, kw, overrides), batch, loss, res, info)
    wl.name = clip_name(m, res, wide * m.vae_factor, frames, Clip(frames=FRAMES, width=WIDTH))
    return wl


BUILDERS = {"dit-ltx-video": (ltx_video, LTX_VIDEO.doc)}
"""Built-ins that take ``--resolution``: ``builder(overrides, seq_len, resolution)``."""
