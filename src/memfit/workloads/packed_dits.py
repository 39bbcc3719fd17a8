"""Diffusion transformers fed packed latent tokens: FLUX.1, Chroma, FLUX.2 and Qwen-Image (diffusers' DiTs,
built from their configs; no weights).

Their pipelines cut the VAE's latents into 2x2 patches and feed each patch as one token of 4x the latent
channels (``_pack_latents``; FLUX.2 puts the patch in channels first, ``_patchify_latents``), so a
1024 px image is (1024 / 16) ** 2 = 4096 tokens beside the caption's, and the denoiser's output is
compared with the velocity in the same packed layout. The text encoder's states and the VAE's latents
are cached inputs, as kohya's ``--cache_latents`` and ``--cache_text_encoder_outputs`` and diffusers' LoRA
scripts keep them (memfit.workloads.diffusion explains what is and is not trained). At 12B (FLUX.1),
20B (Qwen-Image) and 32B (FLUX.2) their weights reach a consumer card only in fp8 or streamed block by
block, so each loads as a checkpoint does (memfit.techniques.loading).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.errors import UserError
from memfit.workload import Workload
from memfit.workloads.diffusion import (
    VAE_FACTOR,
    ImageModel,
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

FLUX = ImageModel(
    "dit-flux", "FluxTransformer2DModel",
    # FLUX.1-dev: the class defaults (19 double-stream + 38 single-stream blocks, 24 heads x 128, T5 4096 wide,
    # CLIP pooled 768, 64 input channels: 2x2 patches of 16 latent channels) and its guidance embedding.
    {"guidance_embeds": True}, 1024, 512,
    "FLUX.1-dev DiT, 11.9B (diffusers FluxTransformer2DModel; flow matching with guidance, 1024px)")

QWEN_IMAGE = ImageModel(
    "dit-qwenimage", "QwenImageTransformer2DModel",
    # Qwen-Image: the class defaults (60 double-stream blocks of 3072, 24 heads x 128; 2x2 patches of 16 latent
    # channels; Qwen2.5-VL-7B's 3584-wide hidden states as captions), at the pipeline's 1024 px and 512 tokens.
    {}, 1024, 512,
    "Qwen-Image MMDiT, 20.4B (diffusers QwenImageTransformer2DModel; flow matching, 1024px)")

FLUX2 = ImageModel(
    "dit-flux2", "Flux2Transformer2DModel",
    # FLUX.2-dev: the class defaults (8 double-stream + 48 single-stream blocks of 6144, 48 heads x 128; 128 input
    # channels: 2x2 patches of 32 latent channels; Mistral-Small-3.1's three stacked hidden states, 15360 wide, as
    # captions) and its guidance embedding, at the pipeline's 1024 px and 512 tokens.
    {}, 1024, 512,
    "FLUX.2-dev DiT, 32.2B (diffusers Flux2Transformer2DModel; flow matching with guidance, 1024px)")

CHROMA = ImageModel(
    "dit-chroma", "ChromaTransformer2DModel",
    # Chroma1-HD: the class defaults (FLUX.1-schnell's 19 double-stream + 38 single-stream blocks, 24 heads x 128,
    # T5 4096 wide; the modulation from a 5-layer approximator in place of FLUX's per-block linears; no CLIP, no
    # guidance), at the pipeline's 1024 px and 512 T5 tokens.
    {}, 1024, 512,
    "Chroma1-HD DiT, 8.9B (diffusers ChromaTransformer2DModel; flow matching, T5 only, 1024px)")

FLUX_PACK = 2
"""Flux's pipeline packs 2x2 latent pixels into one token (``FluxPipeline._pack_latents``)."""
FLUX_GUIDANCE = 1.0
"""The guidance value fed to FLUX.1-dev's guidance embedding in training (kohya's ``--guidance_scale``)."""
SCHNELL_TOKENS = 256
"""T5 tokens a caption for FLUX.1-schnell (no guidance embedding): its pipeline's and kohya's limit (dev: 512)."""


def flux(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = FLUX) -> Workload:
    """FLUX.1-dev as kohya's sd-scripts and diffusers' ``train_dreambooth_lora_flux`` train it: latents
    and T5/CLIP outputs cached (``--cache_latents``, ``--cache_text_encoder_outputs``), so the batch is
    the packed noisy latents, the text states, the pooled CLIP vector, the guidance value and the
    position ids; rectified flow (t = 1 is noise), the target the velocity ``noise - latents``. The
    model loads as a checkpoint does (built on the meta device, each weight made in its final form:
    memfit.techniques.loading), as ``from_pretrained`` and kohya's loader bring it to the card. With
    ``text_encoders=frozen|trained`` (and ``t5=``) CLIP-L and T5-XXL run in the step, the batch holding
    the captions' token ids in place of their outputs (memfit.workloads.text_encoders). ``t5_tokens=N``:
    T5 tokens a caption (kohya's ``t5xxl_max_token_length``, diffusers' ``--max_sequence_length``; default
    512, and schnell's 256). ``t5_mask=true``: kohya's ``apply_t5_attn_mask`` (NOTE [ kohya's T5 attention
    mask ]). ``control_images=1``: FLUX.1 Kontext's edit pairs (NOTE [ Kontext's reference image ])."""
    from memfit.workloads import text_encoders as te
    overrides = dict(overrides)
    controls = overrides.pop("control_images", 0)
    if controls not in (0, 1) or isinstance(controls, bool):
        raise UserError(f"{m.arch}: control_images={controls!r} must be 0 or 1 (FLUX.1 Kontext takes one reference image)")
    overrides, text, layers = te.text_mode(m.arch, overrides, t5=True)
    overrides, t5 = te.t5_mode(m.arch, overrides, text)
    overrides, caption = te.t5_tokens(m.arch, overrides)
    masked = overrides.pop("t5_mask", False)
    if not isinstance(masked, bool):
        raise UserError(f"{m.arch}: t5_mask={masked} must be true or false (kohya's apply_t5_attn_mask)")

    def inputs(b: int, kw: dict, high: int, wide: int) -> dict:
        rows, cols = torch.arange(high).repeat_interleave(wide), torch.arange(wide).repeat(high)
        guidance = {"guidance": torch.full((b,), FLUX_GUIDANCE)} if kw["guidance_embeds"] else {}  # (not schnell's)
        tokens = caption or (m.caption_tokens if kw["guidance_embeds"] else SCHNELL_TOKENS)
        out = {**guidance, "encoder_hidden_states": torch.randn(b, tokens, kw["joint_attention_dim"]),
               "pooled_projections": torch.randn(b, kw["pooled_projection_dim"]),
               "img_ids": torch.stack([torch.zeros(high * wide), rows.float(), cols.float()], dim=1),
               "txt_ids": torch.zeros(tokens, 3)}
        if text != "cached":  # (the encoders run in the step: their token ids stand for what they give)
            del out["pooled_projections"]
            if t5 == "frozen":
                del out["encoder_hidden_states"]
            out["ids"] = te.t5_token_ids(b, 1, tokens if t5 == "frozen" else None)
        if masked:  # (each caption's T5 padding mask; all of it kept here: its bytes are what count)
            out["t5_attention_mask"] = torch.ones(b, tokens, dtype=torch.bool)
        if controls:  # (the reference image's tokens: the same positions on the first axis 1)
            out["img_ids"] = torch.cat([out["img_ids"], out["img_ids"].index_fill(1, torch.tensor([0]), 1.0)])
        return out

    def wrap(model: Callable[[], torch.nn.Module], kw: dict) -> Callable[[], torch.nn.Module]:
        dit = (lambda: _with_t5_mask(model())) if masked else model
        if text == "cached":
            return dit
        configs = te.chosen(m.text_configs, te.flux_configs(kw["pooled_projection_dim"], kw["joint_attention_dim"],
                                                           t5 == "frozen", layers), layers)
        return lambda: te.FluxWithTextEncoders(dit(), configs, text == "trained")
    wl = _packed_workload(m, overrides, seq_len, resolution, _pack, inputs,
                          ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
                           "joint_attention_dim"), wrap if text != "cached" or masked else None, controls)
    if controls:
        wl.info.config["control_images"] = controls
        wl.name += " with a reference image"
    if caption:
        wl.info.config["t5_tokens"] = caption
    if masked:
        wl.info.config["t5_mask"] = True
    return te.labelled(wl, text, t5) if text != "cached" else wl


# NOTE [ kohya's T5 attention mask ]
# sd-scripts' ``apply_t5_attn_mask`` masks each caption's T5 padding in FLUX.1's attention. Its blocks build the
# mask as a boolean [B, L] over the text and image tokens, viewed as [B, heads, L, L] (``expand``: no bytes) and
# given to SDPA, which turns a boolean mask into an additive one of the query's dtype (``where(mask, 0, -inf)``):
# that materialises all of [B, heads, L, L] in bf16, 1 GB for one 1024 px image (24 heads, 4,608 tokens) in
# every attention call, and the fused kernel keeps it for backward. (torch before 2.6 inverted the mask first:
# a bool copy of it too, 0.5 GB more.) The
# workload gives the model the same expanded mask (a forward pre-hook turns the batch's ``t5_attention_mask``
# into ``joint_attention_kwargs``, which diffusers' FLUX blocks hand to SDPA), so the trace holds what
# sd-scripts' does. (diffusers' own 2-D mask would be unsqueezed to [B, 1, 1, L] and cost nothing.)
def _with_t5_mask(model: torch.nn.Module) -> torch.nn.Module:
    model.register_forward_pre_hook(_t5_mask_to_attention, with_kwargs=True)
    return model


def _t5_mask_to_attention(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    mask = kwargs.pop("t5_attention_mask", None)
    if mask is not None:
        b, image = mask.shape[0], kwargs["hidden_states"].shape[1]
        tokens = mask.shape[1] + image
        joint = torch.cat([mask, mask.new_ones(b, image)], dim=1)[:, None, None, :]
        heads = module.config.num_attention_heads
        kwargs["joint_attention_kwargs"] = {"attention_mask": joint.expand(b, heads, tokens, tokens)}
    return args, kwargs


def chroma(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = CHROMA) -> Workload:
    """Chroma as diffusers' ``ChromaPipeline`` feeds it, with latents and T5-XXL's caption states cached:
    the batch the 2x2-packed noisy latents (as FLUX's), the caption states, the position ids (FLUX's), the
    timestep as a fraction, and the caption's T5 mask extended over the image tokens
    (``ChromaPipeline._prepare_attention_mask``). Each block squares that mask into [B, 1, L, L] booleans
    before its attention (``mask[:, None, None, :] * mask[:, None, :, None]``), so the trace holds what a
    training step does. Rectified flow (t = 1 is noise), the target the velocity. Loaded as a checkpoint is."""
    def inputs(b: int, kw: dict, high: int, wide: int) -> dict:
        rows, cols = torch.arange(high).repeat_interleave(wide), torch.arange(wide).repeat(high)
        return {"encoder_hidden_states": torch.randn(b, m.caption_tokens, kw["joint_attention_dim"]),
                "img_ids": torch.stack([torch.zeros(high * wide), rows.float(), cols.float()], dim=1),
                "txt_ids": torch.zeros(m.caption_tokens, 3),
                "attention_mask": torch.ones(b, m.caption_tokens + high * wide, dtype=torch.bool)}
    return _packed_workload(m, overrides, seq_len, resolution, _pack, inputs,
                            ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
                             "joint_attention_dim"))


def qwen_image(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = QWEN_IMAGE) -> Workload:
    """Qwen-Image as diffusers' ``train_dreambooth_lora_qwen_image`` and musubi-tuner train it: latents and
    Qwen2.5-VL's caption states cached, so the batch is the packed noisy latents (2x2 latent pixels a token,
    as FLUX packs them), the caption states with their mask, each sample's latent grid for the rotary
    positions (``img_shapes``), and the timestep as a fraction (the pipeline's ``t / 1000``); rectified flow
    (t = 1 is noise), the target the velocity ``noise - latents``. Loaded as a checkpoint is.
    ``caption_tokens=N``: the caption states' length (default 512). ``control_images=N``: Qwen-Image-Edit's
    reference images (1; Edit-2509's up to 3), their tokens joined after the noisy ones as Kontext's (NOTE [ Kontext's
    reference image ]), each grid an entry of ``img_shapes``; ``control_px=P``: each reference a square of P pixels
    (Edit-2509's pipeline encodes them at 1 MP whatever the target's size; default: the target's size)."""
    overrides = dict(overrides)
    controls = overrides.pop("control_images", 0)
    caption = overrides.pop("caption_tokens", m.caption_tokens)
    side = overrides.pop("control_px", None)
    if controls not in (0, 1, 2, 3) or isinstance(controls, bool):
        raise UserError(f"{m.arch}: control_images={controls!r} must be 0 to 3 (Qwen-Image-Edit's reference images)")
    if not isinstance(caption, int) or isinstance(caption, bool) or caption < 1:
        raise UserError(f"{m.arch}: caption_tokens={caption!r} must be a positive whole number of tokens")
    if side is not None and (not isinstance(side, int) or isinstance(side, bool) or side < 32 or side % 32):
        raise UserError(f"{m.arch}: control_px={side!r} must be a multiple of 32 pixels (the VAE's 8 x 2x2 packing x 2)")

    def inputs(b: int, kw: dict, high: int, wide: int) -> dict:
        grid = (1, high, wide)
        reference = grid if side is None else (1, side // (VAE_FACTOR * FLUX_PACK), side // (VAE_FACTOR * FLUX_PACK))
        return {"encoder_hidden_states": torch.randn(b, caption, kw["joint_attention_dim"]),
                "encoder_hidden_states_mask": torch.ones(b, caption, dtype=torch.long),
                "img_shapes": [[grid] + [reference] * controls] * b}
    wl = _packed_workload(m, overrides, seq_len, resolution, _pack, inputs,
                          ("num_layers", "num_attention_heads", "attention_head_dim", "joint_attention_dim"),
                          controls=controls, control_latent=None if side is None else side // VAE_FACTOR)
    if caption != m.caption_tokens:
        wl.info.config["caption_tokens"] = caption
    if controls:
        wl.info.config["control_images"] = controls
        wl.name += " with a reference image" if controls == 1 else f" with {controls} reference images"
    if side is not None:
        wl.info.config["control_px"] = side
    return wl


def flux2(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = FLUX2) -> Workload:
    """FLUX.2-dev as diffusers' ``train_dreambooth_lora_flux2`` trains it: latents and the text encoder's states
    cached, so the batch is the noisy latents patchified 2x2 into channels and flattened to tokens
    (``Flux2Pipeline._patchify_latents``, ``_pack_latents``), the caption states, the guidance value, the
    4-axis position ids of image and text tokens (time, row, column, layer), and the timestep as a fraction;
    rectified flow (t = 1 is noise), the target the velocity ``noise - latents``. Loaded as a checkpoint is."""
    def inputs(b: int, kw: dict, high: int, wide: int) -> dict:
        one = torch.arange(1)
        img_ids = torch.cartesian_prod(one, torch.arange(high), torch.arange(wide), one)
        txt_ids = torch.cartesian_prod(one, one, one, torch.arange(m.caption_tokens))
        guidance = {"guidance": torch.full((b,), FLUX_GUIDANCE)} if kw["guidance_embeds"] else {}
        return {**guidance, "encoder_hidden_states": torch.randn(b, m.caption_tokens, kw["joint_attention_dim"]),
                "img_ids": img_ids.expand(b, -1, -1), "txt_ids": txt_ids.expand(b, -1, -1)}
    return _packed_workload(m, overrides, seq_len, resolution, _patchify, inputs,
                            ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
                             "joint_attention_dim"))


def _packed_workload(m: ImageModel, overrides: dict, seq_len: int | None, resolution: int | None,
                     layout: Callable[[torch.Tensor], torch.Tensor], inputs: Callable[[int, dict, int, int], dict],
                     sizes: tuple[str, ...], wrap: Callable | None = None, controls: int = 0,
                     control_latent: int | None = None) -> Workload:
    """The workload of a DiT fed 2x2-packed latent tokens: rectified flow (t = 1 is noise) on latents of
    ``in_channels / 4`` channels, the noisy latents and the velocity target in the pipeline's ``layout``,
    the timestep as a fraction, and the model's other ``inputs(batch, config, token rows, token columns)``;
    loaded as a checkpoint is. ``wrap(model, config)``: the model function the step trains, around the DiT's.
    ``controls``: reference images' latents joined after the noisy ones, the loss on the noisy tokens' output
    (each as large as the target, or squares of ``control_latent`` latent pixels)."""
    no_seq_len(m.arch, seq_len)
    overrides, width = given_width(overrides)
    cls, kw = config_of(m, overrides)
    if kw["in_channels"] % FLUX_PACK ** 2:
        raise UserError(f"{m.arch}: in_channels {kw['in_channels']} must be a multiple of 4 (2x2 latent pixels "
                        "per token); change the overrides")
    high, wide, _ = sides = latent_sides(m, resolution, width, FLUX_PACK * kw["patch_size"],
                                         "2x2 packing times patch size")
    channels = kw["in_channels"] // FLUX_PACK ** 2

    def batch(b: int) -> dict:
        latents, noise, t = torch.randn(b, channels, high, wide), torch.randn(b, channels, high, wide), torch.rand(b)
        noisy, target = flow_matching(latents, noise, t, data_at_one=False)
        ch, cw = (high, wide) if control_latent is None else (control_latent, control_latent)
        joined = torch.cat([layout(noisy), *(layout(torch.randn(b, channels, ch, cw)) for _ in range(controls))], 1)
        return {"hidden_states": joined, "timestep": t, **inputs(b, kw, high // FLUX_PACK, wide // FLUX_PACK),
                "target": layout(target)}

    res = high * VAE_FACTOR
    info = image_info(m, res, kw, sizes, FLUX_PACK * kw["patch_size"], sides)
    model = model_builder(m, cls, kw, overrides)
    return image_workload(m, wrap(model, kw) if wrap else model, batch, transformer_loss, res, info)


# NOTE [ Kontext's reference image ]
# FLUX.1 Kontext edits an image: the reference (ai-toolkit's control image, the pipeline's ``image``) is encoded by
# the VAE at the target's size, packed as the noisy latents are, and joined after them on the token axis, its
# position ids those of the target's tokens with the first axis 1 (ai-toolkit's ``get_noise_prediction``, diffusers'
# ``FluxKontextPipeline``). Every block then attends over twice the image tokens (8,192 at 1024 px, beside the
# caption's 512), and the denoiser's output is cut to the noisy tokens before the loss (transformer_loss, in
# memfit.workloads.diffusion). ai-toolkit encodes the reference in each step (its latents are not cached): the VAE's
# encoder runs before the forward, not in this batch.


def _patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C], channel-major within each 2x2 patch (FLUX.2's pipeline:
    ``_patchify_latents`` then ``_pack_latents``)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // FLUX_PACK, FLUX_PACK, w // FLUX_PACK, FLUX_PACK).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * FLUX_PACK ** 2, (h // FLUX_PACK) * (w // FLUX_PACK)).permute(0, 2, 1)


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C]: each 2x2 patch one token (``FluxPipeline._pack_latents``)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // FLUX_PACK, FLUX_PACK, w // FLUX_PACK, FLUX_PACK).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // FLUX_PACK) * (w // FLUX_PACK), c * FLUX_PACK ** 2)


BUILDERS = {
    "dit-flux": (flux, FLUX.doc),
    "dit-qwenimage": (qwen_image, QWEN_IMAGE.doc),
    "dit-flux2": (flux2, FLUX2.doc),
    "dit-chroma": (chroma, CHROMA.doc),
}
"""Built-ins that take ``--resolution``: ``builder(overrides, seq_len, resolution)``."""
