"""HiDream-I1 (HiDream.ai's 17B mixture-of-experts DiT): diffusers' ``HiDreamImageTransformer2DModel`` from its
config (no weights), trained as diffusers' ``train_dreambooth_lora_hidream.py`` trains its LoRA.

``dit-hidream``: HiDream-I1 (Full, Dev and Fast share it): 16 double-stream blocks, then 32 single-stream ones, 20
heads x 128 = 2560 wide; each block's feed-forward is a shared SwiGLU expert beside 4 routed ones, 2 of them per
token (DeepSeek-V3's layout). 2x2 patches of 16 latent channels: 4,096 image tokens at 1024 px. Four text encoders
feed it, cached by default (the script encodes its prompt once, before training): T5-XXL's states (128 tokens x 4096),
Llama-3.1-8B's states of all 32 layers (``[32, B, 128, 4096]``, each block reads one), and CLIP-L and CLIP-G's pooled
embeddings (2048). ``text_encoders=frozen`` holds the four in the step, as ai-toolkit's trainer does
(memfit.workloads.hidream_text). The loss is rectified flow (t = 1 is noise) with the target ``noise - latents`` and the model's
output negated, as the script computes it; the timestep is ``1000 t``.

The routed experts, as the script loads the model (``force_inference_output=True``): they run the inference path in
training too, ``moe_infer`` under ``no_grad``, which sorts the tokens by expert, counts them on the host
(``bincount().cpu().numpy()``) and gathers each expert's tokens. So the routed experts keep no activations for
backward and the gradient reaches the blocks' inputs through the shared expert and the attention alone, what the
script trains. ``force_inference_output=false`` is the model's own training path (ai-toolkit's): every token
repeated twice, each expert run on its tokens by a boolean mask, with gradients; its activations are kept, about
twice a dense feed-forward's. Either way, which expert a token goes to is a value fake tensors do not have: the
router's ``topk`` is answered with balanced routing (NOTE [ Routing on fake tensors ] in memfit.memory.routing), the
worst routing's peak given beside it.

Memory/compute trade-off of the text path: the cached Llama-3.1 states are 32 MiB a sample in bf16, the largest
input; the script stacks them ``[32, B, ...]`` each step (one copy, made in the loss here).
"""

from __future__ import annotations

import torch

from memfit.errors import UserError
from memfit.workload import Workload
from memfit.workloads import text_encoders as te
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
from memfit.workloads.hidream_text import (
    CLIP_POSITIONS,
    HiDreamWithTextEncoders,
    hidream_configs,
    hidream_token_ids,
)

HIDREAM = ImageModel(
    "dit-hidream", "HiDreamImageTransformer2DModel",
    # HiDream-I1's transformer/config.json (Full, Dev and Fast): its class has no usable defaults for these.
    {"patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 16, "num_single_layers": 32,
     "attention_head_dim": 128, "num_attention_heads": 20, "caption_channels": (4096, 4096), "text_emb_dim": 2048,
     "num_routed_experts": 4, "num_activated_experts": 2, "axes_dims_rope": (64, 32, 32),
     "max_resolution": (128, 128), "llama_layers": (*range(32), *[31] * 16)},
    1024, 128,
    "HiDream-I1 DiT, 17.1B mixture of experts (diffusers HiDreamImageTransformer2DModel; 4 routed experts, 2 a token; "
    "cached T5 and Llama-3.1 states; flow matching, 1024px)")
LLAMA_LAYERS = 32
"""Llama-3.1-8B's hidden states the pipeline caches (its 32 layers' outputs: ``hidden_states[1:]``)."""


def hidream(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = HIDREAM) -> Workload:
    """HiDream-I1's step on cached latents and text states (see the module's docstring); loaded as a checkpoint is.
    ``caption_tokens=N``: T5's and Llama's tokens a caption (default 128, the script's ``max_sequence_length``)."""
    no_seq_len(m.arch, seq_len)
    overrides, width = given_width(overrides)
    overrides, text_mode, text_layers = te.text_mode(m.arch, overrides)
    if text_mode == "trained":
        raise UserError(f"{m.arch}: text_encoders=trained: memfit trains none of HiDream's four text encoders (neither "
                        "diffusers' script nor ai-toolkit trains them); use text_encoders=frozen or cached")
    caption = overrides.pop("caption_tokens", m.caption_tokens)
    if not isinstance(caption, int) or isinstance(caption, bool) or caption < 1:
        raise UserError(f"{m.arch}: caption_tokens={caption} must be a positive whole number of tokens")
    if text_mode == "frozen" and caption > CLIP_POSITIONS:
        raise UserError(f"{m.arch}: caption_tokens={caption} exceeds the {CLIP_POSITIONS} positions of HiDream's CLIP "
                        f"encoders, which encode each caption padded to it; use caption_tokens <= {CLIP_POSITIONS}")
    cls, kw = config_of(m, overrides)
    if "force_inference_output" not in overrides and "force_inference_output" not in m.defaults:
        kw["force_inference_output"] = True  # (as diffusers' script loads it: from_pretrained(..., force_inference_output=True))
    patch, channels = kw["patch_size"], kw["in_channels"]
    t5, llama = kw["caption_channels"][0], kw["caption_channels"][1]
    pooled = kw["text_emb_dim"]  # (CLIP-L's and CLIP-G's pooled embeddings, concatenated: 768 + 1280)
    layers = max(kw["llama_layers"]) + 1 if kw["llama_layers"] else LLAMA_LAYERS
    high, wide, _ = sides = latent_sides(m, resolution, width, patch, "patch size")
    most = kw["max_resolution"]  # (in latents: a non-square image is padded to its tokens, and cannot have more)
    if high != wide and (high // patch) * (wide // patch) > most[0] * most[1] // (patch * patch):
        raise UserError(f"{m.arch}: a {high * VAE_FACTOR}x{wide * VAE_FACTOR} px image has more tokens than a "
                        f"non-square image may (max_resolution: {most[0] * VAE_FACTOR}x{most[1] * VAE_FACTOR} px); "
                        "use a smaller --resolution or width=")

    encoders = hidream_configs(pooled, t5, llama, layers, text_layers) if text_mode == "frozen" else []
    if encoders:  # (a pipeline folder's own CLIP and T5 configs where it holds them; Llama-3.1 is not in it)
        encoders = [*te.chosen(m.text_configs, encoders[:3], text_layers), encoders[3]]

    def batch(b: int) -> dict:
        latents, noise, t = torch.randn(b, channels, high, wide), torch.randn(b, channels, high, wide), torch.rand(b)
        noisy, target = flow_matching(latents, noise, t, data_at_one=False)
        out = {"x": noisy, "t": t * 1000, "target": target}
        if encoders:
            return {**out, "ids": hidream_token_ids(b, caption, encoders)}
        return {**out, "t5": torch.randn(b, caption, t5), "llama": torch.randn(b, layers, caption, llama),
                "pooled": torch.randn(b, pooled)}

    res = high * VAE_FACTOR
    info = image_info(m, res, kw, ("num_layers", "num_single_layers", "num_attention_heads", "num_routed_experts",
                                   "num_activated_experts", "force_inference_output"), patch, sides)
    if caption != m.caption_tokens:
        info.config["caption_tokens"] = caption
    return held_workload(m, model_builder(m, cls, kw, overrides), batch, _loss, res, info, encoders,
                         HiDreamWithTextEncoders, text_mode)


def _loss(model, batch: dict) -> torch.Tensor:
    """The model called as the script calls it (Llama's states stacked layer first), its output negated against
    ``noise - latents``, the mean square per sample, then over the batch."""
    if "ids" in batch:  # (the text encoders in the step: memfit.workloads.hidream_text)
        pred = -model(batch["ids"], hidden_states=batch["x"], timesteps=batch["t"], return_dict=False)[0]
    else:
        llama = batch["llama"].transpose(0, 1).contiguous()
        pred = -model(hidden_states=batch["x"], timesteps=batch["t"], encoder_hidden_states_t5=batch["t5"],
                      encoder_hidden_states_llama3=llama, pooled_embeds=batch["pooled"], return_dict=False)[0]
    target = batch["target"]
    if pred.shape != target.shape:  # (force_inference_output=false: the model's training layout, [B, C, tokens, p * p])
        b, c, high, wide = target.shape
        p = round((pred.shape[-1]) ** 0.5)
        target = target.reshape(b, c, high // p, p, wide // p, p).permute(0, 1, 2, 4, 3, 5).reshape(pred.shape)
    return torch.mean(((pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()


BUILDERS = {"dit-hidream": (hidream, HIDREAM.doc)}
"""Built-ins that take ``--resolution``: ``builder(overrides, seq_len, resolution)``."""
