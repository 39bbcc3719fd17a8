"""An axolotl config (YAML) read as the workload and the plan it trains: ``memfit estimate --from
config.yml`` (and ``plan``).

| axolotl field | memfit |
|---|---|
| ``base_model`` (``base_model_config`` where given) | the workload: a hub id or a model folder, its config.json alone |
| ``adapter: lora`` / ``qlora`` | ``adapter: lora:...``; qlora also ``base_weights: nf4:double_quant=true`` |
| ``lora_r``, ``lora_alpha``, ``lora_dropout`` | the adapter's ``r``, ``alpha``, ``dropout`` |
| ``lora_target_modules``; ``lora_target_linear: true`` | its ``targets``; ``targets=linear-modules`` (axolotl's ``find_all_linear_names``) |
| ``lora_modules_to_save``; ``peft_use_dora: true`` | its ``save``; a DoRA adapter |
| ``load_in_4bit`` / ``load_in_8bit`` | ``base_weights: nf4:double_quant=true`` / ``int8`` |
| ``quantize_moe_experts: true`` (with 4-bit weights) | ``base_weights: nf4:double_quant=true,experts=true``: the experts' 3-D weights too |
| ``sequence_len`` | the sequence length |
| ``micro_batch_size`` x ``gradient_accumulation_steps`` | the global batch, split into micro-batches of ``micro_batch_size`` |
| ``gradient_checkpointing: true`` | ``checkpointing: blocks`` (Hugging Face's: each decoder layer); with ``gradient_checkpointing_kwargs: {use_reentrant: true}`` (or without ``use_reentrant``: torch's default), ``blocks:reentrant=true`` |
| ``activation_offloading`` (or ``gradient_checkpointing: offload``) | ``offload: activations`` beside it: each checkpointed layer's input on the host |
| ``bf16: true`` / ``auto``; ``fp16: true`` | ``precision: bf16-pure`` (axolotl loads the model in bf16; ``auto``: fp16 on a card without bf16); with an adapter ``bf16-base`` / ``fp16-base`` (peft keeps the adapter in fp32, and axolotl casts the embeddings and norms back to 16 bits); ``fp16`` |
| ``optimizer`` | ``adamw_torch``, ``adamw_torch_fused``, ``adamw_hf``: ``adamw``; ``adamw_bnb_8bit``: ``adamw8bit``; ``paged_adamw_32bit``, ``paged_adamw_8bit``: ``adamw-paged``, ``adamw8bit-paged`` (states in CUDA managed memory); torchao's ``adamw_torch_8bit``, ``adamw_torch_4bit``: ``adamw8bit-ao``, ``adamw4bit-ao``; ``adafactor``; ``sgd`` |
| ``max_grad_norm``; ``torch_compile: true`` | ``max_grad_norm``; ``compile: full`` |
| ``liger_fused_linear_cross_entropy: true`` | ``loss_chunks``: Liger's number of slices for the model's width and vocabulary (8 where its config cannot be read), said |
| ``plugins: [...CutCrossEntropyPlugin]`` (``cut_cross_entropy`` not false) | ``loss_chunks`` in Liger's slices, said: Cut Cross-Entropy holds no logits at all, the prediction one slice's more |
| ``model_quantization_config: Mxfp4Config`` with ``dequantize: true`` | the model in bf16, as memfit plans an MXFP4 checkpoint (gpt-oss) |

What the estimate ignores, and how it says so:

- **FSDP** (``fsdp``, ``fsdp_config``, ``fsdp_version``): FSDP2 over ``--world-size N`` ranks, which the command
  line gives (the launcher starts them): memfit.integrations.axolotl_fsdp.
- **Refused, one line** (ignoring them would mislead): ``deepspeed`` (memfit does not model DeepSpeed's
  ZeRO; it shards with FSDP2, ``--world-size``), ``rl`` (DPO and the like train on pairs beside a reference model), ``unfrozen_parameters``, an
  adapter or an optimizer memfit does not run.
- **Ignored in silence**: fields of the run around the step (data, schedule, logging, saving,
  evaluation, the tokenizer, the hub: :data:`NO_MEMORY_EFFECT`), and the attention flags
  (``flash_attention``, ``sdp_attention``, ``xformers_attention``, and ``attn_implementation`` of a fused kernel:
  memfit's CUDA model already takes the fused kernels). ``sample_packing`` makes every sample ``sequence_len`` tokens long, which is
  what memfit traces; without it, a batch is padded to its longest sample, at most that.
- **Ignored with a warning**: any other field set (a field left empty is as if absent), one line naming
  it.
"""

from __future__ import annotations

from pathlib import Path

from memfit.devices import Device
from memfit.errors import UserError, parse_problem
from memfit.integrations.axolotl_fsdp import LAUNCHER_RANKS, fsdp_fields, is_sharded
from memfit.integrations.configs import TrainingConfig, module_names, reentrant_set_aside, text_config, whole
from memfit.plans import Plan
from memfit.techniques.optimizer_variant import TRAINERS_OPTIM_NAMES
from memfit.techniques.quantized_experts import quantizes_experts, with_experts
from memfit.techniques.reentrant_checkpoint import reentrant_of

REFUSED = {
    "deepspeed": "memfit does not model DeepSpeed's ZeRO stages; remove deepspeed from the config (memfit shards "
                 "with FSDP2: give --world-size N)",
    "rl": "memfit traces supervised fine-tuning; preference training (DPO, ORPO, KTO, ...) holds pairs and a "
          "reference model; remove rl from the config to estimate the SFT step",
    "unfrozen_parameters": "memfit trains the whole model or an adapter; remove unfrozen_parameters from the config",
}
"""Fields whose meaning memfit cannot carry, and the fix."""

NO_MEMORY_EFFECT = frozenset("""
base_model_ignore_patterns chat_template chat_template_jinja dataset_prepared_path dataset_processes datasets
test_datasets val_set_size output_dir num_epochs max_steps learning_rate lr_scheduler lr_scheduler_kwargs
cosine_min_lr_ratio cosine_constant_lr_ratio lr_div_factor warmup_steps warmup_ratio weight_decay adam_beta1
adam_beta2 adam_epsilon logging_steps save_steps saves_per_epoch save_total_limit save_strategy save_safetensors
eval_steps evals_per_epoch eval_strategy eval_table_size eval_max_new_tokens eval_sample_packing eval_batch_size
do_causal_lm_eval early_stopping_patience resume_from_checkpoint auto_resume_from_checkpoints local_rank debug
seed wandb_project wandb_entity wandb_watch wandb_name wandb_log_model wandb_mode wandb_run_id mlflow_tracking_uri
mlflow_experiment_name comet_api_key comet_workspace comet_project_name hub_model_id hub_strategy push_dataset_to_hub
hf_use_auth_token strict model_type tokenizer_type tokenizer_config tokenizer_use_fast tokenizer_legacy
trust_remote_code is_llama_derived_model is_mistral_derived_model is_falcon_derived_model is_qwen_derived_model
special_tokens tokens train_on_inputs group_by_length pad_to_sequence_len sample_packing flash_attention
flash_attn_cross_entropy flash_attn_rms_norm flash_attn_fuse_qkv flash_attn_fuse_mlp sdp_attention
xformers_attention tf32 lora_fan_in_fan_out logging_dir shuffle_merged_datasets
default_system_message dataloader_num_workers dataloader_pin_memory dataloader_prefetch_factor remove_unused_columns
gptq lora_model_dir profiler_steps include_tokens_per_second eot_tokens skip_prepare_dataset loss_watchdog_threshold
loss_watchdog_patience tokenizer_use_mistral_common ddp_find_unused_parameters save_only_model processor_type eta_min
""".split())
"""Fields of the run around the step (ignored without a word)."""

MAPPED = frozenset("""
base_model base_model_config adapter lora_r lora_alpha lora_dropout lora_target_modules lora_target_linear
lora_modules_to_save peft_use_dora load_in_4bit load_in_8bit sequence_len micro_batch_size gradient_accumulation_steps
batch_size gradient_checkpointing gradient_checkpointing_kwargs activation_offloading bf16 fp16 optimizer max_grad_norm torch_compile fsdp fsdp_config fsdp_version
liger_fused_linear_cross_entropy attn_implementation plugins cut_cross_entropy model_quantization_config
model_quantization_config_kwargs quantize_moe_experts
""".split())
LIGER_CHUNKS = 8
"""memfit's chunked loss for Liger's fused linear cross-entropy: the logits of one slice of the tokens at a time."""

FUSED_ATTENTION = ("flash_attention_2", "flash_attention_3", "sdpa", "xformers")
"""``attn_implementation`` values whose kernels hold no [heads, T, T] matrix: memfit's CUDA model takes SDPA's fused
kernels for the model's attention, as the deprecated flags (``flash_attention: true``...) said; a hub kernel of
flash attention (``kernels-community/vllm-flash-attn3``) too."""
CUT_CROSS_ENTROPY = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
PLUGINS_WITHOUT_MEMORY = ("axolotl.integrations.liger.LigerPlugin",  # (its kernels: the liger_* fields)
                          "axolotl.integrations.swanlab.SwanLabPlugin")
"""Plugins with nothing of their own to map: Liger's fields are read one by one, SwanLab logs."""

OPTIMIZERS = {**TRAINERS_OPTIM_NAMES, "adamw": "adamw", "sgd": "sgd"}
"""axolotl's optimizer names memfit runs: TrainingArguments' ``optim`` names (torchao's ``adamw_torch_8bit`` and
``adamw_torch_4bit`` among them), and axolotl's ``adamw_8bit`` (bitsandbytes')."""


def read_config(path: str | Path, device: Device) -> TrainingConfig:
    """The axolotl config at ``path`` (see the module docstring); ``device`` decides ``bf16: auto``."""
    import yaml
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--from {path}: no such file; give an axolotl config (.yml)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"--from {path}: not valid YAML at {parse_problem(e)}; fix the file") from None
    if not isinstance(data, dict):
        raise UserError(f"--from {path}: an axolotl config is a mapping of fields (base_model: ..., adapter: ...)")
    return map_config(data, str(path), device)


def map_config(data: dict, where: str, device: Device) -> TrainingConfig:
    """An axolotl config's fields (a parsed YAML mapping) as memfit's workload, sizes and plan."""
    data = {key: value for key, value in data.items() if value not in (None, "", [], {})}  # (empty: as if absent)
    for key, fix in REFUSED.items():
        if data.get(key) not in (None, False):
            raise UserError(f"--from {where}: {key}: {fix}")
    model = data.get("base_model_config") or data.get("base_model")
    if not isinstance(model, str) or not model.strip():
        raise UserError(f"--from {where}: no base_model; the config names the model it trains (a hub id or a folder)")
    warnings = [f"axolotl config {where}: {key} is not mapped; the estimate ignores it"  # (a flag set false: as absent)
                for key, value in data.items()
                if key not in MAPPED and key not in NO_MEMORY_EFFECT and key not in REFUSED and value is not False]
    micro = whole(data, "micro_batch_size", where, 1)
    accum = whole(data, "gradient_accumulation_steps", where, 1)
    if "batch_size" in data and "micro_batch_size" not in data:
        warnings.append(f"axolotl config {where}: batch_size without micro_batch_size: memfit takes micro_batch_size 1 "
                        "(axolotl's default); give micro_batch_size")
    method = _method(data, where)
    fields = {**method, **precision_fields(data, device, "adapter" in method), **_optimizer(data, where)}
    fields.update(_checkpointing(data, where, warnings))
    if data.get("quantize_moe_experts") and not quantizes_experts(fields.get("base_weights")):
        warnings.append(f"axolotl config {where}: quantize_moe_experts without 4-bit weights (axolotl's own 8-bit "
                        "experts) is not mapped; the estimate keeps the experts in 16 bits")
    if data.get("max_grad_norm") is not None:
        fields["max_grad_norm"] = data["max_grad_norm"]
    if data.get("torch_compile") not in (None, False):
        fields["compile"] = "full"
    warnings.extend(_attention(data, where))
    plugins = _plugins(data, where, warnings)
    seq = data.get("sequence_len")
    chunks = liger_chunks(model.strip(), micro * seq) if isinstance(seq, int) and seq > 0 else None
    if data.get("liger_fused_linear_cross_entropy"):  # (Liger's head and loss: the logits never whole)
        fields["loss_chunks"] = chunks or LIGER_CHUNKS
        warnings.append(f"axolotl config {where}: liger_fused_linear_cross_entropy predicted as memfit's chunked loss "
                        + (f"in Liger's {chunks} slices of the micro-batch's tokens (Liger keeps each slice's logits in "
                           "16 bits and takes the input's gradient in forward)" if chunks else
                           f"in {LIGER_CHUNKS} slices (the model's width and vocabulary, by which Liger sizes its "
                           "slices, were not read)"))
    elif CUT_CROSS_ENTROPY in plugins and data.get("cut_cross_entropy", True) is not False:  # NOTE [ Cut Cross-Entropy ]
        fields["loss_chunks"] = chunks or LIGER_CHUNKS
        warnings.append(f"axolotl config {where}: Cut Cross-Entropy predicted as memfit's chunked loss in "
                        + (f"{chunks} slices of the micro-batch's tokens, each slice's logits about the hidden states' "
                           "size" if chunks else f"{LIGER_CHUNKS} slices (the model's config.json was not read)")
                        + ": CCE holds no slice's logits, so the prediction is higher by about one slice's")
    if accum > 1:
        fields["micro_batch_size"] = micro
    sharded = is_sharded(data)
    if sharded:
        shard, said = fsdp_fields(data, where)
        fields.update(shard)
        warnings.extend(said)
    warnings.extend(reentrant_set_aside(fields, where, "axolotl"))
    try:
        plan = Plan(**fields)
    except UserError as e:
        raise UserError(f"--from {where}: {str(e).removeprefix('plan: ')}") from None
    return TrainingConfig(where, model.strip(), micro * accum, micro,
                         whole(data, "sequence_len", where, None) if seq is not None else None, plan, tuple(warnings),
                         ranks_from_launcher=LAUNCHER_RANKS if sharded else None, batch_per_rank=True)


def _attention(data: dict, where: str) -> list[str]:
    """``attn_implementation``: a fused kernel is what memfit predicts (nothing said); another one, a line."""
    value = data.get("attn_implementation")
    if value is None or value in FUSED_ATTENTION or "flash" in str(value).lower():
        return []
    return [f"axolotl config {where}: attn_implementation {value} is not mapped; the estimate predicts the model's "
            "attention with SDPA's fused kernels"]


# NOTE [ Cut Cross-Entropy ]
# axolotl's CutCrossEntropyPlugin (70 of its 250 example configs) patches the model's loss with Apple's Cut
# Cross-Entropy: the output layer and the cross-entropy in one kernel that never writes the logits, forward or
# backward (each block of the vocabulary's logits lives in the GPU's on-chip memory). Left unmapped, memfit
# predicted the whole logits and their fp32 copies (gpt-oss-20b at 4,096 tokens: 3.1 GiB each). The nearest
# memfit step is its chunked loss, with Liger's slices: one slice's logits, about the hidden states' size, at a
# time, recomputed in backward. That holds one slice's logits more than CCE, so the prediction is the higher,
# and the warning says by what.
def _plugins(data: dict, where: str, warnings: list[str]) -> list[str]:
    """The config's plugins; each memfit cannot map named in a warning."""
    plugins = data.get("plugins") or []
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise UserError(f"--from {where}: plugins is a list of plugin class paths, got {plugins!r}")
    warnings.extend(f"axolotl config {where}: plugin {p} is not mapped; the estimate ignores it" for p in plugins
                    if p not in (CUT_CROSS_ENTROPY, *PLUGINS_WITHOUT_MEMORY))
    if data.get("model_quantization_config") is not None and not _dequantized_mxfp4(data):
        warnings.append(f"axolotl config {where}: model_quantization_config {data['model_quantization_config']} is not "
                        "mapped; the estimate ignores it")
    return plugins


def _dequantized_mxfp4(data: dict) -> bool:
    """``model_quantization_config: Mxfp4Config`` with ``dequantize: true``: the model loads in bf16, as memfit plans
    an MXFP4 checkpoint (NOTE [ Checkpoints trained dequantized ] in memfit.workloads.hf)."""
    kwargs = data.get("model_quantization_config_kwargs") or {}
    return data.get("model_quantization_config") == "Mxfp4Config" and isinstance(kwargs, dict) and \
        kwargs.get("dequantize") is True


def liger_chunks(model: str, tokens: int) -> int | None:
    """The slices Liger's fused linear cross-entropy cuts ``tokens`` (a micro-batch's) into for ``model`` (a folder
    or hub id): slices of a power of two tokens whose logits are about the size of the hidden states (the
    vocabulary over the width: Liger-Kernel's ``fused_linear_cross_entropy_forward``). None where the model's
    config.json cannot be read here."""
    text = text_config(model)
    if text is None:
        return None
    width, vocab = text.get("hidden_size"), text.get("vocab_size")
    if not (isinstance(width, int) and isinstance(vocab, int) and width > 0 and vocab > 0):
        return None
    growth = -(-vocab // width)
    size = min(1 << (-(-tokens // growth) - 1).bit_length(), tokens)  # (the next power of two, at most the tokens)
    return -(-tokens // size)


def _checkpointing(data: dict, where: str, warnings: list[str]) -> dict:
    """gradient_checkpointing and activation_offloading -> the plan's checkpointing and offload. axolotl reads
    its deprecated ``gradient_checkpointing: offload`` as ``activation_offloading: true`` and ``offload_disk`` as
    ``disk``; each of its offloaders holds what a checkpointed layer saves, its input, off the device (Unsloth's
    ``legacy``, the stream offloader ``true``, ``hidden_states``): memfit's blocks with ``offload: activations``."""
    checkpointing, offloading = data.get("gradient_checkpointing"), data.get("activation_offloading")
    if checkpointing in (None, False):
        if offloading not in (None, False):
            raise UserError(f"--from {where}: activation_offloading needs gradient_checkpointing (axolotl refuses it "
                            "without); set gradient_checkpointing: true")
        return {}
    if checkpointing not in (True, "offload", "offload_disk"):
        raise UserError(f"--from {where}: gradient_checkpointing: {checkpointing!r} is not axolotl's; write true, false, "
                        "or activation_offloading beside true")
    offloading = {"offload": offloading or True, "offload_disk": "disk"}.get(checkpointing, offloading)
    if offloading in (None, False):  # (its gradient_checkpointing_kwargs go to the Trainer as they are)
        reentrant = reentrant_of(data.get("gradient_checkpointing_kwargs"), f"--from {where}: gradient_checkpointing_kwargs")
        return {"checkpointing": "blocks:reentrant=true" if reentrant else "blocks"}
    if offloading not in (True, "legacy", "hidden_states", "disk"):
        raise UserError(f"--from {where}: activation_offloading: {offloading!r} is not axolotl's; write true, legacy, "
                        "hidden_states or disk")
    if offloading == "disk":
        warnings.append(f"axolotl config {where}: activation offloading to disk is predicted as held in host memory "
                        "(the device's bytes are the same; the host's are on disk in the run)")
    return {"checkpointing": "blocks", "offload": ["activations"]}


def _method(data: dict, where: str) -> dict:
    """adapter, lora_*, load_in_* -> the plan's adapter and base_weights."""
    kind = data.get("adapter")
    four, eight = bool(data.get("load_in_4bit")), bool(data.get("load_in_8bit"))
    if four and eight:
        raise UserError(f"--from {where}: load_in_4bit and load_in_8bit are both set; keep one")
    weights = "nf4:double_quant=true" if four or kind == "qlora" else "int8" if eight else None
    if data.get("quantize_moe_experts") and weights and weights.startswith("nf4"):  # (bitsandbytes' parametrization)
        weights = with_experts(weights)
    if kind in (None, "", False):
        if weights:
            raise UserError(f"--from {where}: load_in_{'4' if four else '8'}bit without an adapter trains nothing; "
                            "set adapter: lora (or qlora)")
        return {}
    if kind not in ("lora", "qlora"):
        raise UserError(f"--from {where}: adapter {kind!r} is not one memfit runs; use lora or qlora")
    options = [f"r={whole(data, 'lora_r', where, 8)}"]
    if data.get("lora_alpha") is not None:
        options.append(f"alpha={data['lora_alpha']}")
    if data.get("lora_target_linear"):  # (axolotl's find_all_linear_names, with lora_target_modules beside)
        options.append("targets=" + "+".join(["linear-modules", *(module_names(data, "lora_target_modules", where)
                                                                  if data.get("lora_target_modules") else [])]))
    elif data.get("lora_target_modules"):
        options.append("targets=" + "+".join(module_names(data, "lora_target_modules", where)))
    if data.get("lora_dropout"):
        options.append(f"dropout={data['lora_dropout']}")
    if data.get("lora_modules_to_save"):
        options.append("save=" + "+".join(module_names(data, "lora_modules_to_save", where)))
    out = {"adapter": f"{'dora' if data.get('peft_use_dora') else 'lora'}:{','.join(options)}"}
    if weights:
        out["base_weights"] = weights
    return out


def precision_fields(data: dict, device: Device, adapter: bool) -> dict:
    """``bf16``/``fp16`` -> the plan's precision on ``device`` (the module's table)."""
    bf16, fp16 = data.get("bf16"), data.get("fp16")
    if bf16 is True or (bf16 == "auto" and device.bf16):
        return {"precision": "bf16-base" if adapter else "bf16-pure"}
    if fp16 or bf16 == "auto":
        return {"precision": "fp16-base" if adapter else "fp16"}
    return {}


def _optimizer(data: dict, where: str) -> dict:
    name = data.get("optimizer")
    if name is None:
        return {}
    if name not in OPTIMIZERS:
        raise UserError(f"--from {where}: optimizer {name!r} is not one memfit runs; use one of "
                        f"{', '.join(OPTIMIZERS)}")
    return {"optimizer": OPTIMIZERS[name]}
