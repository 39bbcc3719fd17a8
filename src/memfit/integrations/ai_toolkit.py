"""ai-toolkit (ostris) job configs: a diffusion LoRA's YAML as memfit's workload, sizes and plan (``memfit estimate
--from train_lora_flux_24gb.yaml``; told from an axolotl YAML by its ``config: process:``).

What ai-toolkit's ``sd_trainer`` runs, read from its source (toolkit/stable_diffusion_model.py,
jobs/process/BaseSDTrainProcess.py, toolkit/config_modules.py, extensions_built_in/diffusion_models), and how
memfit maps it:

| ai-toolkit | what it runs | memfit |
|---|---|---|
| ``model.arch`` (or ``is_flux``, ``is_xl``, ``is_v3``, ``is_lumina2``; none: SD 1.x), ``name_or_path`` | the arch's denoiser from the hub id or folder | FLUX.1 (``flux``, ``flex1``), SD 1.x, SDXL, SD3/3.5, Lumina 2, Qwen-Image, FLUX.2, FLUX.1 Kontext and Qwen-Image-Edit (``flux_kontext``, ``qwen_image_edit``, ``qwen_image_edit_plus2509`` or ``qwen_image_edit_plus``; a dataset's ``control_path``: ``control_images=N``, memfit.integrations.ai_toolkit_models), Wan 2.1, Wan 2.2 (``wan22_14b``, ``wan22_14b_i2v``: both experts, ``dit-wan:experts=2``; ``wan22_5b``), Z-Image (``zimage``), HiDream-I1 (``hidream``: its own copy of the model, the routed experts on their training path, ``force_inference_output=false``; memfit.integrations.ai_toolkit_models): a published id as memfit's built-in (:data:`ARCHS`), else the id or folder |
| ``model.low_vram``, ``model_kwargs.train_high_noise``/``train_low_noise``, ``train.switch_boundary_every`` (Wan 2.2 A14B) | the expert not running on the host; which experts train, and how often the trainer switches | ``low_vram=true``, ``switch=batch``/``step``/``none`` (memfit.workloads.wan_experts) |
| ``model.quantize`` (``qtype`` qfloat8; torchao's ``uint3``-``uint4``; ``uint8``: none) | optimum-quanto or torchao: every ``nn.Linear`` of the transformer in one byte (or 3-4 bits), cast to bf16 per matmul; SD 1.x and SDXL: nothing | ``base_weights: fp8`` (``nf4``: 4 bits, a bound for 3) |
| ``model.quantize_te`` (default: ``quantize``) | T5-XXL quantized too; CLIP-L stays bf16 | fp8 base weights store both encoders' linear layers (CLIP-L: 85 MB less than ai-toolkit holds) |
| text encoders | on the device, each prompt encoded every step under no_grad, T5 at 512 tokens; ``cache_text_embeddings`` (train's or a dataset's) or ``unload_text_encoder``: cached | ``text_encoders=frozen`` (``cached``); Qwen-Image's, FLUX.2's and Wan's in the step: said, not held |
| ``datasets[].num_frames`` (Wan; default 1: images) | clips of that many frames | ``dit-wan:frames=`` down to 4k + 1 (said where it differs) |
| ``train.train_text_encoder`` | the encoders train | ``text_encoders=trained`` |
| ``network`` lora, ``rank`` or ``linear`` (default 4), ``linear_alpha`` (default ``alpha``, 1), ``transformer_only`` (default true), ``network_kwargs`` ``ignore_if_contains`` and ``only_if_contains`` | LoRA on every linear layer of a DiT's transformer blocks (its ``get_transformer_block_names``: Z-Image's 30 ``layers``, not its refiners; false: of the whole transformer; a UNet's: all of them), weights in fp32 | ``adapter: lora:r=linear,alpha=linear_alpha,targets=in-blocks`` (Z-Image: ``in-blocks:layers``; false, or SD 1.x and SDXL: ``targets=all-linear``); ``skip=`` and ``only=`` the names |
| ``network`` lokr, ``lokr_full_rank`` (default true), ``lokr_factor`` (default -1) | ai-toolkit's LoKr over the same layers, its linear layers' factored forward (the update never built as a matrix) | ``adapter: lokr:r=full,factor=lokr_factor,factored=1`` (``lokr_full_rank: false``: ``r=linear,alpha=linear_alpha``) |
| ``train.dtype`` bf16 / fp16 (default fp32) | the model in that dtype, the LoRA in fp32, no autocast (each adapted layer's input cast to fp32 and kept for backward) | ``bf16-base-noautocast`` / ``fp16-base-noautocast`` / ``fp32`` |
| no ``network`` | full fine-tuning: the whole transformer trains in ``train.dtype`` | no adapter; ``bf16-pure`` / ``fp16`` (fp32 weights under autocast: said) / ``fp32`` |
| ``train.gradient_checkpointing`` (default true) | every transformer block checkpointed | ``checkpointing: blocks`` |
| ``train.optimizer`` | adamw8bit and lion8bit (bitsandbytes), adamw, adafactor, prodigy (prodigyopt), ... | ``adamw8bit``, ``lion8bit``, ``adamw``, ``adafactor``, ``prodigy``; others refused |
| ``train.ema_config.use_ema``, ``ema_decay`` | an fp32 copy of the LoRA on the device | ``ema: {decay, device: device}`` |
| ``train.batch_size`` (a dataset's own ``batch_size`` wins), ``gradient_accumulation_steps`` | the micro-batch, accumulated | batch and micro-batch |
| ``model.layer_offloading`` (Qwen-Image, FLUX.2, Wan, Z-Image; the others ignore it) | a random ``layer_offloading_transformer_percent`` of the linear layers on the host, streamed | that share of the denoiser's blocks swapped (said) |
| ``datasets[].resolution`` (a side or a list), ``cache_latents(_to_disk)`` | buckets up to that side squared; latents cached, the VAE off the device | ``--resolution`` the largest side, down to a multiple of 16 (Z-Image: 32) |
| ``train.max_grad_norm`` (default 1.0) | clipping (none with adafactor) | ``max_grad_norm`` |

Said in one line each: an accuracy-recovery adapter; Z-Image Turbo's ``assistant_lora_path`` (merged into the weights
and held on the device, inactive); ``diff_output_preservation``
and ``blank_prompt_preservation`` (a second graph); a bf16 full fine-tuning's EMA (bf16 there); a quantization memfit stores in
other bytes (``qtype`` other than qfloat8/qint8); the text encoders' quantization where it differs from the
transformer's; latents not cached; ``layer_offloading`` (as that share of the blocks swapped); text encoders in the
step that memfit does not hold. Refused in one
line: another arch (name the model as the workload instead; Chroma, a model class of ai-toolkit's own: what
differs, :data:`OWN_MODELS`), a network other than LoRA and LoKr, an optimizer memfit does not run.
"""

from __future__ import annotations

from memfit.devices import Device
from memfit.errors import UserError
from memfit.integrations.ai_toolkit_models import (
    EDITS,
    EXPERTS,
    clip_frames,
    experts,
    hidream,
    reference_image,
)
from memfit.integrations.configs import TrainingConfig, whole
from memfit.plans import Plan
from memfit.techniques.lokr import is_factor
from memfit.workloads.config_overrides import with_override

FLUX_DEV, FLUX_SCHNELL = "black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.1-schnell"
SD35_LARGE = "dit-sd3:num_layers=38,num_attention_heads=38,caption_projection_dim=2432,pos_embed_max_size=192," \
             "qk_norm=rms_norm"
"""SD3.5 Large's MMDiT (8.1B: 38 blocks of 2432; its text encoders are SD3's)."""
ARCHS = {
    "flux": {FLUX_DEV: "dit-flux", FLUX_SCHNELL: "dit-flux:guidance_embeds=false"},
    "flux_kontext": {"black-forest-labs/FLUX.1-Kontext-dev": "dit-flux"},
    "sd1": {"runwayml/stable-diffusion-v1-5": "unet-sd15", "stable-diffusion-v1-5/stable-diffusion-v1-5": "unet-sd15",
            "CompVis/stable-diffusion-v1-4": "unet-sd15"},
    "sdxl": {"stabilityai/stable-diffusion-xl-base-1.0": "unet-sdxl"},
    "sd3": {"stabilityai/stable-diffusion-3-medium-diffusers": "dit-sd3",
            "stabilityai/stable-diffusion-3.5-large": SD35_LARGE},
    "lumina2": {"Alpha-VLLM/Lumina-Image-2.0": "dit-lumina2"},
    "qwen_image": {"Qwen/Qwen-Image": "dit-qwenimage"},
    "qwen_image_edit": {"Qwen/Qwen-Image-Edit": "dit-qwenimage"},
    "qwen_image_edit_plus2509": {"Qwen/Qwen-Image-Edit-2509": "dit-qwenimage"},
    "flux2": {"black-forest-labs/FLUX.2-dev": "dit-flux2"},
    "wan21": {"Wan-AI/Wan2.1-T2V-14B-Diffusers": "dit-wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": "dit-wan-1.3b"},
    "zimage": {"Tongyi-MAI/Z-Image-Turbo": "dit-zimage", "Tongyi-MAI/Z-Image": "dit-zimage"},
    "wan22_14b": {"ai-toolkit/Wan2.2-T2V-A14B-Diffusers-bf16": "dit-wan", "Wan-AI/Wan2.2-T2V-A14B-Diffusers": "dit-wan"},
    "wan22_14b_i2v": {"ai-toolkit/Wan2.2-I2V-A14B-Diffusers-bf16": "dit-wan-i2v",
                      "Wan-AI/Wan2.2-I2V-A14B-Diffusers": "dit-wan-i2v"},
    "wan22_5b": {"Wan-AI/Wan2.2-TI2V-5B-Diffusers": "dit-wan-5b"},
    "hidream": {f"HiDream-ai/HiDream-I1-{v}": "dit-hidream" for v in ("Full", "Dev", "Fast")},
}
"""ai-toolkit's model archs memfit reads (``arch``, or the older ``is_flux``, ``is_xl``, ``is_v3``, ``is_lumina2``;
none: SD 1.x), and the built-in of each published id; another id or a folder is read as a diffusers model."""
ALIASES = {"flex1": "flux", "qwen_image_edit_plus": "qwen_image_edit_plus2509"}
"""ai-toolkit's archs read as others: Flex.1, FLUX.1's kind; ``qwen_image_edit_plus``, the class its
``qwen_image_edit_plus2509`` (Qwen-Image-Edit-2509) is, which its UI writes for that model."""
OWN_MODELS = {
    "chroma": "ai-toolkit trains its own Chroma (FLUX's reference layers: fused qkv projections, and a [batch, heads, "
              "tokens, tokens] mask made through fp32 and int32 copies), from a single-file checkpoint with no config, "
              "not diffusers' ChromaTransformer2DModel (ChromaPipeline's) that memfit's dit-chroma builds; memfit estimate "
              "dit-chroma --adapter lora:r=16 predicts that one",
}
"""ai-toolkit's archs that train a model class of its own, not the diffusers class of a built-in: the name of the
model would build another model, so the refusal says what differs and what memfit predicts instead."""
UNETS = ("sd1", "sdxl")
"""The archs with a UNet: a LoRA there adapts every linear layer (ai-toolkit's ``transformer_only`` restricts a DiT's
to its transformer blocks alone), and ``network.conv`` would adapt its convolutions."""
HOLD_TEXT = ("flux", "flux_kontext", "sd1", "sdxl", "sd3", "lumina2", "zimage", "hidream")
"""The archs whose denoisers memfit builds with their text encoders (memfit.workloads.text_encoders)."""
OLD_FLAGS = {"is_v2": "sd2", "is_v3": "sd3", "is_xl": "sdxl", "is_pixart": "pixart", "is_pixart_sigma": "pixart_sigma",
             "is_auraflow": "auraflow", "is_flux": "flux", "is_lumina2": "lumina2", "is_vega": "sdxl", "is_ssd": "sdxl"}
"""The older flags, in the order ai-toolkit reads them (ModelConfig; Vega and SSD-1B are SDXL UNets, read from
their own configs)."""
WANS = ("wan21", "wan22_14b", "wan22_14b_i2v", "wan22_5b")
"""The Wan archs: a clip of ``num_frames``; the A14B ones (:data:`EXPERTS`) with two experts."""
QWENS = ("qwen_image", "qwen_image_edit", "qwen_image_edit_plus2509")
"""Qwen-Image and its edit models (their transformer's weights, quantized and offloaded alike)."""
QUANTIZED = ("flux", "flux_kontext", "sd3", "lumina2", *QWENS, "flux2", "zimage", *WANS, "hidream")
"""The archs whose transformer ai-toolkit quantizes with ``quantize`` (its SD 1.x and SDXL paths ignore it)."""
LAYER_OFFLOADED = (*QWENS, "flux2", "wan21", "zimage")
"""The archs whose models ai-toolkit's ``layer_offloading`` attaches its memory manager to (the others ignore it)."""
FLOW = ("flux", "flux_kontext", "sd3", "lumina2", *QWENS, "flux2", "zimage", *WANS, "hidream")
"""The archs trained by flow matching (ai-toolkit's ``noise_scheduler: flowmatch``)."""
BLOCK_LISTS = {"zimage": "layers"}
"""The archs whose ``get_transformer_block_names`` (the blocks a ``transformer_only`` LoRA adapts) are not all of
the model's repeated blocks: Z-Image's 30 ``layers``, not its two noise and two context refiner blocks."""
BUCKETS = {"zimage": 32, "wan22_5b": 32}
"""A bucket side's divisor where it is not 16 (``get_bucket_divisibility``: Z-Image's VAE 16 x its 2x2 patches;
Wan 2.2 TI2V 5B's, 16x too)."""
OPTIMIZERS = {"adamw8bit": "adamw8bit", "adamw8": "adamw8bit", "adam8bit": "adamw8bit", "adamw": "adamw",
              "adam": "adamw", "adafactor": "adafactor", "prodigy": "prodigy", "lion8bit": "lion8bit"}
"""ai-toolkit's optimizer names memfit runs (Adam's states weigh AdamW's; any name starting ``prodigy`` but
``prodigy8bit`` is prodigyopt's Prodigy there, as ``get_optimizer`` reads it)."""
PRECISIONS = {"bf16": "bf16-base-noautocast", "bfloat16": "bf16-base-noautocast", "fp16": "fp16-base-noautocast",
              "float16": "fp16-base-noautocast", "half": "fp16-base-noautocast", "fp32": "fp32", "float32": "fp32",
              "float": "fp32", "single": "fp32"}
"""ai-toolkit's ``get_torch_dtype`` names, as memfit's precision of its LoRA: fp32 over a 16-bit model, no autocast
(NOTE [ ai-toolkit's LoRA: no autocast ])."""
FULL_PRECISIONS = {"bf16-base-noautocast": "bf16-pure", "fp16-base-noautocast": "fp16", "fp32": "fp32"}
"""The same names for a full fine-tuning (the whole model trains in ``train.dtype``)."""
ONE_BYTE = ("qfloat8", "qint8", "qfloat8_e4m3fn", "qfloat8_e5m2", "float8", "int8")
"""Weight types of one byte a weight (optimum-quanto's and torchao's; memfit's fp8 base weights weigh the same)."""


def is_ai_toolkit(data: object) -> bool:
    """An ai-toolkit job config (``config: process: [...]``), not an axolotl one."""
    return isinstance(data, dict) and isinstance(data.get("config"), dict) and "process" in data["config"]


def map_config(data: dict, where: str, device: Device, workload: str | None = None) -> TrainingConfig:
    """An ai-toolkit job's training process (see the module docstring) as memfit's workload, sizes and plan;
    ``workload``: the model named beside it, in place of its ``name_or_path`` (a local copy, a tiny test model)."""
    del device  # (ai-toolkit's dtype is explicit)
    process = _process(data, where)
    model, train, network = (_section(process, k, where) for k in ("model", "train", "network"))
    warnings: list[str] = []
    datasets = process.get("datasets") or []
    if not isinstance(datasets, list):
        raise UserError(f"--from {where}: datasets must be a list of datasets, got {type(datasets).__name__}")
    arch, named = _workload(model, where)
    workload = workload or named
    full = not process.get("network")  # (no network: the whole transformer trains)
    text = _text_encoders(arch, model, train, datasets, where, warnings)
    fields = {} if full else _network(arch, network, where, warnings)
    if full and model.get("quantize"):
        warnings.append(f"ai-toolkit config {where}: quantize with no network: the trained weights stay in train.dtype "
                        "(memfit quantizes none)")
    elif model.get("quantize") and arch not in QUANTIZED:
        warnings.append(f"ai-toolkit config {where}: quantize: ai-toolkit quantizes no {arch} UNet; its weights stay in "
                        "train.dtype, as memfit's")
    elif not full:
        fields.update(_quantized(model, where, warnings))
    for key in ("diff_output_preservation", "blank_prompt_preservation"):
        if train.get(key):
            warnings.append(f"ai-toolkit config {where}: {key} runs a second forward and backward on the batch, keeping "
                            "both graphs: not in the estimate (about twice its activations)")
    if text != "cached" and "text_encoders=" not in workload:  # (a workload named beside it keeps its own)
        if arch not in HOLD_TEXT:
            warnings.append(f"ai-toolkit config {where}: the text encoders run in the step (no cache_text_embeddings); "
                            f"memfit holds them for SD, SDXL, FLUX.1, SD3, Lumina 2, Z-Image and HiDream-I1 only, so {arch}'s are not in the "
                            "estimate")
        else:
            workload = with_override(workload, "text_encoders", text)
    if arch in WANS and "frames=" not in workload:
        workload = with_override(workload, "frames", clip_frames(model, _frames(datasets, where, warnings), where,
                                                                  warnings))
    if arch in EDITS and any(isinstance(d, dict) and d.get("control_path") for d in datasets):
        workload = reference_image(arch, workload, model, datasets, where, warnings)
    if arch == "hidream":
        both = bool(fields.get("base_weights")) and bool(model.get("quantize_te", model.get("quantize")))
        workload = hidream(workload, text, both, where, warnings)
    if arch in EXPERTS and "experts=" not in workload:  # (a folder too: NOTE [ A Wan 2.2 pipeline's two experts ])
        workload = experts(workload, model, train, where, warnings)
    dtype = str(train.get("dtype", "fp32")).lower()
    if dtype not in PRECISIONS:
        raise UserError(f"--from {where}: train.dtype {dtype!r} is not one memfit runs; use bf16, fp16 or fp32")
    precision = fields["precision"] = FULL_PRECISIONS[PRECISIONS[dtype]] if full else PRECISIONS[dtype]
    if precision == "fp16":  # (a full fine-tuning in ai-toolkit's fp16)
        warnings.append(f"ai-toolkit config {where}: train.dtype {dtype} with no network trains the model in fp16; memfit's "
                        "fp16 keeps fp32 weights under autocast (a bound)")
    if full and fields.get("ema") and precision == "bf16-pure":
        warnings.append(f"ai-toolkit config {where}: ai-toolkit's EMA of a bf16 model is bf16; memfit's is fp32 (a bound: "
                        "2 bytes a weight high)")
    if train.get("gradient_checkpointing", True):
        fields["checkpointing"] = "blocks"
    name = str(train.get("optimizer", "adamw")).lower()
    name = "prodigy" if name.startswith("prodigy") and not name.startswith("prodigy8bit") else name
    if name not in OPTIMIZERS:
        raise UserError(f"--from {where}: train.optimizer {name!r} is not one memfit runs; use adamw8bit, adamw, "
                        "adafactor, prodigy or lion8bit")
    fields["optimizer"] = OPTIMIZERS[name]
    fields.update(_ema(train.get("ema_config"), where))
    norm = train.get("max_grad_norm", 1.0)  # (ai-toolkit clips none with adafactor)
    fields["max_grad_norm"] = float(norm) if isinstance(norm, (int, float)) and not isinstance(norm, bool) and norm \
        and name != "adafactor" else None
    sets = [whole(d, "batch_size", where, 1) for d in datasets if isinstance(d, dict) and "batch_size" in d]
    micro = max(sets) if sets else whole(train, "batch_size", where, 1)  # (a dataset's own batch size wins)
    steps, accum = (whole(train, k, where, 1) for k in ("gradient_accumulation_steps", "gradient_accumulation"))
    if steps > 1 and accum > 1:
        raise UserError(f"--from {where}: gradient_accumulation and gradient_accumulation_steps are both set (ai-toolkit "
                        "refuses them together); keep one")
    accum = max(steps, accum)
    if accum > 1:
        fields["micro_batch_size"] = micro
    if (model.get("layer_offloading") or model.get("auto_memory")) and arch in EXPERTS:
        warnings.append(f"ai-toolkit config {where}: layer_offloading streams a share of each Wan 2.2 expert's layers; "
                        "not mapped for two experts: memfit keeps every layer of the running expert on the device")
    elif (model.get("layer_offloading") or model.get("auto_memory")) and arch in LAYER_OFFLOADED:
        fields.update(_layer_offloading(model, workload, where, warnings))
    elif model.get("layer_offloading") or model.get("auto_memory"):
        warnings.append(f"ai-toolkit config {where}: layer_offloading: ai-toolkit offloads no {arch} layers (it manages "
                        "Qwen-Image's, FLUX.2's, Wan's and Z-Image's); ignored, as there")
    resolution = _resolution(datasets, where, warnings, BUCKETS.get(arch, 16))
    if model.get("assistant_lora_path"):
        warnings.append(f"ai-toolkit config {where}: assistant_lora_path: the training adapter is merged into the "
                        "weights and its LoRA kept on the device, inactive, in train.dtype: not in the estimate (its "
                        "rank's matrices, tens of MB)")
    try:
        plan = Plan(**fields)
    except UserError as e:
        raise UserError(f"--from {where}: {str(e).removeprefix('plan: ')}") from None
    return TrainingConfig(where, workload, micro * accum, micro, None, plan, tuple(warnings), resolution)


def _process(data: dict, where: str) -> dict:
    processes = data["config"]["process"]
    found = [p for p in processes or [] if isinstance(p, dict) and "train" in p and "model" in p] \
        if isinstance(processes, list) else []
    if not found:
        raise UserError(f"--from {where}: config.process holds no training process (one with model: and train:); "
                        "give an ai-toolkit training config")
    return found[0]


def _section(process: dict, key: str, where: str) -> dict:
    value = process.get(key) or {}
    if not isinstance(value, dict):
        raise UserError(f"--from {where}: {key} must be a mapping of fields, got {type(value).__name__}")
    return value


def _workload(model: dict, where: str) -> tuple[str, str]:
    """(ai-toolkit's arch, the workload): a published id's built-in, another id or folder as given."""
    arch = str(model.get("arch") or next((a for k, a in OLD_FLAGS.items() if model.get(k)), "sd1")).split(":")[0]
    arch = ALIASES.get(arch, arch)
    name = str(model.get("name_or_path") or "").strip()
    if arch in OWN_MODELS:
        raise UserError(f"--from {where}: memfit does not read ai-toolkit's {arch} configs: {OWN_MODELS[arch]}")
    if arch not in ARCHS:
        raise UserError(f"--from {where}: memfit reads ai-toolkit's {', '.join(ARCHS)} configs, not arch {arch!r}; "
                        f"name the model as the workload: memfit estimate {name or 'ORG/NAME'}")
    if not name:
        raise UserError(f"--from {where}: model.name_or_path is not set; the config names the model it trains")
    return arch, ARCHS[arch].get(name, name)


def _text_encoders(arch: str, model: dict, train: dict, datasets: list, where: str, warnings: list[str]) -> str:
    """The text encoders' mode (see the table); their quantization where it is not the transformer's, said."""
    if train.get("train_text_encoder") and arch == "lumina2":  # (its LoRA adapts CLIP's modules, none of Gemma-2's)
        warnings.append(f"ai-toolkit config {where}: train_text_encoder: ai-toolkit's LoRA adapts no Gemma-2 module; "
                        "read as Gemma-2 frozen in the step")
    elif train.get("train_text_encoder") and arch == "zimage":  # (ZImageModel.get_te_has_grad: False)
        warnings.append(f"ai-toolkit config {where}: train_text_encoder: ai-toolkit trains no Qwen3 of Z-Image; read "
                        "as Qwen3 frozen in the step")
    elif train.get("train_text_encoder"):
        return "trained"
    if train.get("cache_text_embeddings") or train.get("unload_text_encoder") or any(
            isinstance(d, dict) and d.get("cache_text_embeddings") for d in datasets):
        return "cached"
    differs = bool(model.get("quantize_te", model.get("quantize"))) != bool(model.get("quantize"))
    if arch in HOLD_TEXT and arch != "sd3" and differs:  # (SD3's T5 is quantized with quantize alone)
        warnings.append(f"ai-toolkit config {where}: quantize_te differs from quantize; memfit stores the text encoders' "
                        "linear weights as the transformer's (fp8 base weights or 16 bits)" +
                        (": T5-XXL's 4.4 GB off" if arch in ("flux", "flux_kontext", "sd3") else ""))
    return "frozen"


def _network(arch: str, network: dict, where: str, warnings: list[str]) -> dict:
    kind = str(network.get("type", "lora")).lower()
    if kind not in ("lora", "lokr"):
        raise UserError(f"--from {where}: network type {kind!r} is not one memfit runs; memfit models LoRA and LoKr "
                        "(type: lora, lokr)")
    key = "rank" if network.get("rank") is not None else "linear"  # (ai-toolkit: rank wins; both default to 4)
    rank = whole(network, key, f"{where}: network", 4)
    alpha = network.get("linear_alpha", network.get("alpha", 1.0))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise UserError(f"--from {where}: network.linear_alpha must be a number > 0, got {alpha!r}")
    if network.get("conv"):
        warnings.append(f"ai-toolkit config {where}: network.conv is not mapped " + (
            "(a LoRA of the UNet's convolutions); memfit adapts its linear layers" if arch in UNETS else
            f"({arch}'s transformer blocks hold no convolution)"))
    kwargs = network.get("network_kwargs") or {}
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    names = {}  # (ai-toolkit's names: diffusers', under transformer.; ignore_if_contains wins: skip= and only=)
    for key, option in (("ignore_if_contains", "skip"), ("only_if_contains", "only")):
        parts = kwargs.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(x, str) and x and not set(x) & set("+,") for x in parts):
            raise UserError(f"--from {where}: network_kwargs.{key} must be a list of parts of layer names, got "
                            f"{parts!r}")
        names[option] = f",{option}={'+'.join(parts)}" if parts else ""
    # (transformer_only, ai-toolkit's default: a DiT's LoRA on its transformer blocks alone; a UNet's on all)
    blocks_only = arch not in UNETS and network.get("transformer_only", True) is not False
    blocks = "in-blocks" + (f":{BLOCK_LISTS[arch]}" if arch in BLOCK_LISTS else "")
    layers = f"targets={blocks if blocks_only else 'all-linear'}{names['skip']}{names['only']}"
    if kind == "lokr":  # (ai-toolkit's own LoKr: full rank unless told, its linear layers' factored forward)
        full = network.get("lokr_full_rank", True) is not False
        factor = network.get("lokr_factor", -1)
        if not is_factor(factor):
            raise UserError(f"--from {where}: network.lokr_factor must be -1 or a whole number >= 1, got {factor!r}")
        return {"adapter": f"lokr:r={'full' if full else rank}{'' if full else f',alpha={alpha}'},{layers},"
                           f"factor={factor},factored=1"}
    return {"adapter": f"lora:r={rank},alpha={alpha},{layers}"}


def _quantized(model: dict, where: str, warnings: list[str]) -> dict:
    if not model.get("quantize"):
        return {}
    qtype, bits = _qtype(model)
    if "|" in str(model.get("qtype", "")):
        warnings.append(f"ai-toolkit config {where}: qtype's accuracy-recovery adapter is held on the device in "
                        "train.dtype: not in the estimate")
    if qtype in ONE_BYTE:
        return {"base_weights": "fp8"}
    if qtype == "uint8":  # (ai-toolkit's uintx path quantizes 1-7 bits; at 8 it leaves the weights as they are)
        warnings.append(f"ai-toolkit config {where}: qtype uint8: ai-toolkit leaves those weights unquantized, in "
                        "train.dtype, as memfit does")
        return {}
    if bits is not None and bits <= 4:  # (torchao's uint1-uint4 and int4, quanto's qint4: as nf4, half a byte)
        if bits < 4:
            warnings.append(f"ai-toolkit config {where}: qtype {qtype} stores {bits} bits a weight; memfit stores the "
                            "quantized weights in 4 (nf4: a bound)")
        return {"base_weights": "nf4"}
    warnings.append(f"ai-toolkit config {where}: qtype {qtype} is not one byte a weight; memfit stores the "
                    "quantized weights in fp8 (one byte)")
    return {"base_weights": "fp8"}


def _qtype(model: dict) -> tuple[str, int | None]:
    """The transformer's quantized type (``uint3|repo/adapter``: ``uint3``) and its bits where an integer type's."""
    qtype = str(model.get("qtype", "qfloat8")).lower().split("|", 1)[0]
    return qtype, int(qtype[-1]) if qtype[-1:].isdigit() and qtype.rstrip("0123456789").endswith("int") else None


def _ema(config: object, where: str) -> dict:
    """``ema_config`` as memfit's EMA of the LoRA on the device; none unless ``use_ema``."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UserError(f"--from {where}: train.ema_config must be a mapping (use_ema: true, ema_decay: 0.99), got "
                        f"{config!r}")
    if not config.get("use_ema"):
        return {}
    decay = config.get("ema_decay", 0.999)
    if isinstance(decay, bool) or not isinstance(decay, (int, float)):
        raise UserError(f"--from {where}: train.ema_config.ema_decay must be a number below 1, got {decay!r}")
    return {"ema": {"decay": float(decay), "device": "device"}}


def _resolution(datasets: list, where: str, warnings: list[str], divisor: int = 16) -> int | None:
    """The largest bucket's side (ai-toolkit caps a bucket's area at the side squared, its sides a multiple of
    ``divisor``); uncached latents said."""
    sides: list[int] = []
    for d in datasets:
        if not isinstance(d, dict):
            continue
        value = d.get("resolution", 512)
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise UserError(f"--from {where}: datasets resolution must be a side in pixels or a list of them, got "
                            f"{value!r}")
        sides += [v // divisor * divisor for v in values]  # (a square bucket's side: ai-toolkit's divide by 16 or 32)
        if not (d.get("cache_latents") or d.get("cache_latents_to_disk")):
            warnings.append(f"ai-toolkit config {where}: latents are not cached (cache_latents_to_disk); memfit's batch "
                            "is the cached latents, so the VAE in the step is not in the estimate")
    return max(sides) if sides else None


def _layer_offloading(model: dict, workload: str, where: str, warnings: list[str]) -> dict:
    """``layer_offloading``: ai-toolkit keeps a share of the transformer's linear layers (its
    ``layer_offloading_transformer_percent``, each layer drawn at random) on the host and copies each to the device
    for its forward and backward. memfit's nearest is the same share of the denoiser's blocks swapped (the last
    ones, streamed a block at a time: about the same bytes on the host, one block's more on the device); said."""
    share = model.get("layer_offloading_transformer_percent", 1.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise UserError(f"--from {where}: layer_offloading_transformer_percent must be a share from 0 to 1, got {share!r}")
    from memfit.planner.space import model_facts
    from memfit.planner.stacks import tail_blocks
    from memfit.workloads import load_workload
    try:
        blocks = tail_blocks(model_facts(load_workload(workload)).model)
    except UserError:
        blocks = None
    bits = _qtype(model)[1] if model.get("quantize") else None
    if blocks is None or bits is not None and bits <= 4:
        warnings.append(f"ai-toolkit config {where}: layer_offloading is not mapped (" + (
            "memfit streams no 4-bit layers" if blocks else "the model's blocks cannot be read here") +
            "); memfit keeps every layer on the device")
        return {}
    swapped = round(share * blocks)
    warnings.append(f"ai-toolkit config {where}: layer_offloading streams {share:.0%} of the transformer's linear layers "
                    f"from the host, drawn at random; memfit swaps its last {swapped} of {blocks} blocks (swap_blocks: "
                    "about the same bytes)" + ("; the text encoders' share is not mapped" if model.get(
                        "layer_offloading_text_encoder_percent", 1.0) else ""))
    return {"swap_blocks": swapped} if swapped else {}


def _frames(datasets: list, where: str, warnings: list[str]) -> int:
    """A Wan clip's frames: the datasets' largest ``num_frames`` (ai-toolkit's default 1: images), down to 4k + 1
    (Wan's VAE encodes the first frame alone, then groups of 4)."""
    asked = max([d.get("num_frames", 1) for d in datasets if isinstance(d, dict)] or [1])
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise UserError(f"--from {where}: datasets num_frames must be a whole number >= 1, got {asked!r}")
    frames = (asked - 1) // 4 * 4 + 1
    if frames != asked:
        warnings.append(f"ai-toolkit config {where}: num_frames {asked} is not 4k + 1 frames; memfit's clip holds "
                        f"{frames} (Wan's VAE encodes the first frame, then groups of 4)")
    return frames
