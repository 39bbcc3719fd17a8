"""ai-toolkit's edit models, Wan 2.2 A14B and HiDream-I1, as memfit reads them (memfit.integrations.ai_toolkit reads the rest).

- Edit pairs (``flux_kontext``, ``qwen_image_edit``, ``qwen_image_edit_plus2509``): a dataset's ``control_path``
  (and ``control_path2``, ``control_path3``) join reference images' tokens to the noisy ones (``control_images=N``:
  NOTE [ Kontext's reference image ] in memfit.workloads.packed_dits); Qwen-Image-Edit's cached caption states hold
  the references' vision tokens too.
- Wan 2.2 A14B (``wan22_14b``, ``wan22_14b_i2v``): both experts, switched as the trainer switches them, the idle one
  on the host under ``low_vram`` (memfit.workloads.wan_experts); I2V's still-image clips.
- HiDream-I1 (``hidream``): ai-toolkit's own copy of the model, the routed experts on their training path, and the
  four text encoders in the step (:func:`hidream`).
"""

from __future__ import annotations

from memfit.errors import UserError
from memfit.integrations.configs import whole
from memfit.workloads.config_overrides import with_override

EDITS = {"flux_kontext": "dit-flux", "qwen_image_edit": "dit-qwenimage", "qwen_image_edit_plus2509": "dit-qwenimage"}
"""The edit archs whose datasets' ``control_path`` pairs join reference images' tokens (``control_images=N``), and
the built-in each reads as."""
EXPERTS = ("wan22_14b", "wan22_14b_i2v")
"""Wan 2.2 A14B: ai-toolkit loads both experts and trains a LoRA on each in turns (memfit.workloads.wan_experts)."""
QWEN_EDIT_CAPTION = 37 * 37 + 7 + 64
"""Qwen-Image-Edit's caption states with the reference image (``QwenImageEditPipeline.encode_prompt``, as ai-toolkit
calls it): Qwen2.5-VL sees the reference at 1 MP, 1036 x 1036 after its 28-pixel rounding, so 37 x 37 merged patches;
the vision markers and the chat template's end after the 64 dropped system tokens (7); 64 of the caption's own."""
PLUS_REFERENCE_TOKENS = 14 * 14 + 6
"""Qwen-Image-Edit-2509's caption states of one reference (``QwenImageEditPlusPipeline``: Qwen2.5-VL sees each at
384 x 384, 392 x 392 after its 28-pixel rounding, so 14 x 14 merged patches; "Picture N: " and the vision markers)."""
PLUS_REFERENCE_PX = 1024
"""Edit-2509's references reach the denoiser at 1 MP whatever the target's size (``VAE_IMAGE_SIZE``; ai-toolkit's
``match_target_res`` sizes them as the target)."""


def reference_image(arch: str, workload: str, model: dict, datasets: list, where: str, warnings: list[str]) -> str:
    """An edit model's paired datasets (``control_path``): the reference image's latents joined to the noisy ones
    (NOTE [ Kontext's reference image ] in memfit.workloads.packed_dits), encoded by the VAE in each step; for
    Qwen-Image-Edit the caption's states hold the reference's vision tokens too (:data:`QWEN_EDIT_CAPTION`)."""
    built_in = EDITS[arch]
    warnings.append(f"ai-toolkit config {where}: control_path: ai-toolkit encodes each reference image with the VAE in "
                    "the step (its latents are not cached); the VAE and its encoding, before the forward, are not in the "
                    "estimate")
    if "control_images=" in workload:
        return workload
    if not workload.startswith(built_in):
        warnings.append(f"ai-toolkit config {where}: the reference image's tokens are added to memfit's built-in only; "
                        f"name the model as {built_in}:control_images=1 to hold them")
        return workload
    if arch == "qwen_image_edit_plus2509":
        return _plus_references(workload, model, datasets, where, warnings)
    workload = with_override(workload, "control_images", 1)
    if arch == "qwen_image_edit" and "caption_tokens=" not in workload:
        warnings.append(f"ai-toolkit config {where}: Qwen2.5-VL's caption states hold the reference image's vision "
                        f"tokens; memfit's are {QWEN_EDIT_CAPTION} (a 1 MP reference, a caption of up to 64 tokens)")
        workload = with_override(workload, "caption_tokens", QWEN_EDIT_CAPTION)
    return workload


def _plus_references(workload: str, model: dict, datasets: list, where: str, warnings: list[str]) -> str:
    """Qwen-Image-Edit-2509's references: as many as a dataset's ``control_path``, ``control_path2``, ``control_path3``
    (ai-toolkit's ``qwen_image_edit_plus``), each at 1 MP (or the target's size, ``match_target_res``), and their vision
    tokens in the caption states (:data:`PLUS_REFERENCE_TOKENS` each, 5 of the template's, 64 of the caption's)."""
    count = max(sum(1 for k in ("control_path", "control_path2", "control_path3") if d.get(k))
                for d in datasets if isinstance(d, dict))
    workload = with_override(workload, "control_images", count)
    if not (model.get("model_kwargs") or {}).get("match_target_res"):
        workload = with_override(workload, "control_px", PLUS_REFERENCE_PX)
    caption = count * PLUS_REFERENCE_TOKENS + 5 + 64
    warnings.append(f"ai-toolkit config {where}: Qwen2.5-VL's caption states hold the references' vision tokens; "
                    f"memfit's are {caption} ({count} references at 384 px, a caption of up to 64 tokens)")
    return with_override(workload, "caption_tokens", caption)


def clip_frames(model: dict, frames: int, where: str, warnings: list[str]) -> int:
    """Wan 2.2 I2V's ``image_i2v_clip_training``: a share of the still-image batches (``image_i2v_clip_training_prob``)
    become static clips of ``image_i2v_clip_num_frames`` (default 5), whose step is the larger: memfit's clip is theirs."""
    kwargs = model.get("model_kwargs") or {}
    if not kwargs.get("image_i2v_clip_training"):
        return frames
    clip = whole(kwargs, "image_i2v_clip_num_frames", where, 5)
    clip = max(1, (clip - 1) // 4 * 4 + 1)
    if clip > frames:
        warnings.append(f"ai-toolkit config {where}: image_i2v_clip_training makes a share of the batches clips of "
                        f"{clip} frames; memfit's step is one of those (the larger)")
    return max(frames, clip)


def experts(workload: str, model: dict, train: dict, where: str, warnings: list[str]) -> str:
    """Wan 2.2 A14B's two experts as ai-toolkit trains them: ``model_kwargs`` ``train_high_noise`` and
    ``train_low_noise`` (both: the trainer switches between them every ``switch_boundary_every`` batches, accumulated
    or not; one: the other is carried, never run) and ``low_vram`` (the expert not running waits on the host)."""
    kwargs = model.get("model_kwargs") or {}
    trained = [bool(kwargs.get(k, True)) for k in ("train_high_noise", "train_low_noise")]
    if not any(trained):
        raise UserError(f"--from {where}: model_kwargs train_high_noise and train_low_noise are both false (ai-toolkit "
                        "refuses it); train at least one expert")
    every = whole(train, "switch_boundary_every", where, 1)
    accum = max(whole(train, "gradient_accumulation", where, 1), whole(train, "gradient_accumulation_steps", where, 1))
    switch = "none" if not all(trained) else "batch" if every == 1 or every % accum else "step"
    workload = with_override(with_override(workload, "experts", 2), "switch", switch)
    if model.get("low_vram"):
        workload = with_override(workload, "low_vram", True)
        if switch == "batch":
            warnings.append(f"ai-toolkit config {where}: low_vram with a switch at every batch copies an expert's weights "
                            "over the host link each time (ai-toolkit suggests switch_boundary_every: 10 or 20)")
    return workload


def hidream(workload: str, text: str, quantized: bool, where: str, warnings: list[str]) -> str:
    """ai-toolkit's ``hidream``: its own copy of HiDream-I1's model (extensions_built_in/diffusion_models/hidream),
    whose routed experts always run their training path, each token repeated for its two experts and gradients through
    them (``force_inference_output=false``; diffusers' LoRA script loads the inference path), and whose router appends
    each forward's balancing statistics to a module-level list. Its four text encoders stay on the device, each
    caption encoded every step (memfit.workloads.hidream_text); ``quantize_te`` quantizes Llama-3.1 and T5-XXL, not
    the CLIPs."""
    if "force_inference_output=" not in workload:
        workload = with_override(workload, "force_inference_output", "false")
    warnings.append(f"ai-toolkit config {where}: ai-toolkit's HiDream router appends each forward's balancing "
                    "statistics to a list (a few KB a block): not in the estimate")
    if text == "frozen" and quantized:
        warnings.append(f"ai-toolkit config {where}: quantize_te quantizes Llama-3.1 and T5-XXL; memfit's fp8 base "
                        "weights store the CLIPs' linear layers in one byte too (0.7 GB less than ai-toolkit holds)")
    return workload
