"""A LLaMA-Factory training config (YAML, ``llamafactory-cli train config.yaml``) read as the workload and the plan
it trains: ``memfit estimate --from config.yaml`` (and ``plan``).

LLaMA-Factory (hiyouga/LLaMA-Factory, read at ff6d4d1 of 2026-08-18) loads the model with ``from_pretrained(...,
torch_dtype="auto")`` (the checkpoint's dtype), quantizes it while loading where ``quantization_bit`` says so,
enables gradient checkpointing unless told not to, upcasts what trains to fp32 unless ``pure_bf16``
(``init_adapter``'s ``cast_trainable_params_to_fp32``), and trains under the Trainer's autocast of ``bf16``/``fp16``:

| LLaMA-Factory field (its default) | memfit |
|---|---|
| ``model_name_or_path`` | the workload: a hub id or a model folder, its config.json alone |
| ``stage`` (``sft``): ``sft``, ``pt`` | the step on ``cutoff_len`` tokens (``rm``, ``ppo``, ``dpo``, ``kto``: refused) |
| ``finetuning_type`` (``lora``): ``lora``, ``full`` | ``adapter: lora:...`` (``dora`` with ``use_dora``); none (``freeze``, ``oft``: refused) |
| ``lora_rank`` (8), ``lora_alpha`` (twice the rank), ``lora_dropout`` | the adapter's ``r``, ``alpha``, ``dropout`` |
| ``lora_target`` (``all``); ``additional_target`` | ``targets=linear-modules`` (its ``find_all_linear_modules``: linear layers by class, not ``lm_head``) or the names; ``save`` |
| ``quantization_bit`` 4 / 8 (``quantization_method: bnb``) | ``base_weights: nf4:double_quant=true`` (``quantization_type``, ``double_quantization``) / ``int8`` |
| ``cutoff_len`` (2048) | the sequence length (``packing`` or not: the longest sample) |
| ``per_device_train_batch_size`` (8) x ``gradient_accumulation_steps`` (1) | the batch, in micro-batches of the first; a rank's |
| ``disable_gradient_checkpointing`` (false), ``use_reentrant_gc`` (true); ``use_unsloth_gc`` | ``checkpointing: blocks:reentrant=true`` (``blocks`` where ``use_reentrant_gc: false``); ``checkpointing: blocks`` and ``offload: activations`` (each checkpointed layer's input on the host) |
| ``bf16`` / ``fp16`` / ``pure_bf16`` | full: ``bf16`` / ``fp16`` (fp32 weights under autocast) / ``bf16-pure``; an adapter: ``bf16-base`` / ``fp16-base`` / ``bf16-pure``; none of them: fp32, or an adapter over the 16-bit checkpoint without autocast (``bf16-base-noautocast``) |
| ``optim`` (``adamw_torch``) | TrainingArguments' names memfit runs (``paged_adamw_8bit``: ``adamw8bit-paged``, ...) |
| ``use_galore``, ``use_apollo`` (``*_rank``, ``*_update_interval``, ``*_scale``, ``*_layerwise``) | ``optimizer: galore:...`` (``galore8bit`` with ``adamw_bnb_8bit``), ``apollo:...`` (``apollo-mini`` for ``apollo_scale_type: tensor``); layerwise: ``optimizer_in_backward`` |
| ``max_grad_norm`` (1.0); ``torch_compile`` | ``max_grad_norm``; ``compile: full`` |
| ``enable_liger_kernel`` | ``loss_chunks``: Liger's fused linear cross-entropy in its own slices (its other kernels predicted as the model's own, said) |

What the estimate ignores, and how it says so:

- **Refused, one line** (ignoring them would mislead): ``deepspeed`` (memfit shards with FSDP2: ``--world-size``),
  preference and reward stages, ``freeze`` and ``oft`` fine-tuning, BAdam, Adam-mini and Muon, HQQ and EETQ
  quantization, KTransformers, Megatron, an optimizer memfit does not run.
- **Ignored in silence**: fields of the run around the step (data, template, schedule, logging, saving,
  evaluation, the hub: :data:`NO_MEMORY_EFFECT`), LoRA's initialisation and learning rates (``pissa_init``,
  ``use_rslora``, ``loraplus_lr_ratio``), and ``flash_attn`` of a fused kernel (memfit's CUDA model already takes them).
- **Ignored with a warning**: any other field set to other than its default, one line naming it.
"""

from __future__ import annotations

from memfit.devices import Device
from memfit.errors import UserError
from memfit.integrations.axolotl import liger_chunks
from memfit.integrations.configs import TrainingConfig, module_names, reentrant_set_aside, text_config, whole
from memfit.plans import Plan
from memfit.techniques.optimizer_variant import TRAINERS_OPTIM_NAMES

REFUSED = {
    "deepspeed": "memfit does not model DeepSpeed's ZeRO stages; remove deepspeed from the config (memfit shards "
                 "with FSDP2: give --world-size N)",
    "use_badam": "memfit does not run BAdam; remove use_badam (memfit's low-rank optimizers: use_galore, use_apollo)",
    "use_adam_mini": "memfit does not run Adam-mini; remove use_adam_mini to estimate AdamW",
    "use_muon": "memfit does not run Muon; remove use_muon to estimate AdamW",
    "use_kt": "memfit does not model KTransformers' CPU experts; remove use_kt",
    "use_mca": "memfit does not model Megatron-Core; remove use_mca (memfit shards with FSDP2: --world-size N)",
    "use_megatron_bridge": "memfit does not model Megatron; remove use_megatron_bridge (memfit shards with FSDP2: "
                           "--world-size N)",
    "use_hyper_parallel": "memfit does not model HyperParallel; remove use_hyper_parallel",
    "mixture_of_depths": "memfit does not model mixture-of-depths layers; remove mixture_of_depths",
    "use_llama_pro": "memfit does not model LLaMA Pro's expanded blocks; remove use_llama_pro",
}
"""Fields whose meaning memfit cannot carry (set true or to a value), and the fix."""

STAGES = ("sft", "pt")
NO_MEMORY_EFFECT = frozenset("""
do_train do_eval do_predict trust_remote_code dataset eval_dataset dataset_dir media_dir template max_samples
overwrite_cache preprocessing_num_workers preprocessing_batch_size dataloader_num_workers dataloader_pin_memory
dataloader_persistent_workers output_dir logging_steps logging_dir save_steps save_strategy save_total_limit
save_only_model plot_loss overwrite_output_dir report_to run_name learning_rate num_train_epochs max_steps
lr_scheduler_type lr_scheduler_kwargs warmup_ratio warmup_steps weight_decay adam_beta1 adam_beta2 adam_epsilon
ddp_timeout ddp_find_unused_parameters resume_from_checkpoint val_size per_device_eval_batch_size eval_strategy
eval_steps eval_on_each_dataset seed data_seed streaming buffer_size mix_strategy interleave_probs tokenized_path
train_on_prompt mask_history packing neat_packing tool_format default_system enable_thinking ignore_pad_token_for_loss
pissa_init pissa_iter pissa_convert use_rslora loraplus_lr_ratio loraplus_lr_embedding create_new_adapter
adapter_name_or_path adapter_folder cache_dir use_fast_tokenizer split_special_tokens model_revision
low_cpu_mem_usage hf_hub_token ms_hub_token om_hub_token print_param_status push_to_hub hub_model_id hub_strategy
include_num_input_tokens_seen include_tokens_per_second include_effective_tokens_per_second compute_accuracy
disable_shuffling early_stopping_steps use_swanlab swanlab_project swanlab_workspace swanlab_run_name swanlab_mode
swanlab_api_key swanlab_logdir swanlab_lark_webhook_url swanlab_lark_secret gradient_checkpointing
gradient_checkpointing_kwargs moe_aux_loss_coef predict_with_generate remove_unused_columns
label_names tf32 logging_first_step eval_num_beams generation_max_length
""".split())
"""Fields of the run around the step, or without an effect on the training step's memory (ignored without a
word). ``gradient_checkpointing`` (TrainingArguments'): LLaMA-Factory checkpoints by its own
``disable_gradient_checkpointing``, whatever this says. A multimodal model's fields (``freeze_vision_tower``,
``image_max_pixels``...) are not here: what trains and how many image tokens a sample holds are memory, and
memfit does not map them (a warning names each)."""

MAPPED = frozenset("""
model_name_or_path stage finetuning_type lora_rank lora_alpha lora_dropout lora_target additional_target use_dora
quantization_bit quantization_method quantization_type double_quantization cutoff_len per_device_train_batch_size
gradient_accumulation_steps disable_gradient_checkpointing use_unsloth_gc use_reentrant_gc bf16 fp16 pure_bf16 optim use_galore
galore_target galore_rank galore_update_interval galore_scale galore_proj_type galore_layerwise use_apollo apollo_target
apollo_rank apollo_update_interval apollo_scale apollo_proj apollo_proj_type apollo_scale_type apollo_layerwise
apollo_scale_front max_grad_norm torch_compile enable_liger_kernel flash_attn
""".split())
FUSED_ATTENTION = ("auto", "sdpa", "fa2", "fa3", "flash_attention_2", "flash_attention_3")
"""``flash_attn`` values whose kernels hold no [heads, T, T] matrix (``auto``: transformers' SDPA)."""
MEGATRON = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
            "context_parallel_size", "use_distributed_optimizer", "sequence_parallel")
"""Megatron-Core's fields (a config LLaMA-Factory trains with ``USE_MCA=1``)."""
OPTIMIZERS = {**TRAINERS_OPTIM_NAMES, "sgd": "sgd"}
GALORE_8BIT = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")
"""The ``optim`` names LLaMA-Factory's GaLore steps as ``GaLoreAdamW8bit`` (``adamw_torch``: ``GaLoreAdamW``; APOLLO
takes ``adamw_torch`` alone)."""


def is_llamafactory(data: object) -> bool:
    """A LLaMA-Factory config: ``model_name_or_path`` at the top (axolotl's is ``base_model``)."""
    return isinstance(data, dict) and "model_name_or_path" in data and "base_model" not in data


def is_llamafactory_v1(data: object) -> bool:
    """A config of LLaMA-Factory's v1 trainer (``model:`` and ``model_class:``), which memfit does not read."""
    return isinstance(data, dict) and "model" in data and "model_class" in data and "base_model" not in data


def map_config(data: dict, where: str, device: Device) -> TrainingConfig:
    """A LLaMA-Factory config's fields (a parsed YAML mapping) as memfit's workload, sizes and plan."""
    data = {key: value for key, value in data.items() if value not in (None, "", [], {})}  # (empty: as if absent)
    for key, fix in REFUSED.items():
        if data.get(key) not in (None, False):
            raise UserError(f"--from {where}: {key}: {fix}")
    for key in MEGATRON:
        if key in data:
            raise UserError(f"--from {where}: {key}: a Megatron-Core config (USE_MCA=1); memfit does not model Megatron "
                            "(it shards with FSDP2: give --world-size N); remove the Megatron fields")
    model = data.get("model_name_or_path")
    if not isinstance(model, str) or not model.strip():
        raise UserError(f"--from {where}: model_name_or_path must name the model it trains (a hub id or a folder)")
    model = model.strip()
    stage = data.get("stage", "sft")
    if stage not in STAGES:
        raise UserError(f"--from {where}: stage: {stage}: memfit traces supervised fine-tuning and pre-training (sft, "
                        "pt); reward models and preference training hold pairs or other models; set stage: sft to "
                        "estimate the SFT step")
    warnings = [f"LLaMA-Factory config {where}: {key} is not mapped; the estimate ignores it"
                for key, value in data.items()
                if key not in MAPPED and key not in NO_MEMORY_EFFECT and key not in REFUSED and value is not False]
    if data.get("do_train") is not True:
        warnings.append(f"LLaMA-Factory config {where}: do_train is not true, so LLaMA-Factory would not train; the "
                        "estimate is of the step it trains with do_train: true")
    micro = whole(data, "per_device_train_batch_size", where, 8)
    accum = whole(data, "gradient_accumulation_steps", where, 1)
    seq = whole(data, "cutoff_len", where, 2048)
    method = _method(data, where)
    fields = {**method, **_precision(data, where, model, "adapter" in method), **_optimizer(data, where, warnings)}
    fields.update(_checkpointing(data))
    norm = data.get("max_grad_norm", 1.0)
    if not isinstance(norm, (int, float)) or isinstance(norm, bool) or norm < 0:
        raise UserError(f"--from {where}: max_grad_norm must be a number >= 0, got {norm!r}")
    if norm > 0 and not fields.get("optimizer_in_backward"):  # (0 clips nothing; nor per-layer GaLore or APOLLO:
        fields["max_grad_norm"] = float(norm)                    # the Trainer finds no gradient left to clip)
    if data.get("torch_compile"):
        fields["compile"] = "full"
    if data.get("flash_attn", "auto") not in FUSED_ATTENTION:
        warnings.append(f"LLaMA-Factory config {where}: flash_attn: {data['flash_attn']} is not mapped; the estimate "
                        "predicts the model's attention with SDPA's fused kernels")
    if data.get("enable_liger_kernel"):
        chunks = liger_chunks(model, micro * seq)
        fields["loss_chunks"] = chunks or 8
        warnings.append(f"LLaMA-Factory config {where}: enable_liger_kernel: Liger's fused linear cross-entropy "
                        f"predicted as memfit's chunked loss in {fields['loss_chunks']} slices of the micro-batch's "
                        "tokens; its RMSNorm, SwiGLU and RoPE kernels are predicted as the model's own")
    if accum > 1:
        fields["micro_batch_size"] = micro
    warnings.extend(reentrant_set_aside(fields, where, "LLaMA-Factory"))
    try:
        plan = Plan(**fields)
    except UserError as e:
        raise UserError(f"--from {where}: {str(e).removeprefix('plan: ')}") from None
    return TrainingConfig(where, model, micro * accum, micro, seq, plan, tuple(warnings), batch_per_rank=True)


def _method(data: dict, where: str) -> dict:
    """finetuning_type, lora_*, quantization_* -> the plan's adapter and base_weights."""
    kind = data.get("finetuning_type", "lora")
    if kind not in ("lora", "full"):
        raise UserError(f"--from {where}: finetuning_type: {kind}: memfit trains the whole model or a LoRA; use "
                        "finetuning_type: lora or full")
    weights = _base_weights(data, where)
    if kind == "full":
        if weights:
            raise UserError(f"--from {where}: quantization_bit with finetuning_type: full trains frozen weights "
                            "(LLaMA-Factory refuses it); use finetuning_type: lora")
        return {}
    rank = whole(data, "lora_rank", where, 8)
    options = [f"r={rank}", f"alpha={data.get('lora_alpha') or 2 * rank}"]  # (LLaMA-Factory's alpha: twice the rank)
    targets = module_names(data, "lora_target", where, commas=True) if "lora_target" in data else ["all"]
    options.append("targets=" + ("linear-modules" if targets == ["all"] else "+".join(targets)))
    if data.get("lora_dropout"):
        options.append(f"dropout={data['lora_dropout']}")
    if data.get("additional_target"):
        options.append("save=" + "+".join(module_names(data, "additional_target", where, commas=True)))
    out = {"adapter": f"{'dora' if data.get('use_dora') else 'lora'}:{','.join(options)}"}
    if weights:
        out["base_weights"] = weights
    return out


def _base_weights(data: dict, where: str) -> str | None:
    """``quantization_bit`` (bitsandbytes' on-the-fly quantization while loading) -> the plan's base_weights."""
    bits = data.get("quantization_bit")
    if bits is None:
        return None
    method = data.get("quantization_method", "bnb")
    if method != "bnb":
        raise UserError(f"--from {where}: quantization_method: {method}: memfit models bitsandbytes' 4- and 8-bit "
                        "weights; use quantization_method: bnb")
    if bits == 8:
        return "int8"
    if bits != 4:
        raise UserError(f"--from {where}: quantization_bit: {bits!r}: bitsandbytes quantizes to 4 or 8 bits")
    kind = data.get("quantization_type", "nf4")
    if kind not in ("nf4", "fp4"):
        raise UserError(f"--from {where}: quantization_type: {kind!r} is not bitsandbytes'; write nf4 or fp4")
    return f"{kind}:double_quant={'true' if data.get('double_quantization', True) else 'false'}"


def _precision(data: dict, where: str, model: str, adapter: bool) -> dict:
    """bf16 / fp16 / pure_bf16 -> the plan's precision (the module's table): LLaMA-Factory loads the checkpoint in
    its own dtype and, unless ``pure_bf16``, upcasts what trains to fp32."""
    bf16, fp16, pure = bool(data.get("bf16")), bool(data.get("fp16")), bool(data.get("pure_bf16"))
    if bf16 and fp16:
        raise UserError(f"--from {where}: bf16 and fp16 are both set; keep one")
    if pure:
        return {"precision": "bf16-pure"}
    half = "bf16" if bf16 else "fp16" if fp16 else None
    checkpoint = checkpoint_dtype(model)
    if not adapter:  # (the whole model upcast to fp32, under the Trainer's autocast if any)
        return {"precision": half} if half else {}
    if checkpoint == "float32":  # (a checkpoint saved in fp32 loads so: autocast over fp32 weights, or none)
        return {"precision": half} if half else {}
    if half:
        return {"precision": f"{half}-base"}
    return {"precision": f"{'fp16' if checkpoint == 'float16' else 'bf16'}-base-noautocast"}


def checkpoint_dtype(model: str) -> str | None:
    """The dtype ``from_pretrained(torch_dtype="auto")`` loads ``model`` in (its config's ``torch_dtype``, or
    transformers 5's ``dtype``); None where the config cannot be read here."""
    config = text_config(model)
    if config is None:
        return None
    value = config.get("torch_dtype") or config.get("dtype")
    return value if isinstance(value, str) else None


def _checkpointing(data: dict) -> dict:
    """LLaMA-Factory checkpoints each decoder layer unless ``disable_gradient_checkpointing``, with torch's
    reentrant checkpoint unless ``use_reentrant_gc: false`` (memfit.techniques.reentrant_checkpoint); Unsloth's
    checkpointing (``use_unsloth_gc``) holds each checkpointed layer's input on the host."""
    if data.get("disable_gradient_checkpointing"):
        return {}
    if data.get("use_unsloth_gc"):
        return {"checkpointing": "blocks", "offload": ["activations"]}
    return {"checkpointing": "blocks:reentrant=true" if data.get("use_reentrant_gc", True) else "blocks"}


def _optimizer(data: dict, where: str, warnings: list[str]) -> dict:
    """``optim``, or GaLore / APOLLO over it (LLaMA-Factory's ``use_galore``, ``use_apollo``)."""
    name = data.get("optim", "adamw_torch")
    if name not in OPTIMIZERS:
        raise UserError(f"--from {where}: optim {name!r} is not one memfit runs; use one of {', '.join(OPTIMIZERS)}")
    for family in ("galore", "apollo"):
        if data.get(f"use_{family}"):
            return _low_rank(data, where, family, name, warnings)
    return {} if name == "adamw_torch" else {"optimizer": OPTIMIZERS[name]}


def _low_rank(data: dict, where: str, family: str, optim: str, warnings: list[str]) -> dict:
    """GaLore's or APOLLO's fields -> memfit's ``galore:...`` / ``apollo:...`` (projected: the linear layers of the
    model's repeated blocks, as ``*_target: all`` takes every linear layer but the output)."""
    if data.get("finetuning_type", "lora") != "full":
        raise UserError(f"--from {where}: use_{family} trains the whole model (LLaMA-Factory refuses it with LoRA); "
                        "set finetuning_type: full")
    eight_bit = family == "galore" and optim in GALORE_8BIT
    if optim != "adamw_torch" and not eight_bit:
        raise UserError(f"--from {where}: {family} with optim {optim!r} is not one memfit runs; use adamw_torch"
                        + (" or adamw_bnb_8bit" if family == "galore" else ""))
    rank = whole(data, f"{family}_rank", where, 16)
    tensor_wise = family == "apollo" and data.get("apollo_scale_type", "channel") == "tensor"
    name = "galore8bit" if eight_bit else "apollo-mini" if tensor_wise else family
    scale = data.get(f"{family}_scale", 2.0 if family == "galore" else 32.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise UserError(f"--from {where}: {family}_scale must be a number > 0, got {scale!r}")
    options = [f"rank={rank}", f"update_proj_gap={whole(data, f'{family}_update_interval', where, 200)}",
               f"scale={scale:g}"]
    for key, default in ((f"{family}_target", "all"), (f"{family}_proj_type", "std"), ("apollo_proj", "random")):
        if key.startswith(family) and data.get(key, default) != default:
            warnings.append(f"LLaMA-Factory config {where}: {key}: {data[key]} is not mapped; memfit projects every "
                            f"linear layer of the blocks, {default}")
    out = {"optimizer": f"{name}:{','.join(options)}"}
    if data.get(f"{family}_layerwise"):  # (a hook per parameter steps it in backward: memfit's in-backward step)
        if data.get("gradient_accumulation_steps", 1) != 1:
            raise UserError(f"--from {where}: {family}_layerwise steps each parameter in backward, without "
                            "accumulation (LLaMA-Factory refuses it); set gradient_accumulation_steps: 1")
        out["optimizer_in_backward"] = True
    return out
