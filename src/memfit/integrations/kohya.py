"""A kohya-ss sd-scripts config (TOML, what ``--config_file`` reads) read as the workload and the plan it
trains: ``memfit estimate --from config.toml`` (and ``plan``). As sd-scripts does, the file's sections are
merged into one set of arguments; a ``dataset_config`` it names is read for the images' size and batch.

| sd-scripts argument | memfit |
|---|---|
| ``pretrained_model_name_or_path`` | the workload where it is a diffusers repository (a hub id or a folder); a checkpoint file: the built-in its other files name (``gemma2``: ``dit-lumina2``; ``clip_g``: ``dit-sd3``; ``ae``: ``dit-flux``), or the workload named beside ``--from`` |
| ``network_module`` ``networks.lora*``; none | ``adapter: lora:r=network_dim,alpha=network_alpha,targets=all-linear`` (sd-scripts' defaults 4 and 1); none: full fine-tuning |
| ``resolution`` (``"1024"`` or ``"1216,832"``: width, height) | the image's size (``--resolution 1216x832``) |
| ``train_batch_size`` x ``gradient_accumulation_steps`` | the global batch, split into micro-batches of ``train_batch_size`` |
| ``dataset_config``'s ``resolution`` and ``batch_size`` | the same, over the training config's (the dataset with the largest batch of pixels) |
| ``mixed_precision``, ``full_bf16``, ``full_fp16`` | full fine-tuning: ``bf16``/``fp16`` autocast, ``bf16-pure``; LoRA (its frozen base cast to 16 bits, or to fp8 with ``fp8_base``; the network in fp32): ``bf16-base`` / ``fp16-base`` (over an fp8 base memfit keeps the weights of no linear layer in 16 bits: norms and biases, a few MB); ``full_bf16``: ``bf16-pure``; ``full_fp16`` a bound (memfit trains no fp16 weights), said |
| ``fp8_base``, ``fp8_base_unet`` | ``base_weights: fp8`` (memfit's carries a scale per row; sd-scripts' is a plain cast) |
| ``blocks_to_swap`` (``split_mode``: 18) | ``swap_blocks``; of FLUX, about the same bytes (sd-scripts swaps N/2 double-stream blocks and N single-stream ones; memfit its last blocks, the singles first: 18 is 39) |
| ``gradient_checkpointing``; ``cpu_offload_checkpointing`` | ``checkpointing: blocks``; with ``offload: activations`` (each checkpointed block's input in host memory; FLUX and SD3) |
| ``sdpa``, ``xformers``, ``mem_eff_attn`` (SD, SDXL) | fused attention; none of them: ``attention: math`` (sd-scripts' UNet then holds the whole score matrix) |
| ``optimizer_type`` (``use_8bit_adam``) | ``AdamW``: ``adamw``; ``AdamW8bit``: ``adamw8bit``; ``PagedAdamW8bit``: ``adamw8bit-paged``; ``PagedAdamW``, ``PagedAdamW32bit``: ``adamw-paged``; ``Adafactor``: ``adafactor``; ``SGDNesterov``: ``sgd``; ``Prodigy``: ``prodigy`` (``slice_p=N`` in ``optimizer_args``: ``prodigy:slice_p=N``); ``Lion8bit``: ``lion8bit`` |
| ``fused_backward_pass`` (full fine-tuning, Adafactor) | ``optimizer_in_backward`` (sd-scripts clips each gradient alone there: no global norm) |
| ``max_grad_norm`` (sd-scripts' default 1.0; 0: none) | ``max_grad_norm`` |

What the estimate ignores, and how it says so:

- **Refused, one line**: ``deepspeed`` (memfit shards with FSDP2: ``--world-size``), a ``network_module``
  other than LoRA (LyCORIS, OFT, DyLoRA), ``network_train_text_encoder_only``, an optimizer memfit does
  not run (Lion in 32 bits, D-Adaptation, ...), a checkpoint file whose model the config does not name
  (or a ``model_type`` other than FLUX's), and what sd-scripts itself refuses (offloaded checkpointing of
  an SD or SDXL UNet, or beside ``blocks_to_swap``; ``fused_backward_pass`` but with Adafactor and no
  accumulation; ``use_8bit_adam`` beside ``optimizer_type``).
- **Text encoders in the step**: trained (a LoRA without ``network_train_unet_only``, a full fine-tuning with
  ``train_text_encoder``), or run frozen (their outputs not cached): the SD, SDXL, FLUX.1, SD3 and Lumina 2
  workloads hold them (``unet-sdxl:text_encoders=trained|frozen``; FLUX.1's and SD3's CLIPs train and their
  T5-XXL is cached or frozen; Lumina's Gemma-2 trains as ``train_gemma2``: memfit.integrations.kohya_text).
- **Warned, one line each**: the precision where memfit's nearest differs (above); latents not cached, or
  text-encoder outputs of a model that does not hold its encoders (memfit's batch is the cached tensors: the
  VAE or text encoders running in the step are not in the estimate); text encoders trained where the model
  does not hold them; FLUX's swapped blocks
  as memfit counts them; ``network_args`` but FLUX's block selection (``train_blocks``, ``train_double_block_indices``,
  ``train_single_block_indices``: the adapter's ``only=``, :func:`flux_blocks`); ``fused_backward_pass`` in a LoRA config (sd-scripts ignores it);
  any other argument set.
- **Ignored in silence**: the run around the step (data, captions, buckets, schedule, sampling, saving,
  logging, the other models' files: :data:`NO_MEMORY_EFFECT`), and ``network_dropout`` (sd-scripts drops
  the rank-r output: a mask of r values a row).

kohya's LoRA adapts each linear layer of the denoiser's transformer blocks (FLUX's modulations too);
memfit's ``all-linear`` also adapts the few outside them (embedders, the final layer): a few MB of
parameters and inputs, once a step.
"""

from __future__ import annotations

from pathlib import Path

from memfit.devices import Device
from memfit.errors import UserError
from memfit.integrations.configs import TrainingConfig, read_toml, whole
from memfit.integrations.kohya_blocks import FLUX_DOUBLE, FLUX_SINGLE, flux_blocks, network_args
from memfit.integrations.kohya_text import caption, holder, text_encoders, text_states_cached
from memfit.plans import Plan

REFUSED = {
    "deepspeed": "memfit does not model DeepSpeed's ZeRO stages; remove deepspeed (memfit shards with FSDP2: give "
                 "--world-size N)",
    "network_train_text_encoder_only": "memfit estimates the denoiser's training; remove "
                                       "network_train_text_encoder_only",
}
"""Arguments whose meaning memfit cannot carry, and the fix."""

NO_MEMORY_EFFECT = frozenset("""
pretrained_model_name_or_path ae clip_l clip_g t5xxl vae gemma2 tokenizer_cache_dir no_half_vae
disable_mmap_load_safetensors weighting_scheme logit_mean logit_std mode_scale train_data_dir reg_data_dir in_json
dataset_config dataset_repeats enable_bucket min_bucket_reso max_bucket_reso bucket_reso_steps bucket_no_upscale
shuffle_caption caption_extension caption_extention keep_tokens keep_tokens_separator color_aug flip_aug
face_crop_aug_range random_crop caption_dropout_rate caption_dropout_every_n_epochs caption_tag_dropout_rate
token_warmup_min token_warmup_step prior_loss_weight max_data_loader_n_workers persistent_data_loader_workers
vae_batch_size skip_cache_check alpha_mask cache_latents cache_latents_to_disk cache_text_encoder_outputs
cache_text_encoder_outputs_to_disk output_dir output_name save_model_as save_precision save_every_n_epochs
save_every_n_steps save_last_n_epochs save_last_n_steps save_state save_state_on_train_end save_n_epoch_ratio
resume logging_dir log_with log_prefix log_tracker_name log_config wandb_api_key wandb_run_name seed
max_train_steps max_train_epochs learning_rate unet_lr text_encoder_lr lr_scheduler lr_warmup_steps
lr_scheduler_num_cycles lr_scheduler_power lr_scheduler_args lr_scheduler_type optimizer_args sample_prompts
sample_every_n_steps sample_every_n_epochs sample_sampler sample_at_first training_comment no_metadata
network_weights dim_from_weights scale_weight_norms huggingface_repo_id huggingface_repo_type
huggingface_path_in_repo huggingface_token huggingface_repo_visibility save_state_to_huggingface
resume_from_huggingface async_upload ddp_timeout ddp_gradient_as_bucket_view ddp_static_graph full_path
mem_eff_save guidance_scale timestep_sampling discrete_flow_shift model_prediction_type sigmoid_scale loss_type
huber_c huber_schedule noise_offset noise_offset_random_strength adaptive_noise_scale multires_noise_iterations
multires_noise_discount ip_noise_gamma ip_noise_gamma_random_strength min_snr_gamma debiased_estimation_loss
scale_v_pred_loss_like_noise_pred v_pred_like_loss zero_terminal_snr v2 v_parameterization clip_skip
max_token_length apply_t5_attn_mask sdpa xformers mem_eff_attn attn_mode split_attn highvram lowram lowvram
split_mode model_type train_text_encoder t5xxl_max_token_length
network_train_unet_only cpu_offload_checkpointing network_module network_dim network_alpha network_dropout
resolution train_batch_size gradient_accumulation_steps mixed_precision full_bf16 full_fp16 fp8_base fp8_base_unet
blocks_to_swap gradient_checkpointing optimizer_type use_8bit_adam fused_backward_pass max_grad_norm network_args
use_t5xxl_cache_only train_t5xxl
metadata_title metadata_author metadata_description metadata_license metadata_tags console_log_level
console_log_file console_log_simple wandb_run_id
""".split())
"""Arguments of the run around the step, and those mapped above (no warning)."""

OPTIMIZERS = {"adamw": "adamw", "adamw8bit": "adamw8bit", "pagedadamw8bit": "adamw8bit-paged",
              "pagedadamw": "adamw-paged", "pagedadamw32bit": "adamw-paged", "adafactor": "adafactor",
              "sgdnesterov": "sgd", "prodigy": "prodigy", "lion8bit": "lion8bit"}
"""sd-scripts' ``optimizer_type`` (it compares them lower-cased) and memfit's optimizer."""

CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".sft")
BY_FILES = (("gemma2", "dit-lumina2"), ("clip_g", "dit-sd3"), ("ae", "dit-flux"))
"""A checkpoint file's model, by the other model files its script takes (lumina_train_network.py's
``gemma2``, beside its ``ae``; sd3_train_network.py's ``clip_g``; flux_train_network.py's ``ae``)."""


def read_config(path: str | Path, device: Device, workload: str | None = None) -> TrainingConfig:
    """The sd-scripts config at ``path`` (see the module docstring); ``workload``: the model named beside it."""
    p = Path(path)
    data = read_toml(p, f"--from {path}", "a kohya-ss sd-scripts config (.toml)")
    return map_config(data, str(path), device, workload, base=p.parent)


def map_config(data: dict, where: str, device: Device, workload: str | None = None,
               base: Path | None = None) -> TrainingConfig:
    """sd-scripts arguments (a parsed TOML mapping; sections merged as sd-scripts merges them) as memfit's
    workload, sizes and plan; ``base``: the folder a relative ``dataset_config`` may be in."""
    del device  # (sd-scripts' precision is explicit: no "auto" to decide on the card)
    flat: dict = {}
    for key, value in data.items():  # (sd-scripts: a section's keys are arguments as top-level keys are)
        flat.update(value if isinstance(value, dict) else {key: value})
    data = {k: v for k, v in flat.items() if v not in (None, "", [], {})}
    for key, fix in REFUSED.items():
        if data.get(key) not in (None, False):
            raise UserError(f"--from {where}: {key}: {fix}")
    warnings = [f"kohya config {where}: {key} is not mapped; the estimate ignores it"
                for key in data if key not in NO_MEMORY_EFFECT and key not in REFUSED]
    model = workload or _model(data, where)
    family = family_of(model, data)
    held = holder(model)  # (a folder's or hub id's class is read once)
    model, text = text_encoders(model, data, where, warnings, held)
    model = caption(model, data, where, warnings, held)
    micro, resolution, more = _dataset(data, where, base)
    warnings += more
    accum = whole(data, "gradient_accumulation_steps", where, 1)
    fields = {**_method(data, where, warnings), **_precision(data, where, warnings), **_optimizer(data, where)}
    fields.update(_memory(data, where, family, accum, warnings))
    if family == "unet" and not any(data.get(k) for k in ("sdpa", "xformers", "mem_eff_attn")):
        fields["attention"] = "math"  # (sd-scripts' SD/SDXL UNet without them: the whole score matrix)
    norm = data.get("max_grad_norm", 1.0)  # (sd-scripts clips at 1.0 unless told 0)
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or norm < 0:
        raise UserError(f"--from {where}: max_grad_norm must be a number >= 0 (0: no clipping), got {norm!r}")
    fields.setdefault("max_grad_norm", float(norm) if norm else None)
    if accum > 1:
        fields["micro_batch_size"] = micro
    text_states_cached(data, where, warnings, text)
    try:
        plan = Plan(**fields)
    except UserError as e:
        raise UserError(f"--from {where}: {str(e).removeprefix('plan: ')}") from None
    return TrainingConfig(where, model, micro * accum, micro, None, plan, tuple(warnings), resolution)


FAMILIES = {"FluxTransformer2DModel": "flux", "SD3Transformer2DModel": "sd3", "Lumina2Transformer2DModel": "lumina",
            "UNet2DConditionModel": "unet"}
"""The diffusers classes of the models sd-scripts trains, and its code for each (FLUX.1, SD3, Lumina 2, SD/SDXL)."""


def family_of(model: str, data: dict, model_class: str | None = None) -> str | None:
    """Which of sd-scripts' model code trains ``model``: ``flux``, ``lumina``, ``sd3``, ``unet`` (SD, SDXL), or
    None (none of them, or unknown): by its diffusers class where known, else by the files beside a checkpoint
    and the words of its name."""
    if model_class is not None:
        return FAMILIES.get(model_class)
    name = model.lower()
    for family, files, words in (("lumina", "gemma2", ("lumina",)), ("sd3", "clip_g", ("sd3", "stable-diffusion-3")),
                                 ("flux", "ae", ("dit-flux:", "flux.1", "flux1"))):
        if data.get(files) or any(w in name for w in words) or (family == "flux" and name == "dit-flux"):
            return family
    unets = ("unet-", "stable-diffusion", "sdxl", "sd_xl", "sd15", "v1-5")
    return "unet" if any(w in name for w in unets) else None


def _memory(data: dict, where: str, family: str, accum: int, warnings: list[str]) -> dict:
    """Checkpointing, its offload, swapped blocks and the fused backward pass, as sd-scripts runs them."""
    fields: dict = {}
    split = data.get("split_mode") and family == "flux" and "blocks_to_swap" not in data  # (split_mode: 18)
    swap = data.get("blocks_to_swap") or (18 if split else 0)
    offload = data.get("cpu_offload_checkpointing")
    if swap and family == "unet":
        warnings.append(f"kohya config {where}: blocks_to_swap: sd-scripts' SD and SDXL scripts take none (their "
                        "arguments ignore it); ignored")
        swap = 0
    if offload and family == "unet":
        raise UserError(f"--from {where}: cpu_offload_checkpointing: sd-scripts' SD and SDXL UNets take no offloaded "
                        "checkpointing (their forward fails); remove it")
    if offload and swap and family in ("flux", "sd3"):
        raise UserError(f"--from {where}: cpu_offload_checkpointing and blocks_to_swap: sd-scripts refuses the two "
                        "together; keep one")
    if offload and not data.get("gradient_checkpointing") and not data.get("network_module"):
        data = {**data, "gradient_checkpointing": True}  # (sd-scripts' full fine-tuning turns it on for the offload)
    elif offload and not data.get("gradient_checkpointing"):
        warnings.append(f"kohya config {where}: cpu_offload_checkpointing without gradient_checkpointing does nothing "
                        "in sd-scripts' LoRA training; ignored")
    if data.get("gradient_checkpointing"):
        fields["checkpointing"] = "blocks"
        if offload and family == "lumina":
            warnings.append(f"kohya config {where}: cpu_offload_checkpointing does nothing in sd-scripts' Lumina; "
                            "ignored")
        elif offload:
            fields["offload"] = ["activations"]
    if swap:
        swap = whole({"blocks_to_swap": swap}, "blocks_to_swap", where, None)
        fields["swap_blocks"] = _swapped(swap, where, warnings) if family == "flux" else swap
    if data.get("fused_backward_pass"):
        if data.get("network_module"):
            warnings.append(f"kohya config {where}: fused_backward_pass does nothing in sd-scripts' LoRA training; "
                            "ignored")
        elif str(data.get("optimizer_type", "")).lower() != "adafactor" or accum > 1:
            raise UserError(f"--from {where}: fused_backward_pass: sd-scripts takes it with optimizer_type Adafactor "
                            "and gradient_accumulation_steps 1 only")
        else:  # (sd-scripts clips each gradient alone, in its hook: no global norm to hold)
            fields.update(optimizer_in_backward=True, max_grad_norm=None)
    return fields


LORA_MODULES = ("networks.lora", "networks.lora_flux", "networks.lora_sd3", "networks.lora_lumina")
"""sd-scripts' LoRA training modules (lora_fa freezes A; lora_interrogator and lora_diffusers train nothing)."""
FLUX_MOST_SWAPPED = max(n for n in range(FLUX_DOUBLE + FLUX_SINGLE)
                        if n // 2 <= FLUX_DOUBLE - 2 and (n - n // 2) * 2 <= FLUX_SINGLE - 2)
"""sd-scripts' most ``blocks_to_swap`` of FLUX (35: 17 double-stream and 36 single-stream blocks; it keeps two of each)."""
FLUX_DOUBLE_WEIGHS = 339_831_296 / 141_591_808
"""A FLUX.1 double-stream block's parameters over a single-stream block's (2.4)."""


def flux_swap(n: int) -> int:
    """sd-scripts' ``blocks_to_swap`` of FLUX as memfit's ``swap_blocks`` (the last N of the model's blocks):
    sd-scripts swaps ``n // 2`` double-stream blocks and ``(n - n // 2) * 2`` single-stream ones
    (``flux_models.Flux.enable_block_swap``); memfit swaps its last blocks, the singles first, of the nearest
    bytes (within half a double block)."""
    weight = n // 2 * FLUX_DOUBLE_WEIGHS + (n - n // 2) * 2  # (in single blocks)
    return round(weight) if weight <= FLUX_SINGLE else FLUX_SINGLE + round((weight - FLUX_SINGLE) / FLUX_DOUBLE_WEIGHS)


def _swapped(n: int, where: str, warnings: list[str]) -> int:
    """:func:`flux_swap`, within sd-scripts' bounds, said in a warning line."""
    doubles, singles = n // 2, (n - n // 2) * 2
    if doubles > FLUX_DOUBLE - 2 or singles > FLUX_SINGLE - 2:
        raise UserError(f"--from {where}: blocks_to_swap {n} swaps {doubles} double and {singles} single blocks of "
                        f"FLUX; sd-scripts swaps at most {FLUX_DOUBLE - 2} and {FLUX_SINGLE - 2} (blocks_to_swap <= "
                        f"{FLUX_MOST_SWAPPED})")
    last = flux_swap(n)
    warnings.append(f"kohya config {where}: blocks_to_swap {n} swaps {doubles} double- and {singles} single-stream "
                    f"blocks of FLUX; memfit swaps about as many bytes as its last {last} blocks (swap_blocks {last})")
    return last


def _model(data: dict, where: str) -> str:
    """The workload of ``pretrained_model_name_or_path``: a diffusers repository as it is named; a checkpoint
    file by the files beside it (:data:`BY_FILES`)."""
    name = data.get("pretrained_model_name_or_path")
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"--from {where}: no pretrained_model_name_or_path; the config names the model it trains")
    name = name.strip()
    if not name.lower().endswith(CHECKPOINT_SUFFIXES):
        return name  # (a diffusers folder or hub id: memfit reads its model_index.json and config.json)
    if str(data.get("model_type", "flux")).lower() != "flux":
        raise UserError(f"--from {where}: model_type {data['model_type']!r}: memfit builds FLUX.1 from a checkpoint "
                        "file, not this model; name a diffusers repository of it as the workload")
    for key, builtin in BY_FILES:
        if data.get(key):
            return "dit-flux:guidance_embeds=false" if builtin == "dit-flux" and "schnell" in name.lower() else builtin
    raise UserError(f"--from {where}: pretrained_model_name_or_path is a checkpoint file ({Path(name).name}) whose "
                    "model the config does not say; name it beside --from: memfit estimate unet-sdxl --from "
                    f"{where} (or unet-sd15, dit-flux, dit-sd3, dit-lumina2, a diffusers folder or hub id)")


def _dataset(data: dict, where: str, base: Path | None) -> tuple[int, int | tuple[int, int] | None, list[str]]:
    """(samples a micro-batch, the image's size, warnings): the dataset config's, where it names them, over
    the training config's ``train_batch_size`` and ``resolution``."""
    batch = whole(data, "train_batch_size", where, 1)
    resolution = _resolution(data.get("resolution"), where, "resolution")
    name = data.get("dataset_config")
    if not name:
        return batch, resolution, []
    if not isinstance(name, str):
        raise UserError(f"--from {where}: dataset_config must be a path to a dataset config (.toml), got {name!r}")
    path = Path(name).expanduser()
    if not path.is_file() and base is not None and (base / path).is_file():
        path = base / path
    if not path.is_file():
        return batch, resolution, [f"kohya config {where}: dataset_config {name} not found; the training config's "
                                   "train_batch_size and resolution are used"]
    sets = read_toml(path, f"--from {where}: dataset_config {name}", "a dataset config (.toml)")
    general = sets.get("general", {}) if isinstance(sets.get("general"), dict) else {}
    found = []
    entries = sets.get("datasets") or [{}]
    if not isinstance(entries, list):
        raise UserError(f"--from {where}: dataset_config {name}: datasets must be a list of [[datasets]] tables")
    for entry in entries:
        merged = {**general, **(entry if isinstance(entry, dict) else {})}
        size = _resolution(merged.get("resolution"), f"{where}: dataset_config {name}", "resolution") or resolution
        found.append((whole(merged, "batch_size", f"{where}: dataset_config {name}", batch), size))
    pixels = [b * (s[0] * s[1] if isinstance(s, tuple) else (s or 0) ** 2) for b, s in found]
    chosen = found[pixels.index(max(pixels))]
    more = ([f"kohya config {where}: dataset_config {name} has {len(found)} datasets of different sizes; memfit "
             f"estimates the largest batch of pixels ({chosen[0]} at {_shown(chosen[1])})"]
            if len(set(found)) > 1 else [])
    return chosen[0], chosen[1], more


def _resolution(value, where: str, key: str) -> int | tuple[int, int] | None:
    """sd-scripts' ``resolution``: ``1024``, ``"1024"``, ``"1216,832"`` or ``[1216, 832]`` (width, height)."""
    if value is None:
        return None
    parts = value if isinstance(value, list) else str(value).split(",")
    try:
        sides = [int(str(p).strip()) for p in parts]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) < 1 or isinstance(value, bool):
        raise UserError(f"--from {where}: {key} must be a size in pixels or width,height (1024, or 1216,832), "
                        f"got {value!r}")
    return sides[0] if len(sides) == 1 or sides[0] == sides[1] else (sides[0], sides[1])


def _shown(size) -> str:
    return f"{size[0]}x{size[1]} px" if isinstance(size, tuple) else f"{size} px" if size else "the model's size"


def _method(data: dict, where: str, warnings: list[str]) -> dict:
    """network_module, network_dim/alpha/dropout, fp8_base -> the plan's adapter and base weights."""
    module = data.get("network_module")
    fp8 = bool(data.get("fp8_base") or data.get("fp8_base_unet"))
    if not module:
        if fp8:
            raise UserError(f"--from {where}: fp8_base without a network_module trains nothing; set network_module = "
                            "\"networks.lora\" (or the model's, e.g. networks.lora_flux)")
        return {}
    if module not in LORA_MODULES:
        lyco = ("; for LyCORIS, name the workload and its network instead (memfit estimate MODEL --adapter "
                "lycoris:algo=lokr,dim=...: its modules over LyCORIS's own choice of layers, not kohya's)"
                if str(module).startswith("lycoris") else "")
        raise UserError(f"--from {where}: network_module {module!r} is not one memfit runs; memfit models LoRA "
                        f"(networks.lora, networks.lora_flux, ...){lyco}")
    options = [f"r={whole(data, 'network_dim', where, 4)}", f"alpha={data.get('network_alpha', 1)}",
               "targets=all-linear"]  # (network_dropout: on the rank-r output in sd-scripts, a mask of r values a row)
    args = network_args(data, where)
    if module == "networks.lora_flux":
        options += flux_blocks(args, where)
    args.pop("train_t5xxl", None)  # (said with the text encoders: memfit.integrations.kohya_text)
    if args:
        warnings.append(f"kohya config {where}: network_args are not mapped ({', '.join(args)}); memfit's LoRA adapts "
                        "the denoiser's linear layers, where they may adapt more or fewer")
    return {"adapter": f"lora:{','.join(options)}", **({"base_weights": "fp8"} if fp8 else {})}


def _precision(data: dict, where: str, warnings: list[str]) -> dict:
    """sd-scripts' precision as memfit's. Its LoRA scripts cast the frozen base to the mixed precision's dtype
    and keep the LoRA weights in fp32 (``full_bf16``/``full_fp16``: in 16 bits too); its full fine-tuning keeps
    fp32 weights under autocast unless ``full_bf16``. memfit's ``bf16`` autocast holds fp32 weights, its
    ``bf16-pure`` every weight in bf16, its ``bf16-base``/``fp16-base`` the frozen model in 16 bits and the LoRA
    in fp32 (the LoRA scripts' mixed precision), and it trains no fp16 weights: the nearest is taken, and said."""
    mixed = str(data.get("mixed_precision", "no")).lower()
    if mixed not in ("no", "bf16", "fp16"):
        raise UserError(f"--from {where}: mixed_precision {data['mixed_precision']!r}: use no, fp16 or bf16")
    lora = bool(data.get("network_module"))
    if data.get("full_bf16"):
        return {"precision": "bf16-pure"}
    if mixed in ("bf16", "fp16") and lora and not data.get("full_fp16"):  # (with fp8_base the frozen model is
        return {"precision": f"{mixed}-base"}                                # fp8: memfit keeps what is not linear in 16 bits)
    if data.get("full_fp16"):
        warnings.append(f"kohya config {where}: memfit has no fp16 weights; its fp16 autocast keeps the "
                        f"{'frozen base' if lora else 'weights and gradients'} in fp32 where sd-scripts holds them in "
                        "fp16 (a bound: twice their bytes)")
        return {"precision": "fp16"}
    return {"precision": mixed} if mixed != "no" else {}


def _optimizer(data: dict, where: str) -> dict:
    name = data.get("optimizer_type")
    if name is None:
        return {"optimizer": "adamw8bit"} if data.get("use_8bit_adam") else {}
    if data.get("use_8bit_adam"):
        raise UserError(f"--from {where}: use_8bit_adam and optimizer_type are both set (sd-scripts refuses them "
                        "together); keep optimizer_type")
    if str(name).lower() not in OPTIMIZERS:
        raise UserError(f"--from {where}: optimizer_type {name!r} is not one memfit runs; use AdamW, AdamW8bit, "
                        "PagedAdamW8bit, PagedAdamW, Adafactor, SGDNesterov, Prodigy or Lion8bit")
    optimizer = OPTIMIZERS[str(name).lower()]
    args = data.get("optimizer_args") or []
    sliced = [a for a in (args if isinstance(args, list) else [args]) if str(a).replace(" ", "").startswith("slice_p=")]
    if optimizer == "prodigy" and sliced:  # (Prodigy's one memory option: kohya passes optimizer_args as kwargs)
        optimizer += ":" + str(sliced[-1]).replace(" ", "")
    return {"optimizer": optimizer}
