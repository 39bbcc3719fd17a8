"""Text encoders in the step: the UNets' CLIP encoders where a run does not cache the captions' hidden states.

Memory/compute trade-off. Caching each caption's hidden states once (kohya's
``--cache_text_encoder_outputs``, diffusers' SDXL LoRA script's precomputed embeddings) leaves the text
encoders out of the step: their weights need not be on the device at all, which is memfit's default
(``text_encoders=cached``: the batch holds the hidden states). Without a cache they run every step:

- ``text_encoders=frozen``: on the device and run forward under ``no_grad`` (kohya's LoRA with
  ``network_train_unet_only`` and no cache; diffusers' SD 1.5 LoRA script). Their weights stay resident
  (SD 1.5's CLIP-L: 123M parameters; SDXL's CLIP-L and OpenCLIP bigG: 817M), and each step adds their
  forward's transient activations (77 tokens a caption: small).
- ``text_encoders=trained``: also trained (kohya's LoRA without ``network_train_unet_only``, diffusers'
  ``--train_text_encoder``): with an adapter, its layers go into the encoders' attention and MLP
  projections too, and their activations are kept for backward; without one, every encoder weight
  trains, with its gradients and optimizer states.

SD 1.5 conditions on CLIP-L's last hidden states; SDXL on CLIP-L's and bigG's penultimate ones, side by
side, and on bigG's projected pooled output (diffusers' ``StableDiffusionXLPipeline.encode_prompt``).
Their sizes follow the UNet's ``cross_attention_dim`` (768; 2048 = 768 + 1280), so a UNet shrunk by its
overrides gets encoders that fit it; ``text_layers=N`` sets their depth (default: CLIP's 12 and bigG's 32).
"""

from __future__ import annotations

import torch

from memfit.errors import UserError

MODES = ("cached", "frozen", "trained")
CAPTION_TOKENS = 77
"""CLIP's context: every caption is padded to it."""
VOCAB = 49408
CLIP_L_LAYERS, BIGG_LAYERS = 12, 32
SDXL_CLIP_L_SHARE = 768 / 2048
"""CLIP-L's part of SDXL's 2048-wide cross-attention context (the rest is bigG's)."""
TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
"""The encoders' layers an adapter takes (kohya's text-encoder LoRA: CLIPAttention's and CLIPMLP's)."""


def text_mode(arch: str, overrides: dict) -> tuple[dict, str, int | None]:
    """(``overrides`` without ``text_encoders=`` and ``text_layers=``, the mode, the encoders' depth or None
    for CLIP's own); checked."""
    rest = dict(overrides)
    mode = rest.pop("text_encoders", "cached")
    if mode not in MODES:
        raise UserError(f"{arch}: text_encoders={mode} is not one of {', '.join(MODES)} (cached: the captions' hidden "
                        "states are inputs; frozen: the encoders run each step; trained: they train too)")
    layers = rest.pop("text_layers", None)
    if layers is not None and (mode == "cached" or not isinstance(layers, int) or isinstance(layers, bool)
                               or layers < 1):
        raise UserError(f"{arch}: text_layers={layers} needs text_encoders=frozen or trained and a whole number >= 1")
    return rest, mode, layers


def encoder_configs(cross: int, pooled: int, sdxl: bool, layers: int | None) -> list:
    """The CLIP text configs of a UNet whose cross-attention context is ``cross`` wide (SDXL: two encoders
    side by side, the second projecting its pooled output to ``pooled``)."""
    import transformers

    def clip(width: int, depth: int, **extra):  # (CLIP's heads are 64 wide; a shrunk one has one head)
        return transformers.CLIPTextConfig(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=depth,
                                           num_attention_heads=width // 64 if width % 64 == 0 else 1,
                                           vocab_size=VOCAB, max_position_embeddings=CAPTION_TOKENS, **extra)
    if not sdxl:
        return [clip(cross, layers or CLIP_L_LAYERS, projection_dim=cross)]
    first = round(cross * SDXL_CLIP_L_SHARE)
    if not 0 < first < cross:
        raise UserError(f"unet-sdxl: cross_attention_dim={cross} cannot hold two text encoders side by side; give "
                        "at least 2")
    return [clip(first, layers or CLIP_L_LAYERS, projection_dim=first),
            clip(cross - first, layers or BIGG_LAYERS, projection_dim=pooled, hidden_act="gelu")]


class WithTextEncoders(torch.nn.Module):
    """A UNet with its text encoders in the step: ``forward`` takes token ids where the cached step takes
    hidden states (see the module docstring). ``denoiser`` is the UNet, as the adapter's and kohya's rules
    look for it."""

    def __init__(self, denoiser: torch.nn.Module, configs: list, trained: bool):
        super().__init__()
        import transformers
        self.denoiser = denoiser
        classes = [transformers.CLIPTextModel] * (len(configs) - 1) + [
            transformers.CLIPTextModelWithProjection if len(configs) > 1 else transformers.CLIPTextModel]
        self.text_encoders = torch.nn.ModuleList(cls(c) for cls, c in zip(classes, configs))
        self.trained = trained
        if not trained:
            self.text_encoders.requires_grad_(False)

    @property
    def adapter_targets(self) -> tuple[str, ...]:
        """Layers an adapter's default targets take beside the denoiser's: the encoders' where they train."""
        return TARGETS if self.trained else ()

    @property
    def adapter_leaves_out(self) -> list[str]:
        """Layers no adapter takes, ``all-linear`` included: the encoders' where they are frozen."""
        return [] if self.trained else [f"text_encoders.{n}" for n, m in self.text_encoders.named_modules()
                                        if isinstance(m, torch.nn.Linear)]

    def encode(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the hidden states the UNet attends to, SDXL's pooled text or None)."""
        with torch.set_grad_enabled(self.trained and torch.is_grad_enabled()):
            if len(self.text_encoders) == 1:
                return self.text_encoders[0](ids[0], return_dict=True).last_hidden_state, None
            states, pooled = [], None
            for encoder, tokens in zip(self.text_encoders, ids):
                out = encoder(tokens, output_hidden_states=True, return_dict=True)
                states.append(out.hidden_states[-2])
                pooled = getattr(out, "text_embeds", None)
            return torch.cat(states, dim=-1), pooled

    def forward(self, sample, timestep, ids: list[torch.Tensor], time_ids: torch.Tensor | None = None):
        hidden, pooled = self.encode(ids)
        added = {"text_embeds": pooled, "time_ids": time_ids} if time_ids is not None else None
        return self.denoiser(sample, timestep, hidden, added_cond_kwargs=added, return_dict=False)[0]


def token_ids(batch_size: int, encoders: int) -> list[torch.Tensor]:
    """A caption's token ids for each encoder (padded to CLIP's 77)."""
    return [torch.randint(0, VOCAB - 1, (batch_size, CAPTION_TOKENS)) for _ in range(encoders)]
