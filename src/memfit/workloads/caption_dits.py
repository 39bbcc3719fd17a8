"""Diffusion transformers fed one text encoder's caption states: SANA, PixArt-Sigma and AuraFlow (diffusers'
DiTs, built from their configs; no weights).

Each attends to one encoder's states, cached as diffusers' LoRA scripts and SimpleTuner cache them
(memfit.workloads.diffusion explains what is and is not trained), and takes its latents unpacked,
``[B, C, H, W]``, cutting them into patches itself. What differs is where their memory goes:

- **SANA** (``dit-sana``, Sana 1600M 1024px: 20 blocks of 2240): its VAE (DC-AE) compresses 32x on a side
  into 32 channels and its patches are 1x1, so a 1024 px image is only 32 x 32 = 1,024 tokens, a quarter of
  FLUX.1's. Its self-attention is linear (``SanaLinearAttnProcessor2_0``: ReLU features, no ``L x L``
  scores), its cross-attention reads 300 Gemma-2-2B tokens with their mask. So its activations grow
  linearly with the pixels, and at 1024 px they are small beside its 1.6B weights. Rectified flow (t = 1 is
  noise), timestep ``t * 1000``, the target ``noise - latents``: diffusers' ``train_dreambooth_lora_sana``.
- **PixArt-Sigma** (``dit-pixart-sigma``, PixArt-Sigma-XL-2-1024-MS: 28 blocks of 1152, 0.6B): the SD/SDXL
  VAE (8x, 4 channels), 2x2 patches (4,096 tokens at 1024 px), 300 T5-XXL tokens with their mask in each
  block's cross-attention. Epsilon prediction on DDPM timesteps; its output has twice the latent channels
  (the learned variance), and training compares the first half with the noise, as diffusers' PixArt LoRA
  script (``out_channels // 2 == latent_channels``) and SimpleTuner do. Small weights, so at 1024 px its
  activations are most of a LoRA step. A PixArt-alpha config (its micro-conditions unset, 128 latents) gets them
  as diffusers decides: the image's size and aspect ratio as two more inputs.
- **AuraFlow** (``dit-auraflow``, AuraFlow v0.3: 4 joint MMDiT blocks then 32 single-stream blocks of 3072,
  6.8B): the SDXL VAE, 2x2 patches, 256 Pile-T5 (UMT5) tokens joined to the image tokens in every block's
  attention. Rectified flow as SD3's, with the timestep a fraction (its pipeline passes ``t / 1000``). Its
  position table holds ``pos_embed_max_size`` patches (9,216: 96 x 96, up to 1,536 px a side). The config's
  ``sample_size`` (64) is not the pipeline's size: ``AuraFlowPipeline`` makes 1024 px, the native here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from memfit.errors import UserError
from memfit.workload import Workload
from memfit.workloads.diffusion import (
    ImageModel,
    alphas_cumprod,
    config_of,
    flow_matching,
    given_width,
    image_info,
    image_workload,
    latent_sides,
    model_builder,
    no_seq_len,
    transformer_loss,
)

SANA = ImageModel(
    "dit-sana", "SanaTransformer2DModel",
    # Sana 1600M 1024px: the class defaults (20 blocks of 2240: 70 linear-attention heads x 32, 20 cross-attention
    # heads x 112; 1x1 patches of DC-AE's 32 channels; Gemma-2-2B's 2304-wide states), 300 caption tokens.
    {}, 1024, 300,
    "Sana 1600M DiT, 1.6B (diffusers SanaTransformer2DModel; linear attention, DC-AE 32x latents, flow matching, "
    "1024px)", vae_factor=32)
PIXART_SIGMA = ImageModel(
    "dit-pixart-sigma", "PixArtTransformer2DModel",
    # PixArt-Sigma-XL-2-1024-MS: the class defaults (28 blocks of 1152, 16 heads x 72; 2x2 patches of 4 latent
    # channels, 8 out: the learned variance) with T5-XXL's 4096-wide captions and no micro-conditions.
    {"caption_channels": 4096, "use_additional_conditions": False, "interpolation_scale": 2}, 1024, 300,
    "PixArt-Sigma XL DiT, 0.6B (diffusers PixArtTransformer2DModel; T5 captions, epsilon prediction, 1024px)")
AURAFLOW = ImageModel(
    "dit-auraflow", "AuraFlowTransformer2DModel",
    # AuraFlow v0.3: the class defaults (4 MMDiT + 32 single DiT blocks of 3072, 12 heads x 256; Pile-T5's
    # 2048-wide states) and the released position table of 96 x 96 patches; 256 caption tokens.
    {"pos_embed_max_size": 9216}, 1024, 256,
    "AuraFlow v0.3 DiT, 6.8B (diffusers AuraFlowTransformer2DModel; flow matching, 1024px)",
    native_from_config=False)

def _sides(m: ImageModel, overrides: dict, seq_len: int | None, resolution: int | None, patch_key: str):
    no_seq_len(m.arch, seq_len)
    overrides, width = given_width(overrides)
    cls, kw = config_of(m, overrides)
    return overrides, cls, kw, latent_sides(m, resolution, width, kw[patch_key], "patch size")


def _workload(m: ImageModel, overrides: dict, cls, kw: dict, sides, batch, loss, sizes: tuple[str, ...],
              patch: int) -> Workload:
    res = sides.high * m.vae_factor
    info = image_info(m, res, kw, sizes, patch, sides)
    return image_workload(m, model_builder(m, cls, kw, overrides), batch, loss, res, info)


def sana(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = SANA) -> Workload:
    """SANA's step on cached DC-AE latents and Gemma-2 caption states with their mask (module docstring)."""
    overrides, cls, kw, sides = _sides(m, overrides, seq_len, resolution, "patch_size")
    channels, text = kw["in_channels"], kw["caption_channels"]

    def batch(b: int) -> dict:
        latents, noise, t = (torch.randn(b, channels, sides.high, sides.wide),
                             torch.randn(b, channels, sides.high, sides.wide), torch.rand(b))
        noisy, target = flow_matching(latents, noise, t, data_at_one=False)
        out = {"hidden_states": noisy, "timestep": t * 1000, "encoder_hidden_states": torch.randn(b, m.caption_tokens, text),
               "encoder_attention_mask": torch.ones(b, m.caption_tokens, dtype=torch.long), "target": target}
        return {**out, "guidance": torch.full((b,), 4.5)} if kw.get("guidance_embeds") else out  # (SANA-Sprint's)

    return _workload(m, overrides, cls, kw, sides, batch, transformer_loss,
                     ("num_layers", "num_attention_heads", "attention_head_dim", "caption_channels"), kw["patch_size"])


def pixart_sigma(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = PIXART_SIGMA) -> Workload:
    """PixArt-Sigma's step on cached latents and T5-XXL caption states with their mask, epsilon prediction on the
    first half of its output's channels (module docstring)."""
    overrides, cls, kw, sides = _sides(m, overrides, seq_len, resolution, "patch_size")
    channels, text = kw["in_channels"], kw["caption_channels"]
    if not text:
        raise UserError(f"{m.arch}: caption_channels must be the text encoder's width (T5-XXL's 4096), got {text!r}")
    out_channels = kw["out_channels"] or channels
    if out_channels not in (channels, 2 * channels):
        raise UserError(f"{m.arch}: out_channels={out_channels} must be in_channels ({channels}) or twice it (with the "
                        "learned variance); change the overrides")
    steps = kw["num_embeds_ada_norm"]
    micro = kw["use_additional_conditions"]  # (unset: diffusers' rule, PixArt-alpha 1024's 128 latents use them)
    micro = kw["sample_size"] == 128 if micro is None else micro

    def batch(b: int) -> dict:
        latents, noise = torch.randn(b, channels, sides.high, sides.wide), torch.randn(b, channels, sides.high, sides.wide)
        t = torch.randint(0, steps, (b,))
        alpha = alphas_cumprod(t, steps).view(-1, 1, 1, 1)
        out = {"hidden_states": alpha.sqrt() * latents + (1 - alpha).sqrt() * noise, "timestep": t,
               "encoder_hidden_states": torch.randn(b, m.caption_tokens, text),
               "encoder_attention_mask": torch.ones(b, m.caption_tokens, dtype=torch.long), "target": noise}
        if micro:  # (PixArt-alpha's micro-conditions: the image's size and aspect ratio)
            px = float(sides.high * m.vae_factor)
            out["resolution"], out["aspect_ratio"] = torch.tensor([[px, px]]).repeat(b, 1), torch.ones(b, 1)
        return out

    def loss(model, batch: dict) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k not in ("target", "resolution", "aspect_ratio")}
        added = {k: batch[k] for k in ("resolution", "aspect_ratio") if k in batch}
        pred = model(**inputs, added_cond_kwargs=added or None, return_dict=False)[0]
        if pred.shape[1] == 2 * batch["target"].shape[1]:  # (the learned variance is not in the loss)
            pred = pred.chunk(2, dim=1)[0]
        return F.mse_loss(pred.float(), batch["target"].float())

    return _workload(m, overrides, cls, kw, sides, batch, loss,
                     ("num_layers", "num_attention_heads", "attention_head_dim", "caption_channels"), kw["patch_size"])


def auraflow(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = AURAFLOW) -> Workload:
    """AuraFlow's step on cached latents and Pile-T5 caption states (module docstring)."""
    overrides, cls, kw, sides = _sides(m, overrides, seq_len, resolution, "patch_size")
    patch, grid = kw["patch_size"], math.isqrt(kw["pos_embed_max_size"])
    most = grid * patch * m.vae_factor
    for flag, side in (("--resolution ", sides.high), ("width=", sides.wide)):
        if side * m.vae_factor > most:
            raise UserError(f"{m.arch}: {flag}{side * m.vae_factor} exceeds the position table (pos_embed_max_size="
                            f"{kw['pos_embed_max_size']}: {grid} x {grid} patches, {most}px); use {flag}<= {most}")
    channels, text = kw["in_channels"], kw["joint_attention_dim"]

    def batch(b: int) -> dict:
        latents, noise, t = (torch.randn(b, channels, sides.high, sides.wide),
                             torch.randn(b, channels, sides.high, sides.wide), torch.rand(b))
        noisy, target = flow_matching(latents, noise, t, data_at_one=False)
        return {"hidden_states": noisy, "timestep": t, "encoder_hidden_states": torch.randn(b, m.caption_tokens, text),
                "target": target}

    return _workload(m, overrides, cls, kw, sides, batch, transformer_loss,
                     ("num_mmdit_layers", "num_single_dit_layers", "num_attention_heads", "attention_head_dim"), patch)


BUILDERS = {"dit-sana": (sana, SANA.doc), "dit-pixart-sigma": (pixart_sigma, PIXART_SIGMA.doc),
            "dit-auraflow": (auraflow, AURAFLOW.doc)}
"""Built-ins that take ``--resolution``: ``builder(overrides, seq_len, resolution)``."""
