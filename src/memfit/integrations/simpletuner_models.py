"""SimpleTuner's model families as memfit reads them (memfit.integrations.simpletuner reads the rest): which
denoiser a ``model_family`` and ``model_flavour`` load, the LoRA's target layers, and what ``base_model_precision``
stores. Read from SimpleTuner's source (bghira/SimpleTuner, simpletuner/helpers/models/<family>/model.py:
``HUGGINGFACE_PATHS``, ``DEFAULT_MODEL_FLAVOUR``, ``DEFAULT_LORA_TARGET``, flux's ``get_lora_target_layers``;
simpletuner/helpers/training/quantisation/__init__.py).

SimpleTuner trains its own copies of diffusers' denoisers (simpletuner/helpers/models/<family>/transformer.py: the
same layers and checkpoints, with its block swapping, TREAD routing and checkpoint intervals added); memfit builds
diffusers' class of the same checkpoint. A flavour whose published checkpoint is a built-in's is that built-in;
another flavour, or a ``pretrained_model_name_or_path`` of its own, is read as the hub id or folder it names.
"""

from __future__ import annotations

from memfit.errors import UserError
from memfit.integrations.ai_toolkit import SD35_LARGE
from memfit.workloads.config_overrides import with_override

FLAVOURS: dict[str, tuple[str, dict[str, str]]] = {
    "flux": ("krea", {"dev": "black-forest-labs/flux.1-dev", "krea": "black-forest-labs/flux.1-krea-dev",
                      "schnell": "black-forest-labs/flux.1-schnell", "kontext": "black-forest-labs/flux.1-kontext-dev",
                      "fluxbooru": "terminusresearch/fluxbooru-v0.3", "libreflux": "jimmycarter/LibreFlux-SimpleTuner"}),
    "flux2": ("klein-9b", {"dev": "black-forest-labs/FLUX.2-dev", "klein-4b": "black-forest-labs/FLUX.2-klein-base-4B",
                           "klein-9b": "black-forest-labs/FLUX.2-klein-base-9B"}),
    "sdxl": ("base-1.0", {"base-1.0": "stabilityai/stable-diffusion-xl-base-1.0",
                          "refiner-1.0": "stabilityai/stable-diffusion-xl-refiner-1.0",
                          "base-0.9": "stabilityai/stable-diffusion-xl-base-0.9",
                          "refiner-0.9": "stabilityai/stable-diffusion-xl-refiner-0.9"}),
    "sd1x": ("dreamshaper", {"1.5": "stable-diffusion-v1-5/stable-diffusion-v1-5", "1.4": "CompVis/stable-diffusion-v1-4",
                             "dreamshaper": "Lykon/dreamshaper-8", "realvis": "SG161222/RealVisXL_V5.0"}),
    "sd3": ("medium", {"medium": "stabilityai/stable-diffusion-3.5-medium",
                       "large": "stabilityai/stable-diffusion-3.5-large"}),
    "wan": ("t2v-480p-1.3b-2.1", {
        "t2v-480p-1.3b-2.1": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "t2v-480p-14b-2.1": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "i2v-14b-2.1": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "i2v-14b-2.1-720p": "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
        "i2v-14b-2.2-high": "Wan-AI/Wan2.2-I2V-A14B-Diffusers", "i2v-14b-2.2-low": "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
        "animegen-t2v-high": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "animegen-t2v-low": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "flf2v-14b-2.1": "Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers", "vace-1.3b-2.1": "Wan-AI/Wan2.1-VACE-1.3B-diffusers",
        "vace-14b-2.1": "Wan-AI/Wan2.1-VACE-14B-diffusers", "ti2v-5b-2.2": "Wan-AI/Wan2.2-TI2V-5B-Diffusers"}),
    "ltxvideo": ("0.9.5", {"0.9.5": "Lightricks/LTX-Video-0.9.5", "0.9.0": "Lightricks/LTX-Video"}),
    "ltxvideo2": ("dev", {"dev": "Lightricks/LTX-2", "dev-fp4": "Lightricks/LTX-2", "dev-fp8": "Lightricks/LTX-2",
                          "2.3-dev": "dg845/LTX-2.3-Diffusers", "2.3-distilled": "dg845/LTX-2.3-Distilled-Diffusers",
                          "2.5-dev": "Lightricks/LTX-2.5", "2.5-distilled": "Lightricks/LTX-2.5"}),
    "sana": ("sana1.5-4.8b-1024", {
        "sana1.5-4.8b-1024": "Efficient-Large-Model/SANA1.5_4.8B_1024px_diffusers",
        "sana1.5-1.6b-1024": "Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers",
        "sana1.0-1.6b-2048": "Efficient-Large-Model/Sana_1600M_2Kpx_BF16_diffusers",
        "sana1.0-1.6b-1024": "Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers",
        "sana1.0-600m-1024": "Efficient-Large-Model/Sana_600M_1024px_diffusers",
        "sana1.0-600m-512": "Efficient-Large-Model/Sana_600M_512px_diffusers"}),
    "pixart_sigma": ("900M-1024-v0.6", {
        "900M-1024-v0.6": "terminusresearch/pixart-900m-1024-ft-v0.6",
        "900M-1024-v0.7-stage1": "terminusresearch/pixart-900m-1024-ft-v0.7-stage1",
        "900M-1024-v0.7-stage2": "terminusresearch/pixart-900m-1024-ft-v0.7-stage2",
        "600M-512": "PixArt-alpha/PixArt-Sigma-XL-2-512-MS", "600M-1024": "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
        "600M-2048": "PixArt-alpha/PixArt-Sigma-XL-2-2K-MS"}),
    "auraflow": ("v0.3", {"pony": "purplesmartai/pony-v7-base", "v0.3": "terminusresearch/auraflow-v0.3",
                          "v0.2": "fal/AuraFlow-v0.2", "v0.1": "fal/AuraFlow"}),
    "lumina2": ("2.0", {"2.0": "Alpha-VLLM/Lumina-Image-2.0"}),
    "qwen_image": ("v2.0", {"v1.0": "Qwen/Qwen-Image", "v2.0": "Qwen/Qwen-Image-2512", "edit-v1": "Qwen/Qwen-Image-Edit",
                            "edit-v2": "Qwen/Qwen-Image-Edit-2509", "edit-v2+": "Qwen/Qwen-Image-Edit-2509",
                            "edit-v3": "Qwen/Qwen-Image-Edit-2511"}),
    "hidream": ("full", {"dev": "HiDream-ai/HiDream-I1-Dev", "full": "HiDream-ai/HiDream-I1-Full",
                         "fast": "HiDream-ai/HiDream-I1-Fast"}),
    "chroma": ("base", {"base": "lodestones/Chroma1-Base", "hd": "lodestones/Chroma1-HD",
                        "flash": "lodestones/Chroma1-Flash"}),
    "z_image": ("turbo-ostris-v2", {"base": "TONGYI-MAI/Z-Image", "turbo": "TONGYI-MAI/Z-Image-Turbo",
                                    "turbo-ostris-v2": "TONGYI-MAI/Z-Image-Turbo",
                                    "ostris-de-turbo": "TONGYI-MAI/Z-Image-Turbo"}),
}
"""The families memfit reads: (``DEFAULT_MODEL_FLAVOUR``, ``HUGGINGFACE_PATHS``) of each model.py."""
BUILT_INS = {
    "black-forest-labs/flux.1-dev": "dit-flux", "black-forest-labs/flux.1-krea-dev": "dit-flux",
    "black-forest-labs/flux.1-schnell": "dit-flux:guidance_embeds=false", "black-forest-labs/flux.1-kontext-dev": "dit-flux",
    "black-forest-labs/flux.2-dev": "dit-flux2", "stabilityai/stable-diffusion-xl-base-1.0": "unet-sdxl",
    "stabilityai/stable-diffusion-xl-base-0.9": "unet-sdxl",
    "stable-diffusion-v1-5/stable-diffusion-v1-5": "unet-sd15", "compvis/stable-diffusion-v1-4": "unet-sd15",
    "lykon/dreamshaper-8": "unet-sd15", "stabilityai/stable-diffusion-3.5-large": SD35_LARGE,
    "wan-ai/wan2.1-t2v-1.3b-diffusers": "dit-wan-1.3b", "wan-ai/wan2.1-t2v-14b-diffusers": "dit-wan",
    "wan-ai/wan2.2-i2v-a14b-diffusers": "dit-wan-i2v", "wan-ai/wan2.2-t2v-a14b-diffusers": "dit-wan",
    "wan-ai/wan2.2-ti2v-5b-diffusers": "dit-wan-5b", "lightricks/ltx-video": "dit-ltx-video",
    "lightricks/ltx-2": "dit-ltx2",
    "efficient-large-model/sana_1600m_1024px_bf16_diffusers": "dit-sana",
    "pixart-alpha/pixart-sigma-xl-2-1024-ms": "dit-pixart-sigma", "terminusresearch/auraflow-v0.3": "dit-auraflow",
    "alpha-vllm/lumina-image-2.0": "dit-lumina2", "qwen/qwen-image": "dit-qwenimage",
    **{f"hidream-ai/hidream-i1-{v}": "dit-hidream:force_inference_output=false" for v in ("dev", "full", "fast")},
    **{f"lodestones/chroma1-{v}": "dit-chroma" for v in ("base", "hd", "flash")},
    "tongyi-mai/z-image": "dit-zimage", "tongyi-mai/z-image-turbo": "dit-zimage",
}
"""Published checkpoints that are a built-in's model (lower-cased: SimpleTuner writes FLUX's ids so). HiDream-I1 as
SimpleTuner's copy trains it: its routed experts on their training path (``self.training``), not the inference one.
A Wan 2.2 A14B flavour trains one expert (its ``trained_stage``)."""
OWN_TEXT = ("flux", "sdxl", "sd1x", "sd3", "lumina2", "z_image", "hidream")
"""The families whose denoisers memfit builds with their text encoders (memfit.workloads.text_encoders)."""
VIDEO = {"wan": 8, "ltxvideo": 8, "ltxvideo2": 8}
"""The video families, and their clips' frame step (``adjust_video_frames``: 8k + 1 frames, rounded down)."""
SEGMENTED = ("flux", "flux2", "sd3", "wan", "ltxvideo", "ltxvideo2", "pixart_sigma", "lumina2", "z_image")
"""The families whose transformers checkpoint ``gradient_checkpointing_interval`` blocks as one segment
(``checkpoint_sequential_state``) where no block is swapped; the others checkpoint one block in N."""
UNETS = ("sdxl", "sd1x")
"""The UNet families: no block swapping (their models take no ``musubi_blocks_to_swap``)."""
REFERENCE = {"kontext": "dit-flux:control_images=1"}
"""Flavours trained on reference images memfit's built-in holds: a ``conditioning`` dataset's latents join the
noisy ones (``control_images=1``)."""

ATTENTION = ["to_k", "to_q", "to_v", "to_out.0"]
TARGETS = {"flux": ATTENTION + ["to_qkv"], "chroma": ATTENTION + ["to_qkv"], "lumina2": ATTENTION + ["to_qkv"],
           "auraflow": ATTENTION + ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "to_qkv"],
           "flux2": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_qkv_mlp_proj"]}
"""``DEFAULT_LORA_TARGET`` where it is not the attention projections (ModelFoundation's, the other families')."""
MODULE_CLASSES = {"Attention": ATTENTION + ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
                  "FeedForward": ["net.0.proj", "net.2"]}
"""LyCORIS preset classes (``target_module``) as the linear layers inside them: diffusers' ``Attention``'s
projections, ``FeedForward``'s two (``net.0.proj``, ``net.2``)."""
FUSED = ("to_qkv", "add_qkv_proj")
"""Target names of the fused attention projections (models/common.py ``fuse_qkv_projections``)."""
_ALL = ["to_k", "to_q", "to_v", "to_qkv", "add_qkv_proj", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0",
        "to_add_out"]
_FFS = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"]
_CONTEXT = ["add_k_proj", "add_q_proj", "add_v_proj", "add_qkv_proj", "to_add_out"]
FLUX_TARGETS = {
    "all": _ALL, "context": _CONTEXT, "context+ffs": _CONTEXT + ["ff_context.net.0.proj", "ff_context.net.2"],
    "all+ffs": _ALL + _FFS, "all+ffs+embedder": ["x_embedder", *_ALL, *_FFS],
    "ai-toolkit": _ALL + _FFS[:4] + ["norm.linear", "norm1.linear", "norm1_context.linear", "proj_mlp", "proj_out"],
    "tiny": ["single_transformer_blocks.7.proj_out", "single_transformer_blocks.20.proj_out"],
    "nano": ["single_transformer_blocks.7.proj_out"],
}
"""FLUX.1's ``flux_lora_target`` (default ``all``; Chroma reads it too), as its ``get_lora_target_layers``."""

ONE_BYTE = ("int8-quanto", "fp8-quanto", "fp8uz-quanto", "int8-torchao", "int8dq-torchao", "fp8-torchao",
            "fp8wo-torchao", "fp8-native", "fp8-transformerengine", "int8-sdnq", "uint8-sdnq", "fp8-sdnq")
HALF_BYTE = ("nf4-bnb", "int4-torchao", "int4-quanto", "int8dq-int4-torchao", "fp8-int4-torchao", "uint4-sdnq")
BOUNDS = {"int2-quanto": "nf4", "uint3-sdnq": "nf4", "uint2-sdnq": "nf4", "int6-sdnq": "fp8", "int5-sdnq": "fp8",
          "uint5-sdnq": "fp8", "int16-sdnq": "as-is", "uint16-sdnq": "as-is", "fp16-sdnq": "as-is"}
"""``base_model_precision`` presets memfit stores in other bytes: 2-3 bits as 4 (nf4), 5-6 as 8 (fp8), 16 as 16."""


def workload(family: str, args: dict, datasets: list, where: str, warnings: list[str]) -> str:
    """The denoiser ``model_family``, ``model_flavour`` and ``pretrained_model_name_or_path`` load, as memfit's
    built-in where the checkpoint is one's, else the hub id or folder as named."""
    if family not in FLAVOURS:
        raise UserError(f"--from {where}: memfit reads SimpleTuner's {', '.join(FLAVOURS)} configs, not model_family "
                        f"{family!r}; name the model as the workload: memfit estimate ORG/NAME --from {where}")
    default, paths = FLAVOURS[family]
    flavour = str(args.get("model_flavour") or default)
    if flavour not in paths:
        raise UserError(f"--from {where}: model_flavour {flavour!r} is not one of SimpleTuner's {family} flavours "
                        f"({', '.join(paths)}); set one, or name the model as the workload")
    if flavour.startswith("edit-"):
        raise UserError(f"--from {where}: qwen_image {flavour} trains on reference images memfit does not hold here; "
                        f"name the model as the workload: memfit estimate dit-qwenimage:control_images=1 --from {where}")
    name = str(args.get("pretrained_model_name_or_path") or paths[flavour]).strip()
    if args.get("pretrained_transformer_model_name_or_path"):
        warnings.append(f"SimpleTuner config {where}: pretrained_transformer_model_name_or_path: its transformer is "
                        f"read as {name}'s architecture")
    if family == "ltxvideo2" and flavour in ("dev-fp4", "dev-fp8"):
        warnings.append(f"SimpleTuner config {where}: model_flavour {flavour} loads LTX-2's {flavour[4:]} checkpoint file "
                        "into the model's dtype; read as the dev model (its storage on the disk is not in the estimate)")
    if name.lower().endswith((".safetensors", ".gguf", ".ckpt", ".sft")):
        warnings.append(f"SimpleTuner config {where}: {name} is a checkpoint file; read as the {family} {flavour} "
                        "model it holds" + (" (a GGUF file's quantized weights are not in the estimate)"
                                            if name.lower().endswith(".gguf") else ""))
        name = paths[flavour]
    named = BUILT_INS.get(name.lower(), name)
    if flavour in REFERENCE and named == "dit-flux" and any(conditioning(d) for d in datasets):
        named = REFERENCE[flavour]
    return named


def conditioning(dataset: dict) -> bool:
    """A dataset of reference images (``dataset_type: conditioning``, or one a dataset pairs with)."""
    return dataset.get("dataset_type") == "conditioning" or bool(dataset.get("conditioning_data"))


def lora_targets(family: str, args: dict, where: str) -> list[str]:
    """The PEFT LoRA's ``target_modules``: ``peft_lora_target_modules`` where given, else the family's own."""
    manual = args.get("peft_lora_target_modules")
    if isinstance(manual, str):
        import json
        try:
            manual = json.loads(manual)
        except ValueError:
            manual = manual.split(",")
    if manual:
        names = manual if isinstance(manual, list) else None
        if names is None or not all(isinstance(n, str) and n.strip() and "+" not in n for n in names):
            raise UserError(f"--from {where}: peft_lora_target_modules must be a list of module names, got {manual!r}")
        return [n.strip() for n in names]
    if args.get("slider_lora_target") not in (None, False, "false"):  # (SLIDER_LORA_TARGET: the default's)
        return TARGETS.get(family, ATTENTION)
    if family in ("flux", "chroma"):
        target = str(args.get("flux_lora_target", "all"))
        if target not in FLUX_TARGETS:
            raise UserError(f"--from {where}: flux_lora_target {target!r} is not one memfit reads; use one of "
                            f"{', '.join(FLUX_TARGETS)}")
        return FLUX_TARGETS[target]
    return TARGETS.get(family, ATTENTION)


def unfused(targets: list[str]) -> list[str]:
    """The targets but the fused projections (``to_qkv``, ``add_qkv_proj``: there only under
    ``fuse_qkv_projections``; memfit's model keeps q, k and v apart, each adapted)."""
    return [t for t in targets if t not in FUSED]


def base_weights(precision: str, family: str, text: str, where: str, warnings: list[str]) -> dict:
    """``base_model_precision`` as memfit's base weights (the transformer's linear layers)."""
    if precision == "no_change":
        return {}
    if precision in ONE_BYTE:
        stored = "fp8"
    elif precision in HALF_BYTE:
        stored = "nf4"
    elif precision in BOUNDS:
        stored = BOUNDS[precision]
        warnings.append(f"SimpleTuner config {where}: base_model_precision {precision}: memfit stores those weights "
                        f"as {stored} (a bound)")
    else:
        raise UserError(f"--from {where}: base_model_precision {precision!r} is not one SimpleTuner takes that memfit "
                        "reads; use no_change, int8-quanto, fp8-torchao, nf4-bnb, int4-torchao or another preset")
    if family == "wan" and "quanto" in precision:
        warnings.append(f"SimpleTuner config {where}: quanto leaves Wan's feed-forward layers (*ffn*) in bf16; memfit "
                        "quantizes them too (low by a byte or more a feed-forward weight)")
    if text == "frozen" and family in OWN_TEXT and stored != "as-is":
        warnings.append(f"SimpleTuner config {where}: memfit stores the text encoders' linear weights as the "
                        "transformer's; SimpleTuner quantizes them only with text_encoder_N_precision")
    return {} if stored == "as-is" else {"base_weights": stored}


def frames(family: str, dataset: dict, where: str, warnings: list[str]) -> int:
    """A video dataset's frames (``video.num_frames``, default 5 s at ``framerate`` 30: 150), down to the family's
    8k + 1; an image dataset's: 1."""
    if dataset.get("dataset_type") != "video":
        return 1
    video = dataset.get("video") or {}
    asked = video.get("num_frames", 150) if isinstance(video, dict) else 150
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise UserError(f"--from {where}: dataset {dataset.get('id')!r} video.num_frames must be a whole number >= 1, "
                        f"got {asked!r}")
    step = VIDEO.get(family, 1)
    got = max(1, (asked - 1) // step * step + 1)
    if got != asked:
        warnings.append(f"SimpleTuner config {where}: num_frames {asked}: SimpleTuner trains {got} "
                        f"({step}k + 1 frames)")
    return got


def with_frames(named: str, family: str, count: int) -> str:
    """A video family's workload with its clip's frames."""
    return named if family not in VIDEO or "frames=" in named else with_override(named, "frames", count)
