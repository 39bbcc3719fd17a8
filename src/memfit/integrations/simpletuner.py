"""SimpleTuner (bghira/SimpleTuner) training configs as memfit's workload, sizes and plan (``memfit estimate --from
config.json``): its config.json or config.toml (``"--option": value``, with or without the dashes) or config.env
(``MODEL_FAMILY=flux``, ``TRAINER_EXTRA_ARGS="--lora_rank=16"``), told apart by a ``model_family`` key.

What SimpleTuner runs, read from its source (simpletuner/helpers/configuration/: cli_utils.py, env_file.py,
cmd_args.py; the defaults of simpletuner/simpletuner_sdk/server/services/field_registry/sections/; simpletuner/helpers/
training/trainer.py, optimizer_param.py, optimizers/adamw_bfloat16, quantisation/__init__.py, musubi_block_swap.py;
simpletuner/helpers/models/common.py), and how memfit maps it:

| SimpleTuner option | what it runs (file it was read from) | memfit |
|---|---|---|
| ``model_family``, ``model_flavour``, ``pretrained_model_name_or_path`` | the family's own copy of diffusers' denoiser, from the flavour's hub id (models/<family>/model.py) | the built-in of a published checkpoint, else the id or folder (memfit.integrations.simpletuner_models); other families refused |
| ``model_type`` lora (``lora_type`` standard), ``lora_rank`` (16), ``lora_alpha`` (rank), ``lora_dropout`` (0.1), ``use_dora`` | PEFT ``add_adapter`` on the family's ``DEFAULT_LORA_TARGET`` (FLUX.1, Chroma: ``flux_lora_target``, default ``all``; ``peft_lora_target_modules``) (models/common.py) | ``adapter: lora:r=,alpha=,dropout=,targets=`` (``dora:``) |
| ``lora_type`` lycoris, ``lycoris_config`` | ``create_lycoris(model, multiplier, linear_dim, linear_alpha, algo=, factor=)`` after ``apply_preset`` (training/trainer.py) | ``adapter: lycoris:algo=,dim=,alpha=,factor=,modules=``; LoKr over quantized weights or ``bypass_mode``: ``lokr:...,factored=1`` (said) |
| ``model_type`` full (the default) | the whole denoiser trains | no adapter |
| ``mixed_precision`` bf16 (default), fp16, no; ``base_model_default_dtype`` | the model loaded in that dtype and the adapter made in it (``torch_dtype=weight_dtype``; ``.to(weight_dtype)``), under accelerate's autocast (training/trainer.py, configuration/cmd_args.py) | ``bf16-pure`` (autocast over bf16 weights: bf16's); fp16: ``fp16``/``fp16-base`` (a bound, said); no: ``fp32``; fp8 refused |
| ``base_model_precision`` (quanto, torchao, bnb, sdnq, fp8-native presets) | the denoiser's linear layers quantized (``quantise_model``), text encoders only by ``text_encoder_N_precision`` (quantisation/__init__.py) | ``base_weights: fp8`` (one byte), ``nf4`` (four bits); others as a bound, said |
| ``train_batch_size`` (4), ``gradient_accumulation_steps`` (1); a dataset's ``train_batch_size`` | the micro-batch (data_backend/dataset_types.py), accumulated | batch and micro-batch |
| ``resolution`` (1024), ``resolution_type`` (``pixel_area``), a dataset's own | buckets of that area (``pixel_area``: the side squared; ``area``: megapixels; ``pixel``: the shorter side), sides rounded to ``aspect_bucket_alignment`` (64) (data_backend/factory.py, multiaspect/image.py) | ``--resolution`` the side (video: side x side, ``frames=``); memfit.integrations.simpletuner_data |
| ``gradient_checkpointing`` (true), ``gradient_checkpointing_interval``, ``gradient_checkpointing_backend`` | every block checkpointed; one in N, or segments of N (models/<family>/transformer.py); unsloth: the block's input on the host | ``checkpointing: blocks`` / ``blocks:every=N`` (segments: ``blocks``, said); unsloth: ``offload: activations``; -ffn refused |
| ``optimizer`` (``adamw_bf16``) | ``AdamWBF16``: bf16 ``exp_avg``, ``exp_avg_sq`` and a bf16 ``shift`` (Kahan compensation), stochastic rounding (training/optimizers/adamw_bfloat16) | ``adamw`` + ``bf16_update: kahan``; others :data:`OPTIMIZERS` |
| ``max_grad_norm`` (2.0), ``grad_clip_method`` (value) | ``clip_grad_value_`` in place, or ``clip_grad_norm_``; none for prodigy, optimi-stableadamw (training/trainer.py) | ``max_grad_norm`` with norm, else none |
| ``use_ema``, ``ema_device`` (cpu), ``ema_decay`` (0.995), ``ema_update_interval`` | a shadow of the trained parameters in ``weight_dtype``, pinned on the host or on the device (training/trainer.py) | ``ema: {decay, device, every}`` |
| ``musubi_blocks_to_swap`` | the last N blocks on the host, streamed in (musubi_block_swap.py) | ``swap_blocks: N`` |
| ``optimizer_release_gradients`` (optimi), ``optimizer_cpu_offload_method`` torchao | a step per parameter in the backward; states on the host | ``optimizer_in_backward``; ``offload: optimizer_states`` |
| text embeds | always cached by a ``text_embeds`` dataset, encoders unloaded; ``text_cache_ondemand``/``_disable``: kept and run in the step | workload's default (cached); ``text_encoders=frozen`` |

Said in one line each: approximations above; a pixel resolution of non-square images; several datasets (the
largest step is estimated); VAE latents not cached; options memfit does not hold (:data:`NOT_MAPPED`). Refused in one
line: :data:`REFUSED`, an unknown family, flavour, optimizer, LoRA type or precision.
"""

from __future__ import annotations

from pathlib import Path

from memfit.devices import Device
from memfit.errors import UserError, parse_problem
from memfit.integrations import simpletuner_data as data_files
from memfit.integrations import simpletuner_models as models
from memfit.integrations.configs import TrainingConfig, read_toml
from memfit.plans import Plan
from memfit.workloads.config_overrides import with_override

TRUE, FALSE = ("1", "true", "yes", "y", "on"), ("0", "false", "no", "n", "off")
"""cmd_args.py's ``BOOL_TRUE_STRINGS`` and ``BOOL_FALSE_STRINGS``."""
ENV = {"MODEL_FAMILY": "model_family", "MODEL_TYPE": "model_type", "MODEL_NAME": "pretrained_model_name_or_path",
       "TRAIN_BATCH_SIZE": "train_batch_size", "GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
       "USE_GRADIENT_CHECKPOINTING": "gradient_checkpointing", "RESOLUTION": "resolution",
       "RESOLUTION_TYPE": "resolution_type", "MIXED_PRECISION": "mixed_precision", "OPTIMIZER": "optimizer",
       "BASE_MODEL_PRECISION": "base_model_precision", "USE_EMA": "use_ema", "LORA_TYPE": "lora_type",
       "LYCORIS_CONFIG": "lycoris_config", "DATALOADER_CONFIG": "data_backend_config", "USE_DORA": "use_dora",
       "FLUX_LORA_TARGET": "flux_lora_target", "TEXT_CACHE_ONDEMAND": "text_cache_ondemand",
       "TEXT_CACHE_DISABLE": "text_cache_disable", "QUANTIZATION_CONFIG": "quantization_config",
       "TRAINING_NUM_PROCESSES": "num_processes"}
"""config.env's variables that change memory (env_file.py's ``env_to_args_map``); the rest in ``TRAINER_EXTRA_ARGS``."""
REFUSED = {
    "deepspeed_config": "memfit does not model DeepSpeed's ZeRO; remove deepspeed_config (memfit shards with FSDP2: "
                        "--world-size N)",
    "fsdp_enable": "memfit does not read SimpleTuner's FSDP settings; remove fsdp_enable and give --world-size N "
                   "(memfit's FSDP2)",
    "controlnet": "memfit builds no ControlNet beside the denoiser; remove controlnet to estimate the denoiser's training",
    "control": "memfit does not model channel-concatenated control inputs; remove control",
    "train_text_encoder": "memfit does not model SimpleTuner's text-encoder training; remove train_text_encoder",
    "quantization_config": "memfit does not read pipeline quantization configs; set base_model_precision to the preset",
    "layer_freeze_strategy": "memfit does not model BitFit (biases alone trained); remove layer_freeze_strategy",
}
"""Options whose run memfit cannot carry, and the fix."""
NOT_MAPPED = {
    "tread_config": "TREAD routes a share of the tokens past the middle blocks; memfit's step runs every token (a bound)",
    "enable_chunked_feed_forward": "the feed-forward runs in chunks; memfit's runs whole (a bound)",
    "gradient_checkpointing_offload_attention": "attention activations go to the host; memfit keeps them (a bound)",
    "ramtorch": "RamTorch streams the linear weights from the host; memfit keeps them on the device (a bound)",
    "enable_group_offload": "diffusers' group offloading is not mapped; memfit keeps every block on the device (a bound)",
    "assistant_lora_path": "the assistant LoRA is loaded beside the trained one: not in the estimate",
    "keep_vae_loaded": "the VAE stays on the device: its weights are not in the estimate",
    "distillation_config": "the distillation's teacher or second forward is not in the estimate",
}
"""Options that change memory memfit does not hold, said when set."""
OPTIMIZERS = {"adamw_bf16": ("adamw", True), "torch-adamw": ("adamw", False), "torch-adam": ("adamw", False),
              "optimi-adamw": ("adamw", True), "optimi-adam": ("adamw", True), "optimi-stableadamw": ("adamw", True),
              "bnb-adamw8bit": ("adamw8bit", False), "bnb-adam8bit": ("adamw8bit", False),
              "bnb-adamw8bit-paged": ("adamw8bit-paged", False), "bnb-adamw-paged": ("adamw-paged", False),
              "ao-adamw8bit": ("adamw8bit-ao", False), "ao-adamw4bit": ("adamw4bit-ao", False),
              "ao-adamwfp8": ("adamwfp8-ao", False), "ao-adamfp8": ("adamwfp8-ao", False),
              "bnb-lion8bit": ("lion8bit", False), "torch-sgd": ("sgd", False), "torch-adafactor": ("adafactor", False),
              "prodigy": ("prodigy", False), "optimi-lion": ("adamw", True)}
"""SimpleTuner's optimizers memfit runs: (memfit's, Kahan-compensated over bf16 weights: AdamWBF16's ``shift``,
optimi's ``kahan_sum``). Adam's states weigh AdamW's; optimi's Lion (one state) is AdamW's bound, said."""
NO_CLIPPING = ("prodigy", "optimi-stableadamw")
"""The optimizers SimpleTuner never clips for (training/trainer.py)."""
FULL_MATRIX = 1 << 20
"""A LyCORIS ``linear_dim`` that keeps LoKr's w2 a full matrix on any layer (``full_matrix: true``)."""


def is_simpletuner(data: object) -> bool:
    """A SimpleTuner config: a mapping with ``model_family`` (``--model_family``, with or without the dashes)."""
    return isinstance(data, dict) and any(isinstance(k, str) and k.lstrip("-") == "model_family" for k in data)


def read_config(path: str | Path, device: Device, workload: str | None = None) -> TrainingConfig:
    """The SimpleTuner config at ``path`` (config.json, config.toml or config.env; see the module docstring);
    ``workload``: the model named beside it, in place of the family's."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--from {path}: no such file; give a SimpleTuner config.json, config.toml or config.env")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--from {path}: cannot read it ({e}); check the file") from None
    if p.suffix.lower() == ".toml":
        loaded = read_toml(p, f"--from {path}", "a SimpleTuner config.json, config.toml or config.env")
    elif p.suffix.lower() == ".env":
        loaded = env_arguments(text)
    else:
        import json
        try:
            loaded = json.loads(text)
        except ValueError as e:
            raise UserError(f"--from {path}: not valid JSON ({parse_problem(e)}); fix the file") from None
    return map_config(loaded, str(path), device, workload, base=p.resolve().parent)


def env_arguments(text: str) -> dict:
    """config.env's variables (``export`` and quotes stripped) as SimpleTuner's arguments: :data:`ENV` and
    ``TRAINER_EXTRA_ARGS``'s ``--key=value``, ``--key value`` and ``--flag``; ``false`` leaves an option out."""
    env: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip().removeprefix("export ").strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = (s.strip() for s in line.replace("+=", "=", 1).split("=", 1))
        value = value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value
        env[key] = f"{env[key]} {value}" if "+=" in line and key in env else value
    args = {name: env[var] for var, name in ENV.items() if var in env and env[var].lower() != "false"}
    words = env.get("TRAINER_EXTRA_ARGS", "").split()
    for i, word in enumerate(words):
        if word.startswith("--"):
            key, sep, value = word[2:].partition("=")
            following = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
            args[key] = value if sep else following if following is not None else True
    return args


def arguments(data: dict) -> dict:
    """Options as SimpleTuner's ``mapping_to_cli_args`` passes them: dashes stripped, None and the string "false"
    dropped (its default then runs), "true" a flag."""
    out = {}
    for key, value in data.items():
        if not isinstance(key, str) or value is None:
            continue
        if isinstance(value, str) and value.strip().lower() in ("false", "true"):
            if value.strip().lower() == "false":
                continue
            value = True
        out[key.lstrip("-").replace("-", "_")] = value
    return out


def flag(args: dict, key: str, default: bool = False) -> bool:
    value = args.get(key, default)
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    return bool(value) if not isinstance(value, str) else value.strip().lower() not in ("", "none")


def number(args: dict, key: str, default, where: str, whole: bool = False):
    """``args[key]`` as argparse reads it (a string of digits too); one line where it is not a number."""
    value = args.get(key, default)
    if value is None or value is default:
        return value
    try:
        got = (int(value) if isinstance(value, (int, str)) else None) if whole else float(value)
    except ValueError:
        got = None
    if got is None or isinstance(value, bool):
        raise UserError(f"--from {where}: {key} must be a {'whole ' if whole else ''}number, got {value!r}")
    return got


def map_config(data: dict, where: str, device: Device, workload: str | None = None,
               base: Path | None = None) -> TrainingConfig:
    """SimpleTuner's options (a config's mapping; see the module docstring) as memfit's workload, sizes and plan;
    ``base``: the folder the config is in (its data backend and LyCORIS files are looked for beside it)."""
    del device  # (SimpleTuner's precision is explicit: mixed_precision)
    if not isinstance(data, dict):
        raise UserError(f"--from {where}: a SimpleTuner config is a mapping of options, got {type(data).__name__}")
    args, warnings = arguments(data), []
    for key, fix in REFUSED.items():
        if flag(args, key):
            raise UserError(f"--from {where}: {key}: {fix}")
    warnings += [f"SimpleTuner config {where}: {key}: {what}" for key, what in NOT_MAPPED.items() if flag(args, key)]
    if number(args, "num_processes", 1, where, whole=True) > 1:
        warnings.append(f"SimpleTuner config {where}: num_processes: each of the processes holds this estimate (its "
                        "train_batch_size); DDP's gradient buckets are not in it")
    family = str(args.get("model_family") or "").strip().lower()
    if not family and workload is None:
        raise UserError(f"--from {where}: model_family is not set; the config names the model family it trains")
    sets = data_files.datasets(args, where, base, warnings)
    named = workload or models.workload(family, args, sets or [], where, warnings)
    full = str(args.get("model_type", "full")).lower() == "full"
    if str(args.get("model_type", "full")).lower() not in ("full", "lora"):
        raise UserError(f"--from {where}: model_type {args['model_type']!r} is not one of full, lora")
    precision_name = str(args.get("base_model_precision", "no_change")).lower()
    if full and precision_name != "no_change":
        raise UserError(f"--from {where}: base_model_precision {precision_name} with model_type full: memfit quantizes "
                        "no trained weights; set model_type lora or base_model_precision no_change")
    text = "frozen" if flag(args, "text_cache_ondemand") or flag(args, "text_cache_disable") else "cached"
    fields = models.base_weights(precision_name, family, text, where, warnings)
    quantized = precision_name != "no_change"
    if not full:
        fields.update(_adapter(family, args, quantized, where, base, warnings))
    fields.update(_precision(args, full, quantized, where, warnings))
    fields.update(_optimizer(args, fields["precision"], where, warnings))
    swap = number(args, "musubi_blocks_to_swap", 0, where, whole=True)
    if swap and family in models.UNETS:
        warnings.append(f"SimpleTuner config {where}: musubi_blocks_to_swap: SimpleTuner's {family} UNet swaps no "
                        "blocks; ignored, as there")
    elif swap:
        fields["swap_blocks"] = swap
    checkpointing = _checkpointing(family, args, bool(fields.get("swap_blocks")), where, warnings)
    offload = [*fields.pop("offload", []), *checkpointing.pop("offload", [])]  # (optimizer states, activations)
    fields.update(checkpointing, **({"offload": offload} if offload else {}))
    fields.update(_ema(args, fields["precision"], where, warnings))
    if text == "frozen" and "text_encoders=" not in named:
        if family in models.OWN_TEXT:
            named = with_override(named, "text_encoders", "frozen")
        else:
            warnings.append(f"SimpleTuner config {where}: the text encoders run in the step (text_cache_ondemand or "
                            f"text_cache_disable); memfit does not hold {family}'s, so they are not in the estimate")
    batch = number(args, "train_batch_size", 4, where, whole=True)
    vae = flag(args, "vae_cache_ondemand") or flag(args, "vae_cache_disable")
    micro, side, count = data_files.largest(sets, args, batch, lambda d: models.frames(family, d, where, warnings),
                                            vae, where, warnings)
    accum = number(args, "gradient_accumulation_steps", 1, where, whole=True)
    if min(micro, accum) < 1:
        raise UserError(f"--from {where}: train_batch_size and gradient_accumulation_steps must be whole numbers >= 1")
    if accum > 1:
        fields["micro_batch_size"] = micro
    video = family in models.VIDEO
    if video and not sets:  # (no data backend here: a video dataset's default clip, as SimpleTuner's factory sets it)
        count = models.frames(family, {"dataset_type": "video"}, where, warnings)
    named = models.with_frames(named, family, count) if video else named
    try:
        plan = Plan(**fields)
    except UserError as e:
        raise UserError(f"--from {where}: {str(e).removeprefix('plan: ')}") from None
    return TrainingConfig(where, named, micro * accum, micro, None, plan, tuple(warnings),
                          (side, side) if video else side)


def _adapter(family: str, args: dict, quantized: bool, where: str, base: Path | None, warnings: list[str]) -> dict:
    """The trained network: PEFT's LoRA (or DoRA) on the family's targets, or a LyCORIS network."""
    kind = str(args.get("lora_type", "standard")).lower()
    if kind == "lycoris":
        return _lycoris(args, quantized, where, base, warnings)
    if kind != "standard":
        raise UserError(f"--from {where}: lora_type {kind!r} is not one of standard, lycoris")
    if str(args.get("peft_lora_mode", "standard")).lower() != "standard":
        raise UserError(f"--from {where}: peft_lora_mode {args['peft_lora_mode']!r}: memfit models PEFT's standard LoRA; "
                        "set peft_lora_mode standard")
    rank = number(args, "lora_rank", 16, where, whole=True)
    alpha = number(args, "lora_alpha", None, where)
    dropout = number(args, "lora_dropout", 0.1, where)
    dora = flag(args, "use_dora") and "quanto" not in str(args.get("base_model_precision"))  # (quanto: DoRA disabled)
    targets = "+".join(models.unfused(models.lora_targets(family, args, where)))
    if flag(args, "fuse_qkv_projections"):
        warnings.append(f"SimpleTuner config {where}: fuse_qkv_projections: memfit's model keeps q, k and v apart "
                        "(its LoRA on each)")
    return {"adapter": f"{'dora' if dora else 'lora'}:r={rank},alpha={alpha if alpha is not None else rank:g}"
                       f"{f',dropout={dropout:g}' if dropout else ''},targets={targets}"}


def _lycoris(args: dict, quantized: bool, where: str, base: Path | None, warnings: list[str]) -> dict:
    """``lycoris_config`` as memfit's LyCORIS network (its preset's ``target_module`` as ``modules``); a LoKr in
    LyCORIS's bypass form (``bypass_mode``, or over quantized weights, which LyCORIS bypasses) as memfit's factored
    LoKr over every linear layer in the blocks."""
    config = data_files.lycoris(args, where, base, warnings)
    algo = str(config["algo"]).lower()
    preset = config.get("apply_preset") or {}
    modules = [m for m in preset.get("target_module") or [] if isinstance(m, str)] if isinstance(preset, dict) else []
    factor = config.get("factor", -1)
    per_module = {v["factor"] for v in ((preset.get("module_algo_map") or {}) if isinstance(preset, dict) else {})
                  .values() if isinstance(v, dict) and "factor" in v}
    if per_module - {factor}:
        warnings.append(f"SimpleTuner config {where}: lycoris_config's module_algo_map factors {sorted(per_module)}: "
                        f"memfit uses factor {factor} for every module")
    full = algo == "lokr" and config.get("full_matrix") is True
    dim = FULL_MATRIX if full else number(config, "linear_dim", 4, where, whole=True)
    alpha = number(config, "linear_alpha", 1, where)
    if config.get("bypass_mode") or quantized:
        if algo != "lokr":
            raise UserError(f"--from {where}: LyCORIS {algo} over quantized base weights (or bypass_mode): memfit runs "
                            "no bypass form of it; set base_model_precision no_change, or algo lokr")
        known = bool(modules) and all(m in models.MODULE_CLASSES for m in modules)
        layers = "+".join(n for m in modules for n in models.MODULE_CLASSES[m]) if known else "in-blocks"
        warnings.append(f"SimpleTuner config {where}: LyCORIS's bypass LoKr is estimated as memfit's factored LoKr "
                        "(the update never built as a matrix) on " + (f"the linear layers of {'+'.join(modules)}"
                                                                      if known else "every linear layer in the blocks"))
        rank = "full" if full else f"{dim},alpha={alpha:g}"
        return {"adapter": f"lokr:r={rank},factor={factor},factored=1,targets={layers}"}
    return {"adapter": f"lycoris:algo={algo},dim={dim},alpha={alpha:g},factor={factor}" +
                       (f",modules={'+'.join(modules)}" if modules else "")}


def _precision(args: dict, full: bool, quantized: bool, where: str, warnings: list[str]) -> dict:
    """cmd_args.py's ``weight_dtype`` (bf16 where mixed_precision is, or a quantized LoRA's
    ``base_model_default_dtype`` is), the dtype of the model and of the adapter made in it."""
    mixed = str(args.get("mixed_precision", "bf16")).lower()
    if mixed not in ("bf16", "fp16", "no"):
        raise UserError(f"--from {where}: mixed_precision {mixed!r}: memfit runs bf16, fp16 and no (fp32), not "
                        "accelerate's torchao fp8 training; set mixed_precision bf16")
    default = str(args.get("base_model_default_dtype", "bf16")).lower()
    if quantized and default == "fp32":  # (trainer.py init_precision: the model cast to fp32 around its quantized layers)
        return {"precision": "bf16" if mixed == "bf16" else "fp32"}
    weights = "bf16" if mixed == "bf16" or (quantized and default == "bf16") else mixed
    if weights == "fp16":
        warnings.append(f"SimpleTuner config {where}: mixed_precision fp16 trains fp16 weights; memfit's fp16 keeps "
                        "the trained weights in fp32 under autocast (a bound)")
        return {"precision": "fp16" if full else "fp16-base"}
    return {"precision": "bf16-pure" if weights == "bf16" else "fp32"}


def _optimizer(args: dict, precision: str, where: str, warnings: list[str]) -> dict:
    name = str(args.get("optimizer", "adamw_bf16")).lower()
    if name not in OPTIMIZERS:
        raise UserError(f"--from {where}: optimizer {name!r} is not one memfit runs; use one of {', '.join(OPTIMIZERS)}")
    optimizer, kahan = OPTIMIZERS[name]
    if name == "adamw_bf16" and precision != "bf16-pure":
        raise UserError(f"--from {where}: optimizer adamw_bf16 needs bf16 weights (SimpleTuner refuses it otherwise); "
                        "set mixed_precision bf16")
    fields: dict = {"optimizer": optimizer}
    if kahan and precision == "bf16-pure":
        fields["bf16_update"] = "kahan"
    if name == "optimi-lion":
        warnings.append(f"SimpleTuner config {where}: optimi-lion keeps one state a weight, in its dtype, beside its "
                        "Kahan buffer; memfit's AdamW keeps two (a bound: one state a trained weight high)")
    if name == "prodigy":
        warnings.append(f"SimpleTuner config {where}: prodigy is prodigy-plus-schedule-free (factored second moments); "
                        "memfit's is prodigyopt's Prodigy (a bound)")
    if flag(args, "optimizer_release_gradients") and name.startswith("optimi-"):
        fields["optimizer_in_backward"] = True
    if str(args.get("optimizer_cpu_offload_method") or "").lower() == "torchao":
        fields["offload"] = ["optimizer_states"]
    norm = number(args, "max_grad_norm", 2.0, where)
    clipped = str(args.get("grad_clip_method", "value")).lower() == "norm" and norm > 0 and name not in NO_CLIPPING
    fields["max_grad_norm"] = float(norm) if clipped else None  # (value: an in-place clamp, nothing held)
    return fields


def _checkpointing(family: str, args: dict, swapped: bool, where: str, warnings: list[str]) -> dict:
    if not flag(args, "gradient_checkpointing", True):
        return {}
    backend = str(args.get("gradient_checkpointing_backend", "torch")).lower()
    if backend not in ("torch", "unsloth"):
        raise UserError(f"--from {where}: gradient_checkpointing_backend {backend!r}: memfit checkpoints whole blocks; "
                        "use torch or unsloth")
    fields = {"checkpointing": "blocks"}
    interval = number(args, "gradient_checkpointing_interval", 1, where, whole=True) or 1
    if interval > 1 and family in models.UNETS:
        warnings.append(f"SimpleTuner config {where}: gradient_checkpointing_interval: SimpleTuner's {family} UNet "
                        "takes none (every block checkpointed, as memfit's)")
    elif interval > 1 and family in models.SEGMENTED and not swapped and not flag(args, "tread_config"):
        warnings.append(f"SimpleTuner config {where}: gradient_checkpointing_interval {interval} checkpoints segments "
                        f"of {interval} blocks; memfit checkpoints every block (fewer inputs kept there, {interval} "
                        "blocks recomputed at once)")
    elif interval > 1:
        fields["checkpointing"] = f"blocks:every={interval}"
    if backend == "unsloth":
        fields["offload"] = ["activations"]
    return fields


def _ema(args: dict, precision: str, where: str, warnings: list[str]) -> dict:
    if not flag(args, "use_ema"):
        return {}
    host = flag(args, "ema_cpu_only") or str(args.get("ema_device", "cpu")).lower() == "cpu"
    if not host and precision == "bf16-pure":
        warnings.append(f"SimpleTuner config {where}: SimpleTuner's EMA is bf16 (weight_dtype); memfit's is fp32 "
                        "(a bound: 2 bytes a trained weight high)")
    return {"ema": {"decay": number(args, "ema_decay", 0.995, where), "device": "cpu" if host else "device",
                    "every": number(args, "ema_update_interval", 1, where, whole=True)}}
