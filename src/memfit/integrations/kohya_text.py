"""kohya-ss sd-scripts configs: the text encoders a run holds in its step, and T5's caption length
(memfit.integrations.kohya maps the rest; memfit.workloads.text_encoders builds the encoders)."""

from __future__ import annotations

from memfit.integrations.configs import whole
from memfit.workloads.config_overrides import with_override

HOLDERS = ("unet", "flux", "sd3", "lumina")
"""sd-scripts' model families whose workloads hold their text encoders in the step (memfit.workloads.text_encoders:
the SD/SDXL, FLUX.1, SD3 and Lumina 2 built-ins, and diffusers folders or hub ids of them)."""
WITH_T5 = ("flux", "sd3")
"""Those of them with a T5-XXL: it trains never, and is cached where the config caches (``t5=cached``)."""


def text_encoders(model: str, data: dict, where: str, warnings: list[str], family: str | None
                  ) -> tuple[str, bool]:
    """(the workload, whether its text encoders run in the step). A LoRA without ``network_train_unet_only`` (or
    a full fine-tuning with ``train_text_encoder``) trains them; a config that does not cache their outputs runs
    them frozen. The SD, SDXL, FLUX.1, SD3 and Lumina 2 built-ins hold them (``text_encoders=trained|frozen``; FLUX.1 and
    SD3 train their CLIPs only, T5-XXL cached where the config caches: ``t5=cached``); for another model that is
    said in one line. ``family``: sd-scripts' code for the model (memfit.integrations.kohya.family_of)."""
    lora = bool(data.get("network_module"))
    trained = not data.get("network_train_unet_only") if lora else bool(data.get("train_text_encoder"))
    cached = _caches(data, "cache_text_encoder_outputs")
    mode = "trained" if trained else None if cached else "frozen"
    if family in WITH_T5 and any("train_t5xxl" in str(a) and "true" in str(a).lower()
                               for a in data.get("network_args") or []):
        warnings.append(f"kohya config {where}: train_t5xxl: memfit trains the CLIP encoders only; T5-XXL's LoRA and "
                        "its activations for backward are not in the estimate")
    if mode is None:
        return model, False
    if family in HOLDERS:
        if family in WITH_T5 and data.get("fp8_base_unet"):
            warnings.append(f"kohya config {where}: fp8_base_unet keeps the text encoders in bf16 where memfit's fp8 "
                            "base weights store them in fp8 too (T5-XXL: 4.8 GB more on the device than estimated); "
                            "use fp8_base to have them in fp8")
        model = with_override(model, "text_encoders", mode)
        return (with_override(model, "t5", "cached") if family in WITH_T5 and cached else model), True
    if trained:
        warnings.append(f"kohya config {where}: the text encoders are trained too (no network_train_unet_only); "
                        f"memfit estimates the denoiser's {'LoRA' if lora else 'training'} alone (it holds text "
                        "encoders for SD, SDXL, FLUX.1, SD3 and Lumina 2 only)")
    return model, False


def caption(model: str, data: dict, where: str, warnings: list[str], family: str | None) -> str:
    """FLUX.1's and SD3's T5 tokens a caption (``t5xxl_max_token_length``; sd-scripts' defaults are the
    built-ins': 512, schnell's 256, SD3's 256); another model's is said in one line."""
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
