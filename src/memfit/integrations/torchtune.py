"""A torchtune recipe config (YAML, ``tune run full_finetune_single_device --config ...``) read as the workload and
the plan it trains: ``memfit estimate --from 8B_full_single_device.yaml`` (and ``plan``).

torchtune (pytorch/torchtune, read at bd2a0fc of its ``recipes/configs``) builds its own modules from a builder
(``model._component_``) and loads the Hugging Face checkpoint its config names (``checkpointer.checkpoint_dir``, which
``tune download <hub id>``, in each config's comments, fills). memfit traces the same checkpoint as transformers
builds it from its ``config.json``: the same weights; torchtune's own modules may keep slightly other activations
(its RoPE cache, its RMSNorm in fp32), said in a line. Its single-device recipes train in one dtype, every weight,
adapter and optimizer state in it:

| torchtune field | memfit |
|---|---|
| ``checkpointer.checkpoint_dir`` (with its config.json); else the ``tune download`` id in the config's comments | the workload: that folder, or that hub id (a model named beside ``--from`` wins) |
| ``model._component_`` ``..._<builder>``; ``lora_...``; ``qlora_...`` | the method: full; ``adapter: lora:...``; the same over ``base_weights: nf4:double_quant=true`` (torchao's NF4: 4 bits a weight, an 8-bit scale per 64, an fp32 scale per 256 of those, as bitsandbytes' double quantization) |
| ``lora_rank``, ``lora_alpha``, ``lora_dropout``; ``lora_attn_modules``, ``apply_lora_to_mlp``, ``apply_lora_to_output`` | the adapter's ``r``, ``alpha``, ``dropout``; ``targets``: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (its ``output_proj``), ``gate_proj``, ``up_proj``, ``down_proj`` (its ``w1``, ``w3``, ``w2``), ``lm_head``; Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` for theirs (:data:`FUSED`) |
| ``batch_size`` x ``gradient_accumulation_steps`` | the batch, in micro-batches of the first |
| ``tokenizer.max_seq_len`` | the sequence length (null, its default: each batch as long as its longest sample; ``--seq-len`` says) |
| ``dtype`` (bf16, fp32) | ``precision: bf16-pure`` (every weight, gradient and state in bf16), ``fp32`` |
| ``enable_activation_checkpointing``; ``ac_mode``, ``ac_option`` | ``checkpointing: blocks`` (each layer, non-reentrant); ``selective`` with ``ac_option`` N: ``blocks:every=N`` |
| ``enable_activation_offloading`` | ``offload: activations`` |
| ``optimizer._component_``; ``optimizer_in_bwd`` | ``adamw`` (torch's AdamW), bitsandbytes' ``AdamW8bit``/``PagedAdamW8bit``/``PagedAdamW``, torchao's ``AdamW8bit``/``AdamW4bit``, ``sgd``; ``optimizer_in_backward`` |
| ``loss._component_`` | ``LinearCrossEntropyLoss`` and ``CEWithChunkedOutputLoss``: ``loss_chunks`` (its ``num_output_chunks``, 8) |
| ``compile`` | ``compile: blocks`` (torchtune compiles each layer and the loss) |
| ``clip_grad_norm`` | ``max_grad_norm`` |

Refused in one line: the distributed recipes' sharding and parallelism fields (memfit shards with FSDP2 over
``--world-size``), QAT's ``quantizer``, distillation's teacher, multimodal builders. Fields of the run around the step
(data, logging, saving, schedule, profiling) are ignored in silence; any other field is named in a warning.
"""

from __future__ import annotations

import re
from pathlib import Path

from memfit.devices import Device
from memfit.errors import UserError
from memfit.integrations.configs import TrainingConfig, text_config, whole
from memfit.plans import Plan

NO_MEMORY_EFFECT = frozenset("""
output_dir tokenizer dataset dataset_val seed shuffle run_val_every_n_steps batch_size_val resume_from_checkpoint
save_adapter_weights_only epochs max_steps_per_epoch lr_scheduler device metric_logger log_every_n_steps
log_peak_memory_stats log_level profiler low_cpu_ram collate_fn checkpointer
""".split())
"""Fields of the run around the step (``tokenizer`` and ``checkpointer`` are read for the length and the model)."""
MAPPED = frozenset("""
model batch_size gradient_accumulation_steps optimizer optimizer_in_bwd loss clip_grad_norm compile
enable_activation_checkpointing enable_activation_offloading ac_mode ac_option dtype
""".split())
REFUSED = {
    "tensor_parallel_dim": "tensor parallelism is not modelled", "tensor_parallel_plan": "tensor parallelism is not "
    "modelled", "data_parallel_shard_dim": "a distributed recipe's sharding", "data_parallel_replicate_dim": "a "
    "distributed recipe's replicas", "fsdp_cpu_offload": "a distributed recipe's FSDP", "custom_sharded_layers": "a "
    "distributed recipe's FSDP", "fsdp": "a distributed recipe's FSDP", "quantizer": "quantization-aware training is "
    "not modelled", "teacher_model": "knowledge distillation (a second model) is not modelled",
}
ATTENTION = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP = ("gate_proj", "up_proj", "down_proj")
OPTIMIZERS = {"torch.optim.AdamW": "adamw", "torch.optim.SGD": "sgd", "bitsandbytes.optim.AdamW8bit": "adamw8bit",
              "bitsandbytes.optim.PagedAdamW8bit": "adamw8bit-paged", "bitsandbytes.optim.PagedAdamW": "adamw-paged",
              "bitsandbytes.optim.PagedAdamW32bit": "adamw-paged", "torchao.optim.AdamW8bit": "adamw8bit-ao",
              "torchao.optim.AdamW4bit": "adamw4bit-ao"}
FUSED = {"phi3": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                  "up_proj": "gate_up_proj"}}
"""transformers' model types whose projections torchtune's modules keep apart: torchtune's name -> the fused layer."""
CHUNKED_LOSSES = ("LinearCrossEntropyLoss", "CEWithChunkedOutputLoss")
OUTPUT_CHUNKS = 8
"""torchtune's ``num_output_chunks`` default."""
DOWNLOAD = re.compile(r"tune download\s+([\w.-]+/[\w.-]+)")


def is_torchtune(data: object) -> bool:
    """A torchtune config: its model a ``torchtune.models`` builder."""
    model = data.get("model") if isinstance(data, dict) else None
    return isinstance(model, dict) and str(model.get("_component_", "")).startswith("torchtune.models.")


def map_config(data: dict, where: str, device: Device, text: str = "", workload: str | None = None) -> TrainingConfig:
    """A torchtune config's fields (``text``: the file as written, whose comments name the model it downloads)."""
    for key, why in REFUSED.items():
        if data.get(key) not in (None, False):
            raise UserError(f"--from {where}: {key}: {why}; memfit reads torchtune's single-device recipes (shard "
                            "with memfit's --world-size)")
    warnings = [f"torchtune config {where}: {key} is not mapped; the estimate ignores it"
                for key, value in data.items() if key not in MAPPED and key not in NO_MEMORY_EFFECT and value is not False]
    model = data["model"]
    builder = str(model["_component_"]).rsplit(".", 1)[-1]
    if "vision" in str(model["_component_"]) or "decoder_trainable" in model:
        raise UserError(f"--from {where}: model {model['_component_']}: torchtune's multimodal builders are not read; "
                        "estimate the model's own config")
    micro = whole(data, "batch_size", where, 1)
    accum = whole(data, "gradient_accumulation_steps", where, 1)
    name = workload or _model_of(data, builder, text, where)
    fields = {**_method(model, builder, where, _fused(name, where, warnings)), **_precision(data, where),
              **_checkpointing(data, where), **_optimizer(data, where), **_loss(data)}
    if data.get("enable_activation_offloading"):
        fields["offload"] = ["activations"]
    if data.get("compile"):
        fields["compile"] = "blocks"
    if data.get("clip_grad_norm") is not None:
        fields["max_grad_norm"] = float(data["clip_grad_norm"])
    if accum > 1:
        fields["micro_batch_size"] = micro
    tokenizer = data.get("tokenizer") if isinstance(data.get("tokenizer"), dict) else {}
    seq = tokenizer.get("max_seq_len")
    if seq is None:
        warnings.append(f"torchtune config {where}: tokenizer.max_seq_len is null (each batch as long as its longest "
                        "sample): give the length with --seq-len")
    else:
        seq = whole(tokenizer, "max_seq_len", where, None)
    if fields.get("base_weights"):
        warnings.append(f"torchtune config {where}: torchao's NF4 weights predicted as bitsandbytes' NF4 with double "
                        "quantization (the same bits a weight; its dequantization temporaries as bitsandbytes')")
    try:
        plan = Plan(**fields)
    except UserError as e:
        raise UserError(f"--from {where}: {str(e).removeprefix('plan: ')}") from None
    return TrainingConfig(where, name, micro * accum, micro, seq, plan, tuple(warnings))


def _model_of(data: dict, builder: str, text: str, where: str) -> str:
    """The checkpoint torchtune loads: ``checkpoint_dir`` where it holds a config.json, else the hub id that the
    config's ``tune download`` comment names."""
    checkpointer = data.get("checkpointer") if isinstance(data.get("checkpointer"), dict) else {}
    folder = checkpointer.get("checkpoint_dir")
    if folder and (Path(str(folder)) / "config.json").is_file():
        return str(folder)
    found = DOWNLOAD.search(text)
    if found:
        return found.group(1)
    raise UserError(f"--from {where}: model {builder}: its checkpoint_dir {folder!r} holds no config.json and the "
                    "config names no `tune download` id; name the model beside it (memfit estimate <hub id or folder> "
                    f"--from {Path(where).name})")


def _fused(name: str, where: str, warnings: list[str]) -> dict:
    """torchtune's projections -> the layers that hold them in transformers' model of the checkpoint: Phi-3's (and
    Phi-4's) attention and MLP projections are fused there (``qkv_proj``, ``gate_up_proj``), where torchtune's own
    modules keep them apart; said in a line."""
    config = text_config(name)
    if not config or config.get("model_type") not in FUSED:
        return {}
    warnings.append(f"torchtune config {where}: {config['model_type']}'s projections are fused in transformers' model "
                    "(qkv_proj, gate_up_proj): LoRA on q/k/v or the MLP's w1/w3 is predicted on the fused layer (one "
                    "adapter: its B matrix as wide as the fused output, a little more than torchtune's)")
    return FUSED[config["model_type"]]


def _method(model: dict, builder: str, where: str, fused: dict) -> dict:
    if not builder.startswith(("lora_", "qlora_")):
        if any(key.startswith("lora_") or key.startswith("apply_lora") for key in model):
            raise UserError(f"--from {where}: model {builder} is no LoRA builder but has LoRA fields; use its lora_ builder")
        return {}
    modules = model.get("lora_attn_modules") or []
    unknown = [m for m in modules if m not in ATTENTION]
    if unknown or not isinstance(modules, list):
        raise UserError(f"--from {where}: lora_attn_modules {unknown or modules!r}: torchtune's are q_proj, k_proj, "
                        "v_proj and output_proj")
    targets = [ATTENTION[m] for m in modules] + (list(MLP) if model.get("apply_lora_to_mlp") else []) + \
        (["lm_head"] if model.get("apply_lora_to_output") else [])
    targets = list(dict.fromkeys(fused.get(t, t) for t in targets))
    if not targets:
        raise UserError(f"--from {where}: model {builder} adapts no layer; set lora_attn_modules or apply_lora_to_mlp")
    rank = model.get("lora_rank", 8)
    options = [f"r={rank}", f"alpha={model.get('lora_alpha', rank)}", "targets=" + "+".join(targets)]
    if model.get("lora_dropout"):
        options.append(f"dropout={model['lora_dropout']}")
    out = {"adapter": "lora:" + ",".join(options)}
    if builder.startswith("qlora_"):
        out["base_weights"] = "nf4:double_quant=true"
    return out


def _precision(data: dict, where: str) -> dict:
    dtype = str(data.get("dtype", "bf16"))
    if dtype not in ("bf16", "fp32"):
        raise UserError(f"--from {where}: dtype {dtype!r}: torchtune trains in bf16 or fp32")
    return {"precision": "bf16-pure" if dtype == "bf16" else "fp32"}


def _checkpointing(data: dict, where: str) -> dict:
    if not data.get("enable_activation_checkpointing"):
        return {}
    mode, option = data.get("ac_mode"), data.get("ac_option")
    if mode in (None, "full") or (mode == "selective" and option in (None, 1)):
        return {"checkpointing": "blocks"}
    if mode == "selective" and isinstance(option, int) and not isinstance(option, bool) and option > 1:
        return {"checkpointing": f"blocks:every={option}"}
    raise UserError(f"--from {where}: ac_mode {mode!r} with ac_option {option!r} is not mapped; use ac_mode: full, or "
                    "selective with a whole ac_option (every N-th layer)")


def _optimizer(data: dict, where: str) -> dict:
    optimizer = data.get("optimizer") if isinstance(data.get("optimizer"), dict) else {}
    component = optimizer.get("_component_")
    out = {"optimizer_in_backward": True} if data.get("optimizer_in_bwd") else {}
    if component is None:
        return out
    if component not in OPTIMIZERS:
        raise UserError(f"--from {where}: optimizer {component}: not one memfit runs; use one of {', '.join(OPTIMIZERS)}")
    return {**out, "optimizer": OPTIMIZERS[component]}


def _loss(data: dict) -> dict:
    loss = data.get("loss") if isinstance(data.get("loss"), dict) else {}
    if str(loss.get("_component_", "")).rsplit(".", 1)[-1] in CHUNKED_LOSSES:
        return {"loss_chunks": int(loss.get("num_output_chunks", OUTPUT_CHUNKS))}
    return {}
