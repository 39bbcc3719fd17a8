"""A plan as the fields of a LLaMA-Factory config: ``memfit plan ... --format llamafactory`` prints the YAML fields
that run the plan memfit chose (the inverse of memfit.integrations.llamafactory's table), what LLaMA-Factory has no
field for, and what the user's own setup must hold.

LLaMA-Factory's fields are TrainingArguments' and peft's under its own names, so the fields each technique writes
for axolotl (memfit.integrations.axolotl_export: the same Trainer and peft underneath) are renamed here: micro-batches,
checkpointing and its offloaded inputs (Unsloth's checkpointing, ``use_unsloth_gc``), the optimizer's
TrainingArguments name, compile, Liger's chunked loss. What differs is written from the plan itself: the precision
(LLaMA-Factory upcasts what trains to fp32 unless ``pure_bf16``, and loads the checkpoint in its own dtype), the
adapter (its default alpha is twice the rank, its default targets every linear layer), the 4-bit formats
(``quantization_type``, ``double_quantization``), GaLore and APOLLO (``use_galore``, per layer with the optimizer in
backward), checkpointing left off (its default is on) and clipping (its default is 1.0). Each field is one
:func:`memfit.integrations.llamafactory.map_config` reads back into the same plan (a test holds the round trip).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.devices import Device
from memfit.plans import Plan

RENAMED = {"micro_batch_size": "per_device_train_batch_size", "gradient_accumulation_steps": "gradient_accumulation_steps",
           "optimizer": "optim", "torch_compile": "torch_compile", "activation_offloading": "use_unsloth_gc",
           "liger_fused_linear_cross_entropy": "enable_liger_kernel"}
"""axolotl's fields -> LLaMA-Factory's, where the same Trainer argument or kernel is meant."""
AXOLOTLS_OWN = ("plugins:", "max_grad_norm:", "axolotl's qlora")
"""axolotl's notes of what its fields cannot say, which LLaMA-Factory's fields say: its Liger plugin
(``enable_liger_kernel``), clipping left at its default (``max_grad_norm`` is written), double quantization always
on (``double_quantization`` is written)."""
WRITTEN_HERE = ("precision", "base_weights", "adapter", "max_grad_norm")
"""Plan keys this module writes itself (axolotl's list of what it cannot carry is not theirs)."""


@dataclass(frozen=True)
class LlamaFactoryFields:
    """A plan's LLaMA-Factory fields, and what they cannot carry."""

    fields: dict
    unmapped: tuple[str, ...]
    """Plan settings LLaMA-Factory has no field for (as plan keys)."""
    notes: tuple[str, ...]

    def yaml(self) -> str:
        import yaml
        return yaml.safe_dump(self.fields, sort_keys=False, default_flow_style=False).rstrip()


def to_llamafactory(plan: Plan, batch_size: int, model: str, seq_len: int | None,
                    device: Device | str | None = None) -> LlamaFactoryFields:
    """``plan`` at ``batch_size`` (one device's) for ``model`` (a hub id or folder) as LLaMA-Factory's fields."""
    from memfit.integrations.axolotl_export import to_axolotl
    from memfit.integrations.llamafactory import checkpoint_dtype
    axolotl = to_axolotl(plan, batch_size, model, seq_len, device)
    adapter, unmapped = _adapter(plan)
    fields = {"model_name_or_path": model, "stage": "sft", "do_train": True, **adapter, **_base_weights(plan, unmapped),
              **({"cutoff_len": seq_len} if seq_len else {})}
    low_rank = _low_rank(plan)
    for key, value in axolotl.fields.items():
        if key in RENAMED and not (low_rank and key == "optimizer"):
            fields[RENAMED[key]] = value
    fields.setdefault("per_device_train_batch_size", batch_size)
    if fields.get("optim") == "adamw_torch":
        del fields["optim"]  # (LLaMA-Factory's default)
    if not axolotl.fields.get("gradient_checkpointing"):
        fields["disable_gradient_checkpointing"] = True
    elif not axolotl.fields.get("activation_offloading") and \
            not axolotl.fields.get("gradient_checkpointing_kwargs", {}).get("use_reentrant"):
        fields["use_reentrant_gc"] = False  # (LLaMA-Factory's default is torch's reentrant checkpoint)
    resolved = _resolved_precision(plan, device)
    precision = _precision(resolved, checkpoint_dtype(model), adapter["finetuning_type"] == "lora")
    if precision is None:
        unmapped.append(f"precision: {resolved} (LLaMA-Factory loads the checkpoint in its own dtype, "
                        f"{checkpoint_dtype(model) or 'bf16'}, and upcasts what trains to fp32)")
    else:
        fields.update(precision)
    fields.update(low_rank)
    if not fields.get(f"{low_rank_family(fields)}_layerwise"):  # (per layer, the Trainer finds nothing to clip)
        fields["max_grad_norm"] = plan.max_grad_norm or 0.0  # (the Trainer clips at 1.0 unless told 0)
    handled = (*WRITTEN_HERE, *(("optimizer", "optimizer_in_backward") if low_rank else ()))
    unmapped += [u.replace("axolotl", "LLaMA-Factory") for u in axolotl.unmapped if u.split(":", 1)[0] not in handled]
    notes = [n.replace("axolotl", "LLaMA-Factory") for n in axolotl.notes  # (the same Trainer, peft and Liger)
             if not n.startswith(AXOLOTLS_OWN)]
    if fields.get("enable_liger_kernel"):
        notes.append("enable_liger_kernel also swaps in Liger's RMSNorm, SwiGLU and RoPE kernels (memfit predicts the "
                     "model's own: a little over)")
    return LlamaFactoryFields(fields, tuple(unmapped), tuple(notes))


def _adapter(plan: Plan) -> tuple[dict, list[str]]:
    """The adapter's fields (peft's LoRA or DoRA on named layers, or on every linear one), and what they cannot carry."""
    from memfit.techniques.adapter import LINEAR_MODULES, LoRA
    config = plan.config("adapter")
    if config.is_default:
        return {"finetuning_type": "full"}, []
    if type(config) is not LoRA or config.params or config.skip or config.only or config.in_blocks or \
            not config.targets or any(t != LINEAR_MODULES and "-" in t for t in config.targets):
        return {"finetuning_type": "lora"}, [f"adapter: {plan.adapter} (LLaMA-Factory's LoRA adapts named layers, or "
                                             "every linear one but the head: lora_target)"]
    named = [t for t in config.targets if t != LINEAR_MODULES]
    alpha = int(config.scale_alpha) if float(config.scale_alpha).is_integer() else config.scale_alpha
    fields = {"finetuning_type": "lora", "lora_rank": config.r, "lora_alpha": alpha,
              "lora_target": "all" if not named else ",".join(named)}
    unmapped = []
    if named and LINEAR_MODULES in config.targets:
        unmapped.append(f"adapter: {plan.adapter} (lora_target is all, or names)")
    if config.dropout:
        fields["lora_dropout"] = config.dropout
    if config.save:
        fields["additional_target"] = ",".join(config.save)
    if config.dora:
        fields["use_dora"] = True
    return fields, unmapped


def _base_weights(plan: Plan, unmapped: list[str]) -> dict:
    """bitsandbytes' 4- and 8-bit weights, quantized while loading (``quantization_bit``)."""
    kind, _, options = plan.base_weights.partition(":")
    if kind == "as-is":
        return {}
    if kind == "int8":
        return {"quantization_bit": 8}
    if kind in ("nf4", "fp4") and "experts=true" not in options:
        return {"quantization_bit": 4, "quantization_type": kind, "double_quantization": "double_quant=true" in options}
    unmapped.append(f"base_weights: {plan.base_weights} (LLaMA-Factory quantizes with bitsandbytes' nf4, fp4 or int8, "
                    "not a mixture's 3-D experts)")
    return {}


def _resolved_precision(plan: Plan, device: Device | str | None) -> str:
    """The plan's precision on ``device`` (``auto``: bf16 where the card has it)."""
    if device is None:
        return plan.precision
    from memfit.devices import get_device
    return plan.config("precision").resolve(get_device(device)).values().get("precision", plan.precision)


def _precision(precision: str, checkpoint: str | None, adapter: bool) -> dict | None:
    """The precision flags that run ``precision`` (None: none do). An adapter trains in fp32 over the checkpoint's own
    dtype (``bf16``/``fp16`` autocast, or none), or in bf16 with ``pure_bf16``; full fine-tuning upcasts the whole
    model to fp32 (``bf16``/``fp16`` autocast) unless ``pure_bf16``."""
    if precision == "bf16-pure":
        return {"pure_bf16": True}
    half = checkpoint in (None, "bfloat16", "float16")  # (a checkpoint's dtype not read: taken as 16 bits, as --from)
    loads = {"bf16-base": half, "fp16-base": half, "bf16-base-noautocast": checkpoint in (None, "bfloat16"),
             "fp16-base-noautocast": checkpoint == "float16", "bf16": not half, "fp16": not half,
             "fp32": not half} if adapter else {"bf16": True, "fp16": True, "fp32": True}
    if not loads.get(precision):
        return None
    return {"bf16": True} if precision.startswith("bf16") and "noautocast" not in precision else \
        {"fp16": True} if precision.startswith("fp16") and "noautocast" not in precision else {}


def low_rank_family(fields: dict) -> str | None:
    """``galore`` or ``apollo`` where the fields use one."""
    return next((family for family in ("galore", "apollo") if fields.get(f"use_{family}")), None)


def _low_rank(plan: Plan) -> dict:
    """GaLore's or APOLLO's fields (``use_galore``...; per layer: ``*_layerwise``), or none."""
    from memfit.techniques.optimizers_lowrank import LowRankVariant
    config = plan.config("optimizer")
    if not isinstance(config, LowRankVariant):
        return {}
    family = config.name.split("-")[0].removesuffix("8bit")
    fields = {f"use_{family}": True, f"{family}_rank": config.projection_rank,
              f"{family}_update_interval": config.update_proj_gap, f"{family}_scale": config.scale}
    if config.name == "apollo-mini":
        fields["apollo_scale_type"] = "tensor"
    if config.name == "galore8bit":
        fields["optim"] = "adamw_bnb_8bit"
    if plan.optimizer_in_backward:
        fields[f"{family}_layerwise"] = True
    return fields
