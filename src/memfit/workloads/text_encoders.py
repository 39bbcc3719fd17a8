"""Text encoders in the step: the UNets' CLIP encoders, FLUX.1's CLIP-L and T5-XXL, SD3's CLIP-L, CLIP-G and
T5-XXL, Lumina 2's Gemma-2 and Z-Image's Qwen3, where a run does not cache the captions' hidden states.

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

FLUX.1 (``dit-flux``) takes CLIP-L's pooled output (768) and T5-XXL's last hidden states (4.76B parameters:
24 layers of 4096, 512 tokens a caption for FLUX.1-dev), the sizes following the DiT's
``pooled_projection_dim`` and ``joint_attention_dim``. As in kohya's ``flux_train_network`` and diffusers'
``train_dreambooth_lora_flux``, only CLIP-L trains (``text_encoders=trained``); T5-XXL runs frozen
(``t5=frozen``, the default where CLIP-L runs) or its states are cached while CLIP-L trains (``t5=cached``:
kohya's partial cache, ``cache_text_encoder_outputs`` without ``network_train_unet_only``). T5-XXL is 9.5 GB
in bf16 and 4.8 GB with ``base_weights: fp8`` (kohya's ``--fp8_base`` casts the text encoders too).
``t5_tokens=N`` sets T5's tokens a caption (kohya's ``t5xxl_max_token_length``).

SD3 (``dit-sd3``, and SD3.5's folders) takes CLIP-L's and CLIP-G's penultimate states side by side, padded
with zeros to T5's width and followed by T5-XXL's 256 tokens of states, and their projected pooled outputs
side by side (diffusers' ``StableDiffusion3Pipeline.encode_prompt``); both CLIPs train with
``text_encoders=trained`` (kohya's ``sd3_train_network``), T5 as for FLUX.1. CLIP-L and CLIP-G share the
DiT's ``pooled_projection_dim`` as SDXL's encoders share its context (768 + 1280).

Lumina 2 (``dit-lumina2``) attends to Gemma-2-2B's penultimate hidden states (2.6B parameters, 256 tokens a
caption: diffusers' ``Lumina2Pipeline``, kohya's ``lumina_train_network``); with ``text_encoders=trained``
its attention and MLP projections take the adapter (kohya's ``train_gemma2``, a LoRA without
``network_train_unet_only``).

Z-Image (``dit-zimage``) attends to Qwen3-4B's penultimate hidden states (4.0B parameters: ``ZImagePipeline``
pads each caption to 512 tokens, encodes them, and keeps each caption's own tokens); it runs frozen only
(ai-toolkit's ``zimage`` never trains it: ``get_te_has_grad`` is False). ai-toolkit loads it as
``Qwen3ForCausalLM``, whose head shares the embedding (no more weights) and whose logits over the 512 tokens
are a transient of the encoding, not of the step's peak.
The encoders are registered before the denoiser, in the order they run, so that the last repeated blocks
are the denoiser's (``swap_blocks: N`` streams those, as kohya's ``--blocks_to_swap`` does).
"""

from __future__ import annotations

import json
from pathlib import Path

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
T5_VOCAB, T5_LAYERS, T5_HEAD = 32128, 24, 64
T5_FF = 2.5
"""T5-XXL (google/t5-v1_1-xxl, FLUX.1's text_encoder_2): d_ff = 10240 = 2.5 x 4096."""
T5_MODES = ("cached", "frozen")
GEMMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Gemma-2's layers an adapter takes where it trains (kohya's Lumina LoRA: Gemma2Attention's and Gemma2MLP's)."""
GEMMA_VOCAB, GEMMA_LAYERS, GEMMA_HEADS, GEMMA_HEAD = 256000, 26, 8, 256
QWEN3_VOCAB, QWEN3_LAYERS, QWEN3_HEADS, QWEN3_KV_HEADS, QWEN3_HEAD, QWEN3_FF = 151936, 36, 32, 8, 128, 9728
"""Qwen3-4B (Z-Image's text_encoder: 2560 wide, 36 layers, 32 query and 8 key/value heads of 128)."""
QWEN3_TOKENS = 512
"""ZImagePipeline's ``max_sequence_length``: every caption is padded to it before encoding."""


def text_mode(arch: str, overrides: dict, t5: bool = False) -> tuple[dict, str, int | None]:
    """(``overrides`` without ``text_encoders=`` and ``text_layers=``, the mode, the encoders' depth or None
    for CLIP's own); checked. ``t5``: the model has a T5-XXL (``t5=`` and ``t5_tokens=`` apply)."""
    rest = dict(overrides)
    if not t5 and {"t5", "t5_tokens"} & set(rest):
        raise UserError(f"{arch}: t5= and t5_tokens= apply to the models with a T5-XXL (dit-flux, dit-sd3); drop them")
    mode = rest.pop("text_encoders", "cached")
    if mode not in MODES:
        raise UserError(f"{arch}: text_encoders={mode} is not one of {', '.join(MODES)} (cached: the captions' hidden "
                        "states are inputs; frozen: the encoders run each step; trained: they train too)")
    layers = rest.pop("text_layers", None)
    if layers is not None and (mode == "cached" or not isinstance(layers, int) or isinstance(layers, bool)
                               or layers < 1):
        raise UserError(f"{arch}: text_layers={layers} needs text_encoders=frozen or trained and a whole number >= 1")
    return rest, mode, layers


def t5_mode(arch: str, overrides: dict, text: str) -> tuple[dict, str]:
    """(``overrides`` without ``t5=``, FLUX.1's T5-XXL mode: frozen in the step where CLIP-L runs, unless
    cached); checked."""
    rest = dict(overrides)
    mode = rest.pop("t5", "cached" if text == "cached" else "frozen")
    if mode not in T5_MODES:
        raise UserError(f"{arch}: t5={mode} is not one of {', '.join(T5_MODES)} (memfit trains CLIP-L only, as "
                        "kohya's and diffusers' FLUX scripts do)")
    if mode == "frozen" and text == "cached":
        raise UserError(f"{arch}: t5=frozen needs text_encoders=frozen or trained (CLIP-L in the step too, as "
                        "kohya runs them)")
    return rest, mode


def t5_tokens(arch: str, overrides: dict) -> tuple[dict, int | None]:
    """(``overrides`` without ``t5_tokens=``, its value or None for the model's own); checked."""
    rest = dict(overrides)
    tokens = rest.pop("t5_tokens", None)
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
        raise UserError(f"{arch}: t5_tokens={tokens} must be a whole number of T5 tokens a caption >= 1 (kohya's "
                        "t5xxl_max_token_length)")
    return rest, tokens


def flux_configs(pooled: int, joint: int, t5: bool, layers: int | None) -> list:
    """The text configs of a FLUX.1 DiT whose pooled input is ``pooled`` wide and whose caption states are
    ``joint`` wide: CLIP-L, and T5-XXL where it runs in the step (``t5``)."""
    return [_clip(pooled, layers or CLIP_L_LAYERS), *([_t5(joint, layers)] if t5 else [])]


def sd3_configs(pooled: int, joint: int, t5: bool, layers: int | None) -> list:
    """The text configs of an SD3 DiT whose pooled input is ``pooled`` wide (CLIP-L's and CLIP-G's projections
    side by side) and whose caption states are ``joint`` wide: CLIP-L, CLIP-G, and T5-XXL where it runs in the
    step (``t5``)."""
    if pooled > joint:
        raise UserError(f"dit-sd3: pooled_projection_dim={pooled} cannot hold CLIP-L and CLIP-G side by side within "
                        f"joint_attention_dim={joint}; give at most joint_attention_dim")
    return [*_clip_pair(pooled, None, layers, "dit-sd3: pooled_projection_dim", "CLIP-L and CLIP-G side by side"),
            *([_t5(joint, layers)] if t5 else [])]


def lumina_configs(width: int, layers: int | None) -> list:
    """Gemma-2-2B's config for a Lumina 2 DiT whose caption features are ``width`` wide (2304: 8 heads of 256,
    4 KV heads; a shrunk one has one head as wide as it)."""
    import transformers
    heads = GEMMA_HEADS if width >= GEMMA_HEADS * GEMMA_HEAD else 1
    return [transformers.Gemma2Config(vocab_size=GEMMA_VOCAB, hidden_size=width, intermediate_size=4 * width,
                                      num_hidden_layers=layers or GEMMA_LAYERS, num_attention_heads=heads,
                                      num_key_value_heads=max(1, heads // 2),
                                      head_dim=GEMMA_HEAD if heads > 1 else width, use_cache=False)]


def zimage_configs(width: int, layers: int | None) -> list:
    """Qwen3-4B's config for a Z-Image DiT whose caption features are ``width`` wide (2560; a shrunk one has one
    head as wide as it)."""
    import transformers
    full = width == 2560
    return [transformers.Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=width,
                                     intermediate_size=QWEN3_FF if full else 4 * width,
                                     num_hidden_layers=layers or QWEN3_LAYERS,
                                     num_attention_heads=QWEN3_HEADS if full else 1,
                                     num_key_value_heads=QWEN3_KV_HEADS if full else 1,
                                     head_dim=QWEN3_HEAD if full else width, max_position_embeddings=40960,
                                     rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, use_cache=False)]


def _t5(width: int, layers: int | None):
    """A T5-XXL encoder config ``width`` wide. Its dropout is off: the frozen encoder runs in eval mode (kohya's
    ``t5xxl.eval()``)."""
    import transformers
    return transformers.T5Config(vocab_size=T5_VOCAB, d_model=width, d_kv=min(T5_HEAD, width),
                                 d_ff=round(T5_FF * width), num_layers=layers or T5_LAYERS,
                                 num_heads=max(1, width // T5_HEAD), feed_forward_proj="gated-gelu",
                                 dropout_rate=0.0, is_encoder_decoder=False, use_cache=False)


def _clip(width: int, depth: int, **extra):
    """A CLIP text config ``width`` wide (CLIP's heads are 64 wide; a shrunk one has one head)."""
    import transformers
    return transformers.CLIPTextConfig(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=depth,
                                       num_attention_heads=width // 64 if width % 64 == 0 else 1,
                                       vocab_size=VOCAB, max_position_embeddings=CAPTION_TOKENS, **extra)


TEXT_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3")
"""A diffusers pipeline's text encoders, in the order its pipeline runs them (CLIP-L, then CLIP-G or T5)."""


def text_components(index: dict) -> list[str]:
    """The text encoders a pipeline's ``model_index.json`` names (``[null, null]``: a component it has not)."""
    return [n for n in TEXT_COMPONENTS if isinstance(index.get(n), list) and index[n][:1] != [None]]


def pipeline_configs(root: Path, index: dict, where: str) -> tuple:
    """The text encoders' configs of a diffusers pipeline folder, in its order, each from its own config.json
    (SD 2.x's OpenCLIP-H, a fine-tune's changed encoder); empty where the folder lacks one (a hub snapshot
    of the denoiser alone: the encoders are then built from the denoiser's widths)."""
    import transformers
    out = []
    for name in text_components(index):
        path = root / name / "config.json"
        if not path.is_file():
            return ()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            out.append(transformers.AutoConfig.for_model(**data))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise UserError(f"{where}: {name}/config.json cannot be read as a transformers config ({str(e)[:120]}); "
                            "download it again") from None
    return tuple(out)


def chosen(given: tuple, wanted: list, layers: int | None) -> list:
    """A pipeline's own text configs (``given``) where it holds the model's ``wanted`` ones, each of the same
    kind and width (the denoiser's overrides may have changed what it takes), else those; ``text_layers`` sets
    either's depth. A config's dtype is dropped: the encoder is built in the plan's, as the denoiser is."""
    given = given[:len(wanted)]
    if [(type(c), _width(c)) for c in given] != [(type(c), _width(c)) for c in wanted]:
        return wanted
    out = [c.__class__.from_dict({**c.to_dict(), "dtype": None, "torch_dtype": None}) for c in given]
    for c in out:
        c.use_cache = False  # (an encoder keeps no key/value cache: a checkpointed layer's rerun would grow it)
        if layers:
            setattr(c, "num_layers" if _is_t5(c) else "num_hidden_layers", layers)
    return out


def _width(config) -> int:
    return config.d_model if _is_t5(config) else config.hidden_size


def encoder_configs(cross: int, pooled: int, sdxl: bool, layers: int | None) -> list:
    """The CLIP text configs of a UNet whose cross-attention context is ``cross`` wide (SDXL: two encoders
    side by side, the second projecting its pooled output to ``pooled``)."""
    if not sdxl:
        return [_clip(cross, layers or CLIP_L_LAYERS, projection_dim=cross)]
    return _clip_pair(cross, pooled, layers, "unet-sdxl: cross_attention_dim", "two text encoders side by side")


def _clip_pair(width: int, pooled: int | None, layers: int | None, field: str, what: str) -> list:
    """CLIP-L and OpenCLIP bigG side by side, ``width`` wide together (768 + 1280 of 2048), bigG projecting its
    pooled output to ``pooled`` (None: its own width, as SD3's); ``field`` and ``what`` name the width in the error
    where it cannot hold two."""
    first = round(width * SDXL_CLIP_L_SHARE)
    if not 0 < first < width:
        raise UserError(f"{field}={width} cannot hold {what}; give at least 2")
    return [_clip(first, layers or CLIP_L_LAYERS, projection_dim=first),
            _clip(width - first, layers or BIGG_LAYERS, projection_dim=pooled or width - first, hidden_act="gelu")]


class WithTextEncoders(torch.nn.Module):
    """A UNet with its text encoders in the step: ``forward`` takes token ids where the cached step takes
    hidden states (see the module docstring). ``denoiser`` is the UNet, as the adapter's and kohya's rules
    look for it; ``trained``: the CLIP encoders train (a T5 never does)."""

    converted_whole = ("text_encoders",)
    """A 16-bit precision casts the encoders whole, as kohya's and diffusers' scripts do (``.to(dtype)``):
    nothing in them is kept in fp32 as ``from_pretrained`` would (memfit.techniques.kept_in_fp32)."""

    def __init__(self, denoiser: torch.nn.Module, configs: list, trained: bool):
        super().__init__()
        self.text_encoders = torch.nn.ModuleList(_encoder(c, self.projected(i, configs))
                                                 for i, c in enumerate(configs))  # (before the denoiser: docstring)
        self.denoiser = denoiser
        self.trains = [trained and not _is_t5(c) for c in configs]
        for encoder, trains in zip(self.text_encoders, self.trains):
            if not trains:
                encoder.requires_grad_(False)

    @staticmethod
    def projected(i: int, configs: list) -> bool:
        """Whether the ``i``-th CLIP's pooled output is projected (SDXL's bigG's)."""
        return len(configs) > 1 and i == len(configs) - 1

    def train(self, mode: bool = True):
        """Frozen encoders stay in eval mode (no dropout: kohya's ``t5xxl.eval()``; a pipeline's T5 config holds
        a dropout rate)."""
        super().train(mode)
        for encoder, trains in zip(self.text_encoders, self.trains):
            if not trains:
                encoder.eval()
        return self

    @property
    def adapter_targets(self) -> tuple[str, ...]:
        """Layers an adapter's default targets take beside the denoiser's: the encoders' where they train."""
        kinds = {_is_clip(e.config) for e, trains in zip(self.text_encoders, self.trains) if trains}
        return (TARGETS if True in kinds else ()) + (GEMMA_TARGETS if False in kinds else ())

    @property
    def adapter_leaves_out(self) -> list[str]:
        """Layers no adapter takes, ``all-linear`` included: those of the encoders that are frozen."""
        return [f"text_encoders.{i}.{n}" for i, (encoder, trains) in enumerate(zip(self.text_encoders, self.trains))
                if not trains for n, m in encoder.named_modules() if isinstance(m, torch.nn.Linear)]

    def _run(self, i: int, tokens: torch.Tensor, **kwargs):
        with torch.set_grad_enabled(self.trains[i] and torch.is_grad_enabled()):
            return self.text_encoders[i](tokens, return_dict=True, **kwargs)

    def encode(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the hidden states the UNet attends to, SDXL's pooled text or None)."""
        if len(self.text_encoders) == 1:
            return self._run(0, ids[0]).last_hidden_state, None
        states, pooled = [], None
        for i, tokens in enumerate(ids):
            out = self._run(i, tokens, output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled = getattr(out, "text_embeds", None)
        return torch.cat(states, dim=-1), pooled

    def forward(self, sample, timestep, ids: list[torch.Tensor], time_ids: torch.Tensor | None = None):
        hidden, pooled = self.encode(ids)
        added = {"text_embeds": pooled, "time_ids": time_ids} if time_ids is not None else None
        return self.denoiser(sample, timestep, hidden, added_cond_kwargs=added, return_dict=False)[0]


class FluxWithTextEncoders(WithTextEncoders):
    """FLUX.1 with CLIP-L, and T5-XXL unless its states are cached, in the step: ``forward`` takes the DiT's
    keywords with the captions' token ids in place of ``pooled_projections`` (CLIP-L's pooled output) and,
    where T5 runs, of ``encoder_hidden_states`` (its last hidden states), as FluxPipeline encodes a prompt."""

    @staticmethod
    def projected(i: int, configs: list) -> bool:
        return False

    def encode(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(T5's hidden states or None where they are cached, CLIP-L's pooled output)."""
        pooled = self._run(0, ids[0]).pooler_output
        return (self._run(1, ids[1]).last_hidden_state if len(ids) > 1 else None), pooled

    def forward(self, ids: list[torch.Tensor], return_dict: bool = False, **inputs):
        states, inputs["pooled_projections"] = self.encode(ids)
        if states is not None:
            inputs["encoder_hidden_states"] = states
        return self.denoiser(**inputs, return_dict=return_dict)


class SD3WithTextEncoders(WithTextEncoders):
    """SD3 with CLIP-L, CLIP-G, and T5-XXL unless its states are cached, in the step: ``forward`` takes the
    DiT's keywords with the captions' token ids in place of ``encoder_hidden_states`` and
    ``pooled_projections`` (and T5's cached states as ``t5_states`` where T5 does not run), as
    StableDiffusion3Pipeline encodes a prompt."""

    @staticmethod
    def projected(i: int, configs: list) -> bool:
        return _is_clip(configs[i])

    def encode(self, ids: list[torch.Tensor], t5_states: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the CLIPs' penultimate states side by side, padded to T5's width, then T5's states; the CLIPs'
        projected pooled outputs side by side)."""
        clips = [self._run(i, ids[i], output_hidden_states=True) for i in (0, 1)]
        t5 = self._run(2, ids[2]).last_hidden_state if len(ids) > 2 else t5_states
        clip = torch.cat([out.hidden_states[-2] for out in clips], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat([out.text_embeds for out in clips], dim=-1)

    def forward(self, ids: list[torch.Tensor], t5_states: torch.Tensor | None = None, return_dict: bool = False,
                **inputs):
        inputs["encoder_hidden_states"], inputs["pooled_projections"] = self.encode(ids, t5_states)
        return self.denoiser(**inputs, return_dict=return_dict)


class LuminaWithTextEncoders(WithTextEncoders):
    """Lumina 2 with Gemma-2 in the step: ``forward`` takes the DiT's keywords with the captions' token ids in
    place of ``encoder_hidden_states`` (Gemma-2's penultimate hidden states, as Lumina2Pipeline encodes a
    prompt); the captions' mask stays an input of both."""

    def encode(self, ids: list[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(0, ids[0], attention_mask=mask, output_hidden_states=True).hidden_states[-2]

    def forward(self, ids: list[torch.Tensor], return_dict: bool = False, **inputs):
        inputs["encoder_hidden_states"] = self.encode(ids, inputs.get("encoder_attention_mask"))
        return self.denoiser(**inputs, return_dict=return_dict)


class ZImageWithTextEncoders(WithTextEncoders):
    """Z-Image with Qwen3-4B in the step: ``forward`` takes the DiT's lists with the captions' token ids and mask
    (padded to 512) in place of each caption's states, which are Qwen3's penultimate hidden states cut to the
    caption's own tokens, as ZImagePipeline encodes a prompt."""

    def encode(self, ids: list[torch.Tensor], mask: torch.Tensor) -> list[torch.Tensor]:
        states = self._run(0, ids[0], attention_mask=mask, output_hidden_states=True).hidden_states[-2]
        return [s[m] for s, m in zip(states, mask)]

    def forward(self, x: list, t: torch.Tensor, ids: list[torch.Tensor], mask: torch.Tensor, return_dict: bool = False):
        return self.denoiser(x, t, self.encode(ids, mask), return_dict=return_dict)


def _is_clip(config) -> bool:
    return type(config).__name__ == "CLIPTextConfig"


def _is_t5(config) -> bool:
    return type(config).__name__ == "T5Config"


def _encoder(config, projected: bool) -> torch.nn.Module:
    """The model of a text config (``projected``: SDXL's bigG, whose pooled output is projected)."""
    import transformers
    if _is_t5(config):
        return transformers.T5EncoderModel(config)
    if type(config).__name__ == "LlamaConfig":  # (HiDream's Llama-3.1-8B, with its output layer as loaded)
        return transformers.LlamaForCausalLM(config)
    if not _is_clip(config):
        return transformers.AutoModel.from_config(config)  # (Lumina's Gemma-2, Z-Image's Qwen3)
    return (transformers.CLIPTextModelWithProjection if projected else transformers.CLIPTextModel)(config)


def labelled(wl, text: str, t5: str | None = None):
    """The workload of a denoiser with its text encoders in the step, its name and config saying how (``t5``:
    a T5-XXL's mode, where the model has one)."""
    wl.info.config.update(text_encoders=text, **({"t5": t5} if t5 else {}))
    wl.name += f", text encoders {text}" + (", T5 cached" if t5 == "cached" else "")
    return wl


def token_ids(batch_size: int, encoders: int) -> list[torch.Tensor]:
    """A caption's token ids for each CLIP encoder (padded to CLIP's 77)."""
    return [torch.randint(0, VOCAB - 1, (batch_size, CAPTION_TOKENS)) for _ in range(encoders)]


def gemma_token_ids(batch_size: int, tokens: int, vocab: int = GEMMA_VOCAB) -> list[torch.Tensor]:
    """A caption's Gemma-2 token ids (Lumina 2: 256, the system prompt's included), of a ``vocab`` (its config's)."""
    return [torch.randint(0, vocab - 1, (batch_size, tokens))]


def qwen3_token_ids(batch_size: int, tokens: int, vocab: int = QWEN3_VOCAB) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A caption's Qwen3 token ids (of a ``vocab``, its config's) padded to 512, and its mask: the first ``tokens``
    its own (Z-Image)."""
    mask = torch.zeros(batch_size, QWEN3_TOKENS, dtype=torch.bool)
    mask[:, :tokens] = True
    return [torch.randint(0, vocab - 1, (batch_size, QWEN3_TOKENS))], mask


def t5_token_ids(batch_size: int, clips: int, t5_tokens: int | None) -> list[torch.Tensor]:
    """A caption's token ids for ``clips`` CLIP encoders (77 each) and, where T5 runs (``t5_tokens``: FLUX.1-dev's
    512, SD3's 256), for T5."""
    out = token_ids(batch_size, clips)
    return out if t5_tokens is None else [*out, torch.randint(0, T5_VOCAB - 1, (batch_size, t5_tokens))]
