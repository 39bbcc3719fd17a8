"""kohya-ss sd-scripts configs: the text encoders a run holds in its step, and T5's caption length
(memfit.integrations.kohya maps the rest; memfit.workloads.text_encoders builds the encoders)."""

from __future__ import annotations

from memfit.integrations.configs import whole
from memfit.integrations.kohya_blocks import network_args
from memfit.workloads.config_overrides import split_overrides, with_override

HOLDERS = {"UNet2DConditionModel": "unet", "FluxTransformer2DModel": "flux", "SD3Transformer2DModel": "sd3",
           "Lumina2Transformer2DModel": "lumina"}
"""The denoisers whose workloads hold their text encoders in the step (memfit.workloads.text_encoders), and
sd-scripts' code for each."""
BUILT_INS = {"unet-sd15": "UNet2DConditionModel", "unet-sdxl": "UNet2DConditionModel",
             "dit-flux": "FluxTransformer2DModel", "dit-sd3": "SD3Transformer2DModel",
             "dit-lumina2": "Lumina2Transformer2DModel"}
WITH_T5 = ("flux", "sd3")
"""Those with a T5-XXL: it trains never, and is cached where the config caches (``t5=cached``)."""
CLIPS_TRAIN_IN_FULL = ("unet", "sd3")
"""Families whose full fine-tuning script trains the text encoders with ``train_text_encoder`` (sdxl_train,
sd3_train; flux_train and lumina_train have no such flag)."""


def holder(model: str) -> str | None:
    """The family of the workload's denoiser where it can hold its text encoders: a built-in's, or a diffusers
    folder's or hub id's as its config says; None for any other, or one that cannot be read here."""
    from memfit.errors import UserError
    from memfit.workloads import load_workload
    from memfit.workloads.builtin import builtin_names
    base = split_overrides(model)[0]
    if base in BUILT_INS or base in builtin_names():
        return HOLDERS.get(BUILT_INS.get(base, ""))
    try:
        return HOLDERS.get(load_workload(model).info.config.get("model_class", ""))
    except UserError:
        return None


def text_encoders(model: str, data: dict, where: str, warnings: list[str], family: str | None
                  ) -> tuple[str, bool]:
    """(the workload, whether its text encoders run in the step). A LoRA without ``network_train_unet_only`` (or
    a full fine-tuning of SD/SDXL or SD3 with ``train_text_encoder``) trains them; a config that does not cache
    their outputs runs them frozen. The SD, SDXL, FLUX.1, SD3 and Lumina 2 workloads hold them
    (``text_encoders=trained|frozen``; FLUX.1's and SD3's CLIPs train, their T5-XXL cached where the config
    caches: ``t5=cached``, and with sd3_train's ``use_t5xxl_cache_only``); for another model that is said in
    one line. ``family``: :func:`holder` of ``model``."""
    lora = bool(data.get("network_module"))
    trained = not data.get("network_train_unet_only") if lora else \
        bool(data.get("train_text_encoder")) and family in CLIPS_TRAIN_IN_FULL
    t5_only = family == "sd3" and not lora and bool(data.get("use_t5xxl_cache_only"))
    cached = _caches(data, "cache_text_encoder_outputs") or t5_only
    mode = "trained" if trained else "frozen" if not cached or t5_only else None
    if data.get("train_t5xxl") or network_args(data, where).get("train_t5xxl") == "True":
        warnings.append(f"kohya config {where}: train_t5xxl: memfit trains the CLIP encoders only; T5-XXL's training "
                        "and its activations for backward are not in the estimate")
    if mode is None:
        return model, False
    if family is not None:
        t5_cached = family in WITH_T5 and cached
        if data.get("fp8_base_unet"):
            warnings.append(f"kohya config {where}: fp8_base_unet keeps the text encoders in bf16 where memfit's fp8 "
                            "base weights store their linear layers in fp8 too (" + (
                                "T5-XXL's 4.8 GB, " if family in WITH_T5 and not t5_cached else "") +
                            "less than sd-scripts holds); use fp8_base to have them in fp8")
        model = with_override(model, "text_encoders", mode)
        return (with_override(model, "t5", "cached") if t5_cached else model), True
    if trained:
        warnings.append(f"kohya config {where}: the text encoders are trained too (no network_train_unet_only); "
                        f"memfit estimates the denoiser's {'LoRA' if lora else 'training'} alone (it holds text "
                        "encoders for SD, SDXL, FLUX.1, SD3 and Lumina 2 only)")
    return model, False


def caption(model: str, data: dict, where: str, warnings: list[str], family: str | None) -> str:
    """FLUX.1's and SD3's T5 tokens a caption (``t5xxl_max_token_length``; sd-scripts' defaults are the
    built-ins': 512, schnell's 256, SD3's 256); another model's is said in one line. FLUX.1's
    ``apply_t5_attn_mask`` masks its attention (``t5_mask=true``: NOTE [ kohya's T5 attention mask ] in
    memfit.workloads.packed_dits; SD3's masks T5's own encoding alone, nothing the step holds)."""
    if data.get("apply_t5_attn_mask") and family == "flux":
        model = with_override(model, "t5_mask", "true")
    tokens = data.get("t5xxl_max_token_length")
    if tokens is None:
        return model
    if family in WITH_T5:
        return with_override(model, "t5_tokens", whole(data, "t5xxl_max_token_length", where, 512))
    warnings.append(f"kohya config {where}: t5xxl_max_token_length is not mapped for this model; the estimate keeps "
                    "its own caption length")
    return model


def _caches(data: dict, key: str) -> bool:
    return bool(data.get(key) or data.get(f"{key}_to_disk"))


def text_states_cached(data: dict, where: str, warnings: list[str], text: bool) -> None:
    """memfit's batch is cached latents and text-encoder outputs (``text``: the encoders run in the step, as
    the workload holds them); a config that runs the VAE or text encoders in the step otherwise is named."""
    for key, what in (("cache_latents", "latents"), ("cache_text_encoder_outputs", "text-encoder outputs")):
        if not _caches(data, key) and not (text and key == "cache_text_encoder_outputs"):
            warnings.append(f"kohya config {where}: {what} are not cached ({key}); memfit's batch is the cached "
                            f"tensors, so what computes them in the step is not in the estimate")
