"""CogVideoX (diffusers' ``CogVideoXTransformer3DModel``), built from its config (no weights), trained as
diffusers' ``train_cogvideox_lora`` and finetrainers train it.

- ``dit-cogvideox``: CogVideoX-5B (42 blocks of 3072, 48 heads x 64; 3-D rotary positions);
  ``dit-cogvideox-2b``: CogVideoX-2B (30 blocks of 1920, sincos positions). Both take T5-XXL's 226 caption
  tokens, joined to the video's in one stream through every block, each modality modulated by its own adaptive
  LayerNorm (CogVideoX's "expert" norms, with per-head LayerNorms on queries and keys).

Where memory goes. Its VAE compresses 4x in time and 8x on each side (the first frame alone, then groups of
4, as Wan's), and the DiT cuts each latent frame into 2x2 patches: the default clip, 49 frames at 720 x 480,
is 13 x 30 x 45 = 17,550 tokens beside the 226 caption tokens. Activations grow with them and dominate a LoRA
step, so the frame count (``frames=``, 4k + 1) and the clip's sides (``--resolution`` for the height,
``width=``) are its levers, with block checkpointing.

The batch is what the LoRA script's loop holds: the noisy latents laid out ``[B, F', C, H', W']`` (frames
before channels, as the pipeline permutes them), the cached caption states, the DDPM timestep, and the
5B's rotary table, made on the device each step (``prepare_rotary_positional_embeddings``: a ``[tokens,
head_dim]`` cosine and sine, not split by sample). The loss is v-prediction turned into the clean latents
(``scheduler.get_velocity(output, noisy, t)``) against them, weighted by ``1 / (1 - alpha_bar)`` in fp32.
CogVideoX 1.5 (``patch_size_t``: frames patched in pairs, padded by its pipeline) is refused in one line.
"""

from __future__ import annotations

import torch

from memfit.errors import UserError
from memfit.workload import Workload
from memfit.workloads.diffusion import (
    ImageModel,
    alphas_cumprod,
    config_of,
    image_info,
    image_workload,
    latent_sides,
    model_builder,
    no_seq_len,
)
from memfit.workloads.video_dits import Clip, clip_name, latent_frames

COGVIDEOX = ImageModel(
    "dit-cogvideox", "CogVideoXTransformer3DModel",
    # CogVideoX-5B: 42 blocks of 48 heads x 64 with 3-D rotary positions; the class's other defaults (T5-XXL's
    # 4096-wide states, 226 tokens; 16 latent channels in 2x2 patches), trained at 720 x 480, 49 frames.
    {"num_attention_heads": 48, "num_layers": 42, "use_rotary_positional_embeddings": True}, 480, 226,
    "CogVideoX-5B video DiT, 5.6B (diffusers CogVideoXTransformer3DModel; v-prediction, 49 frames at 720x480)")
COGVIDEOX_2B = ImageModel(
    "dit-cogvideox-2b", "CogVideoXTransformer3DModel",
    # CogVideoX-2B: the class defaults (30 blocks of 30 heads x 64, sincos positions).
    {}, 480, 226,
    "CogVideoX-2B video DiT, 1.7B (diffusers CogVideoXTransformer3DModel; v-prediction, 49 frames at 720x480)")
FRAMES, WIDTH = 49, 720
"""The clip CogVideoX was trained on and its LoRA script defaults to (``--max_num_frames``, ``--width``)."""


def cogvideox(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = COGVIDEOX) -> Workload:
    """CogVideoX's LoRA step on cached latents and T5 caption states (module docstring); loaded as a checkpoint is.
    ``frames=`` (4k + 1) and ``width=`` size the clip as ``dit-wan``'s."""
    no_seq_len(m.arch, seq_len)
    overrides = dict(overrides)
    frames, width = overrides.pop("frames", FRAMES), overrides.pop("width", WIDTH)
    depth = latent_frames(m.arch, frames)
    cls, kw = config_of(m, overrides)
    if kw["patch_size_t"]:
        raise UserError(f"{m.arch}: patch_size_t={kw['patch_size_t']} is CogVideoX 1.5's (frames patched in pairs and "
                        "padded by its pipeline), which memfit does not build; predict CogVideoX 1.0 (patch_size_t unset)")
    patch, channels, caption = kw["patch_size"], kw["in_channels"], kw["max_text_seq_length"]
    high, wide, _ = latent_sides(m, resolution, width, patch, "patch size")
    rotary = kw["use_rotary_positional_embeddings"]

    def batch(b: int) -> dict:
        shape = (b, depth, channels, high, wide)
        latents, noise, t = torch.randn(shape), torch.randn(shape), torch.randint(0, 1000, (b,))
        alpha = alphas_cumprod(t)
        a = alpha.view(-1, 1, 1, 1, 1)
        return {"hidden_states": a.sqrt() * latents + (1 - a).sqrt() * noise, "timestep": t,
                "encoder_hidden_states": torch.randn(b, caption, kw["text_embed_dim"]), "alpha": alpha,
                "target": latents}

    def loss(model, batch: dict) -> torch.Tensor:
        noisy, target = batch["hidden_states"], batch["target"]
        emb = _rotary(high, wide, depth, patch, kw["attention_head_dim"], m.vae_factor, noisy.device) if rotary else None
        out = model(hidden_states=noisy, encoder_hidden_states=batch["encoder_hidden_states"], timestep=batch["timestep"],
                    image_rotary_emb=emb, return_dict=False)[0]
        a = batch["alpha"].view(-1, 1, 1, 1, 1)
        pred = a.sqrt() * noisy - (1 - a).sqrt() * out  # (scheduler.get_velocity(output, noisy, t): the clean latents)
        return (1 / (1 - a) * (pred - target) ** 2).reshape(target.shape[0], -1).mean(dim=1).mean()

    res = high * m.vae_factor
    tokens = depth * (high // patch) * (wide // patch)
    info = image_info(m, res, kw, ("num_layers", "num_attention_heads", "attention_head_dim", "text_embed_dim"), patch)
    info.config.update(frames=frames, latent_frames=depth, width=wide * m.vae_factor, tokens=tokens, fixed_width=True)
    wl = image_workload(m, model_builder(m, cls, kw, overrides), batch, loss, res, info)
    wl.name = clip_name(m, res, wide * m.vae_factor, frames, Clip(frames=FRAMES, width=WIDTH))
    return wl


def _rotary(high: int, wide: int, depth: int, patch: int, head_dim: int, vae_factor: int, device):
    """The 5B's rotary table as the LoRA script makes it each step (``prepare_rotary_positional_embeddings``:
    the grid cropped as the 720 x 480 base is resized onto it)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid
    grid = (high // patch, wide // patch)
    base = (COGVIDEOX.resolution // (vae_factor * patch), WIDTH // (vae_factor * patch))
    crops = get_resize_crop_region_for_grid(grid, base[1], base[0])
    return get_3d_rotary_pos_embed(embed_dim=head_dim, crops_coords=crops, grid_size=grid, temporal_size=depth,
                                   device=device)


BUILDERS = {"dit-cogvideox": (cogvideox, COGVIDEOX.doc),
            "dit-cogvideox-2b": (lambda o, s, r: cogvideox(o, s, r, m=COGVIDEOX_2B), COGVIDEOX_2B.doc)}
"""Built-ins that take ``--resolution``: ``builder(overrides, seq_len, resolution)``."""
