"""Z-Image (Tongyi-MAI's single-stream DiT, 6.2B): diffusers' ``ZImageTransformer2DModel`` from its config,
fed as its pipeline feeds it (no weights).

Its forward takes lists, one tensor a sample: each image's latents ``[C, 1, H, W]`` (a frame axis of one)
and each caption's Qwen3-4B states ``[L_i, 2560]`` with the padding already cut away
(``ZImagePipeline._encode_prompt`` keeps ``prompt_embeds[i][mask[i]]``). Inside, it patchifies each image
2x2, pads every caption and image to a multiple of 32 tokens, refines each stream alone (two noise and two
context refiner layers), then runs 30 layers over the joined sequence. The batch here holds the latents
and caption states as ``[B, ...]`` tensors (so that micro-batches split them as any batch), and the loss
cuts them into the model's lists, as the pipeline's ``unbind`` does.

Captions. A step's peak is its longest caption's: the default is the pipeline's ``max_sequence_length``
(512 tokens), every caption as long as it may be. Training sets with short captions peak lower;
``caption_tokens=N`` says how long the longest is.

Its text encoder, Qwen3-4B, runs in the step with ``text_encoders=frozen`` (ai-toolkit's Z-Image LoRA without
cached text embeddings; memfit.workloads.text_encoders); by default the captions' states are cached inputs.

Rectified flow as its pipeline runs it: the model's timestep is ``(1000 - t) / 1000``, so 1 is the image,
and its output is ``latents - noise`` (the pipeline negates it for the scheduler's ``noise - latents``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfit.errors import UserError
from memfit.workload import Workload
from memfit.workloads.diffusion import (
    VAE_FACTOR,
    ImageModel,
    config_of,
    flow_matching,
    given_width,
    held_workload,
    image_info,
    latent_sides,
    model_builder,
    no_seq_len,
)

ZIMAGE = ImageModel(
    "dit-zimage", "ZImageTransformer2DModel",
    # Z-Image (Turbo and Base share it): the class defaults (30 layers of 3840, 30 heads; 2 noise and 2 context
    # refiner layers; Qwen3-4B's 2560-wide states as captions; 2x2 patches of 16 latent channels), at 1024 px.
    {}, 1024, 512,
    "Z-Image DiT, 6.2B (diffusers ZImageTransformer2DModel; flow matching, single stream, 1024px)")


def zimage(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = ZIMAGE) -> Workload:
    """Z-Image's step on cached latents and caption states (see the module's docstring); loaded as a checkpoint
    is. ``caption_tokens=N``: the longest caption's tokens (default 512, the pipeline's most); ``text_encoders=frozen``:
    Qwen3-4B in the step."""
    from memfit.workloads import text_encoders as te
    no_seq_len(m.arch, seq_len)
    overrides, width = given_width(overrides)
    overrides, text_mode, layers = te.text_mode(m.arch, overrides)
    if text_mode == "trained":
        raise UserError(f"{m.arch}: text_encoders=trained: memfit trains no Qwen3-4B (ai-toolkit's Z-Image LoRA "
                        "leaves it frozen); use text_encoders=frozen or cached")
    caption = overrides.pop("caption_tokens", m.caption_tokens)
    if not isinstance(caption, int) or isinstance(caption, bool) or caption < 1:
        raise UserError(f"{m.arch}: caption_tokens={caption} must be a positive whole number of tokens")
    if text_mode != "cached" and caption > te.QWEN3_TOKENS:
        raise UserError(f"{m.arch}: caption_tokens={caption} exceeds the {te.QWEN3_TOKENS} tokens the pipeline encodes a "
                        f"caption in; use caption_tokens <= {te.QWEN3_TOKENS}")
    cls, kw = config_of(m, overrides)
    patch = kw["all_patch_size"][0]
    high, wide, _ = sides = latent_sides(m, resolution, width, patch, "patch size")
    channels, text = kw["in_channels"], kw["cap_feat_dim"]
    encoders = te.chosen(m.text_configs, te.zimage_configs(text, layers), layers) if text_mode != "cached" else []

    def batch(b: int) -> dict:
        latents, noise, t = torch.randn(b, channels, high, wide), torch.randn(b, channels, high, wide), torch.rand(b)
        noisy, target = flow_matching(latents, noise, t, data_at_one=True)
        out = {"x": noisy.unsqueeze(2), "t": t, "target": target}
        if not encoders:
            return {**out, "cap_feats": torch.randn(b, caption, text)}
        out["ids"], out["mask"] = te.qwen3_token_ids(b, caption, encoders[0].vocab_size)
        return out

    res = high * VAE_FACTOR
    info = image_info(m, res, kw, ("dim", "n_layers", "n_heads", "cap_feat_dim"), patch, sides)
    if caption != m.caption_tokens:
        info.config["caption_tokens"] = caption
    return held_workload(m, model_builder(m, cls, kw, overrides), batch, _list_loss, res, info, encoders,
                         te.ZImageWithTextEncoders, text_mode)


def _list_loss(model, batch: dict) -> torch.Tensor:
    """The model called as the pipeline calls it (a list of each sample's latents and caption states); its list
    of outputs, stacked, against the target."""
    captions = (list(batch["cap_feats"].unbind(0)),) if "cap_feats" in batch else (batch["ids"], batch["mask"])
    out = model(list(batch["x"].unbind(0)), batch["t"], *captions, return_dict=False)[0]
    return F.mse_loss(torch.stack(out).squeeze(2).float(), batch["target"].float())


BUILDERS = {"dit-zimage": (zimage, ZIMAGE.doc)}
"""Built-ins that take ``--resolution``: ``builder(overrides, seq_len, resolution)``."""
