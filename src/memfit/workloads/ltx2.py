"""LTX-2 (diffusers' ``LTX2VideoTransformer3DModel``, 18.9B), the audio-video DiT, built from its config (no weights)
and trained as SimpleTuner's and Lightricks' own LTX-2 trainers train its LoRA.

``dit-ltx2``: LTX-2 19B. 48 blocks, each a video stream (32 heads x 128 = 4096 wide) and an audio stream (32 x 64 =
2048) with self-attention, cross-attention to the caption, and audio-to-video and video-to-audio cross-attention
between them. Its video VAE compresses 8x in time and 32x on each side into 128 channels, one token a latent; its
audio VAE makes 25 latents a second (16 kHz, hop 160, 4x in time) of 8 channels x 16 mel bins, packed as 128.
Lightricks' trainer's example bucket, 49 frames at 960 x 544, is 7 x 17 x 30 = 3,570 video tokens and 49 audio
tokens.

Memory/compute trade-off of the text path. Gemma-3-12B's hidden states of all its 49 layers (3840 wide, 1,024 tokens a
caption) are what a run caches; the step then runs LTX-2's text *connectors* on them (``LTX2TextConnectors``: a 722M
projection of the 188,160 stacked features to 3840, then a 2-layer transformer for each stream, 1.43B parameters in
all), frozen, under ``no_grad``, as SimpleTuner's ``model_predict`` and ltx-trainer's embeddings processor do:

- ``connectors=frozen`` (the default): the connectors' 2.9 GB of bf16 weights stay resident, and each sample's cached
  states are 385 MB in bf16 (1,024 x 188,160), with the connectors' transients on top, before the DiT runs;
- ``connectors=cached``: the connectors' outputs are cached instead (DiffSynth-Studio's split training: its
  ``text_encoder_post_modules`` run while preprocessing), and the step holds the DiT alone.

The audio stream always runs: a run without audio feeds zero audio latents (SimpleTuner's placeholder), and its loss
is the video's plus the audio's, rectified flow (t = 1 is noise) with the target ``noise - latents`` for each, one
timestep a sample for both streams (the text-to-video pipeline's ``timestep`` and ``sigma``). ``frames=`` (8k + 1) and
``width=`` size the clip; ``--resolution`` is its height.

An LTX-2.3 pipeline folder or hub id (its DiT with ``cross_attn_mod`` and no caption projection, its connectors with
per-modality projections) is built from its own ``transformer/`` and ``connectors/`` configs.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import torch

from memfit.errors import UserError, brief
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
from memfit.workloads.ltx_video import one_token_a_latent
from memfit.workloads.video_dits import Clip, clip_name, latent_frames

LTX2 = ImageModel(
    "dit-ltx2", "LTX2VideoTransformer3DModel",
    # LTX-2 19B: the class defaults (48 blocks; video 32 x 128, audio 32 x 64; Gemma-3's 3840-wide captions) with its
    # released config's split rotary layout.
    {"rope_type": "split"}, 544, 1024,
    "LTX-2 19B audio-video DiT, 18.9B (diffusers LTX2VideoTransformer3DModel; text connectors in the step, flow "
    "matching, 49 frames at 960x544)", vae_factor=32)
FRAMES, WIDTH, TIME_FACTOR, FRAME_RATE = 49, 960, 8, 25
"""ltx-trainer's example bucket (960x544x49), the VAE's frames a latent frame after the first, the trainers' fps."""
CONNECTORS = {"rope_type": "split"}
"""LTX-2's ``LTX2TextConnectors``: the class defaults (Gemma-3-12B's 3840 x 49 features, 2 layers of 30 x 128 a stream,
128 registers) with the split rotary layout."""
MODES = ("frozen", "cached")


def connectors_class():
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    return LTX2TextConnectors


def pipeline_connectors(pipeline: Path, where: str) -> tuple:
    """A pipeline folder's ``connectors/config.json`` fields, as a one-config tuple (``ImageModel.text_configs``);
    () where the folder has none (then LTX-2's are built)."""
    path = pipeline / "connectors" / "config.json"
    if not path.is_file():
        return ()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: connectors/config.json cannot be read ({brief(e, 120)}); download it again") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: connectors/config.json holds a {type(data).__name__}, not a JSON object; download it "
                        "again")
    params = inspect.signature(connectors_class().__init__).parameters
    return ({k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in params and k != "self"},)


def connector_config(kw: dict, given: tuple) -> dict:
    """The connectors' config: a pipeline folder's own ``connectors/config.json`` (``given``), else LTX-2's, sized to
    the DiT's caption width where overrides shrank it (heads of 128, or two where the width is not a multiple), with
    LTX-2.3's per-modality projections where the DiT has no caption projection of its own to feed."""
    if given:
        return dict(given[0])
    config = dict(CONNECTORS)
    widths = {"video": kw["caption_channels"], "audio": kw["caption_channels"]}
    if not kw.get("use_prompt_embeddings", True):  # (each stream's connector works at its stream's width)
        widths = {"video": kw["num_attention_heads"] * kw["attention_head_dim"],
                  "audio": kw["audio_num_attention_heads"] * kw["audio_attention_head_dim"]}
        config.update(per_modality_projections=True, video_hidden_dim=widths["video"], audio_hidden_dim=widths["audio"])
    config["caption_channels"] = kw["caption_channels"]
    for stream, width in widths.items():
        if width != 3840:
            heads = width // 128 if width % 128 == 0 else 2
            config.update({f"{stream}_connector_num_attention_heads": heads,
                           f"{stream}_connector_attention_head_dim": width // heads})
    return config


class LTX2WithConnectors(torch.nn.Module):
    """The DiT with LTX-2's text connectors frozen in the step (module docstring). ``denoiser`` is the DiT, as the
    adapter's rules look for it; the connectors are registered first, so the last repeated blocks are the DiT's."""

    converted_whole = ("connectors",)
    """A 16-bit precision casts the connectors whole, as the trainers load them in the weights' dtype."""
    unquantized = ("connectors",)
    """``base_weights`` quantizes the DiT alone: ltx-trainer's ``quantize_model`` takes the transformer, and its
    embeddings processor (the connectors) loads apart, in bf16."""

    def __init__(self, connectors: torch.nn.Module, denoiser: torch.nn.Module):
        super().__init__()
        self.connectors = connectors.requires_grad_(False)
        self.denoiser = denoiser

    def train(self, mode: bool = True):
        super().train(mode)
        self.connectors.eval()
        return self

    @property
    def adapter_leaves_out(self) -> list[str]:
        """Layers no adapter takes, ``all-linear`` included: the frozen connectors'."""
        return [f"connectors.{n}" for n, m in self.connectors.named_modules() if isinstance(m, torch.nn.Linear)]

    def forward(self, text_states: torch.Tensor, text_mask: torch.Tensor, **inputs):
        with torch.no_grad():  # (the cache's bf16 states, in the connectors' dtype as the trainers move them)
            dtype = next(self.connectors.parameters()).dtype
            video, audio, mask = self.connectors(text_states.to(dtype), text_mask)
        return self.denoiser(encoder_hidden_states=video, audio_encoder_hidden_states=audio,
                             encoder_attention_mask=mask, audio_encoder_attention_mask=mask, **inputs)


def _mode(arch: str, overrides: dict) -> str:
    mode = overrides.pop("connectors", "frozen")
    if mode not in MODES:
        raise UserError(f"{arch}: connectors={mode!r}; use connectors=frozen (run in the step on cached Gemma-3 "
                        "states) or connectors=cached (their outputs cached)")
    return mode


def ltx2(overrides: dict, seq_len: int | None, resolution: int | None, m: ImageModel = LTX2) -> Workload:
    """LTX-2's LoRA step on cached video latents, zero audio latents and cached text states (module docstring);
    loaded as a checkpoint is."""
    no_seq_len(m.arch, seq_len)
    overrides = dict(overrides)
    frames = overrides.pop("frames", FRAMES)
    depth = latent_frames(m.arch, frames, per=TIME_FACTOR, example=FRAMES)
    width = overrides.pop("width", WIDTH)
    mode = _mode(m.arch, overrides)
    cls, kw = config_of(m, overrides)
    one_token_a_latent(m, kw)
    high, wide, _ = latent_sides(m, resolution, width, 1, "patch size")
    tokens = depth * high * wide
    seconds = frames / FRAME_RATE
    audio_tokens = max(1, round(seconds * kw["audio_sampling_rate"] / kw["audio_hop_length"] / kw["audio_scale_factor"]))
    connectors = connector_config(kw, m.text_configs)
    features = connectors.get("caption_channels", 3840) * connectors.get("text_proj_in_factor", 49)
    if mode == "cached":  # the connectors' outputs: each stream's width (LTX-2.3's per-modality projections) or theirs
        per_modality = connectors.get("per_modality_projections", False)
        widths = ((kw["num_attention_heads"] * kw["attention_head_dim"],
                   kw["audio_num_attention_heads"] * kw["audio_attention_head_dim"]) if per_modality
                  else (kw["caption_channels"],) * 2)

    def batch(b: int) -> dict:
        video, noise, t = torch.randn(b, tokens, kw["in_channels"]), torch.randn(b, tokens, kw["in_channels"]), torch.rand(b)
        audio = torch.zeros(b, audio_tokens, kw["audio_in_channels"])
        noisy, target = flow_matching(video, noise, t, data_at_one=False)
        audio_noisy, audio_target = flow_matching(audio, torch.randn_like(audio), t, data_at_one=False)
        text = ({"text_states": torch.randn(b, m.caption_tokens, features, dtype=torch.bfloat16),  # (as cached)
                 "text_mask": torch.ones(b, m.caption_tokens, dtype=torch.long)} if mode == "frozen" else
                {"encoder_hidden_states": torch.randn(b, m.caption_tokens, widths[0]),
                 "audio_encoder_hidden_states": torch.randn(b, m.caption_tokens, widths[1]),
                 "encoder_attention_mask": torch.ones(b, m.caption_tokens, dtype=torch.long),
                 "audio_encoder_attention_mask": torch.ones(b, m.caption_tokens, dtype=torch.long)})
        return {"hidden_states": noisy, "audio_hidden_states": audio_noisy, "timestep": t * 1000, "sigma": t * 1000,
                **text, "target": target, "audio_target": audio_target}

    def loss(model, batch: dict) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k not in ("target", "audio_target")}
        video, audio = model(**inputs, num_frames=depth, height=high, width=wide, fps=FRAME_RATE,
                             audio_num_frames=audio_tokens, return_dict=False)
        mse = torch.nn.functional.mse_loss
        return mse(video.float(), batch["target"].float()) + mse(audio.float(), batch["audio_target"].float())

    denoiser = model_builder(m, cls, kw, overrides)

    def build():
        dit = denoiser()
        return dit if mode == "cached" else LTX2WithConnectors(connectors_class()(**connectors), dit)

    res = high * m.vae_factor
    info = image_info(m, res, kw, ("num_layers", "num_attention_heads", "attention_head_dim",
                                   "audio_num_attention_heads", "audio_attention_head_dim", "caption_channels"), 1)
    info.config.update(frames=frames, latent_frames=depth, width=wide * m.vae_factor, tokens=tokens,
                       audio_tokens=audio_tokens, connectors=mode, fixed_width=True)
    origin = ("its pipeline's" if m.text_configs else "LTX-2's (the pipeline's connectors/config.json is not in the cache)"
              if m.arch != LTX2.arch else "LTX-2's")
    said = (f"{frames} frames at {wide * m.vae_factor}x{res} ({tokens:,} video tokens), {audio_tokens} zero audio latents, "
            f"{m.caption_tokens:,} cached text tokens; connectors {mode}" + (f", {origin}" if mode == "frozen" else ""))
    info = dataclasses.replace(info, sample=said)
    wl = image_workload(m, build, batch, loss, res, info)
    wl.name = clip_name(m, res, wide * m.vae_factor, frames, Clip(frames=FRAMES, width=WIDTH))
    if mode == "cached":
        wl.name += " (connectors cached)"
    return wl


BUILDERS = {"dit-ltx2": (ltx2, LTX2.doc)}
"""Built-ins that take ``--resolution``: ``builder(overrides, seq_len, resolution)``."""
