"""A plan as the fields of a torchtune recipe config: ``memfit plan ... --format torchtune`` prints the fields to set
in the user's config (or pass as ``tune run`` overrides, ``key=value``) that run the plan memfit chose: the inverse of
memfit.integrations.torchtune's table, which reads them back into the same plan (a test holds the round trip).

A torchtune config names its model by a builder of torchtune's (``torchtune.models.llama3_1.lora_llama3_1_8b``),
which memfit does not pick for a checkpoint of transformers': the builder's prefix is said (``lora_``, ``qlora_``, or
none for full fine-tuning), its LoRA fields written. What torchtune's single-device recipes run with none of their
fields (16-bit weights under autocast, states on the host, an EMA, selective or reentrant checkpointing, compile of
the whole model...) is listed as plan keys; ``--format torchtune`` searches only the plans it carries, unless the
user fixed such a key (memfit.integrations.export.carried_by).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.integrations import torchtune
from memfit.plans import Plan
from memfit.techniques.checkpointing import BlocksAC

ATTENTION = {ours: theirs for theirs, ours in torchtune.ATTENTION.items()}
"""memfit's (transformers') attention projections -> torchtune's names: the reader's table, turned round."""
MLP = torchtune.MLP
LINEAR_MODULES = ("linear-modules",)
"""memfit's every linear layer of the blocks: torchtune's four attention projections and the MLP."""
PEFTS_DEFAULT = ("q_proj", "v_proj")
"""peft's default LoRA targets for a Llama (memfit's ``lora`` without targets)."""
OPTIMIZERS = {name: component for component, name in reversed(torchtune.OPTIMIZERS.items())}
"""memfit's optimizer -> the first of torchtune's ``_component_`` names the reader takes for it."""
DTYPES = {"bf16-pure": "bf16", "fp32": "fp32"}
"""memfit's precisions that are torchtune's ``dtype``: every weight, gradient and state in it."""
QLORA = Plan(base_weights="nf4:double_quant=true").config("base_weights")
HANDLED = ("adapter", "base_weights", "precision", "checkpointing", "offload", "optimizer", "optimizer_in_backward",
           "loss_chunks", "compile", "max_grad_norm", "micro_batch_size", "grad_accum_steps")
"""Plan keys this module writes (any other set to other than its default is listed as not carried)."""


@dataclass(frozen=True)
class TorchtuneFields:
    """A plan's torchtune config fields, and what they cannot carry."""

    fields: dict
    unmapped: tuple[str, ...]
    """Plan settings torchtune's single-device recipes have no field for (as plan keys)."""
    notes: tuple[str, ...]

    def yaml(self) -> str:
        import yaml
        return yaml.safe_dump(self.fields, sort_keys=False, default_flow_style=False).rstrip()


def to_torchtune(plan: Plan, batch_size: int, seq_len: int | None) -> TorchtuneFields:
    """``plan`` at ``batch_size`` as a torchtune single-device recipe's fields (the module docstring)."""
    values, default = plan.to_dict(), Plan().to_dict()
    unmapped = [f"{key}: {values[key]}" for key in values if key not in HANDLED and values[key] != default[key]]
    micro, steps = plan.micro_batches(batch_size)
    fields: dict = {}
    notes: list[str] = []
    builder = _model(plan, fields, unmapped)
    notes.append(f"model._component_: your model's builder in torchtune, torchtune.models.<family>.{builder}<family>_"
                 f"<size> (e.g. torchtune.models.llama3_1.{builder}llama3_1_8b)")
    fields.update(batch_size=micro, gradient_accumulation_steps=steps)
    if seq_len:
        fields["tokenizer"] = {"max_seq_len": seq_len}
    precision = plan.config("precision")
    dtype = next((d for name, d in DTYPES.items() if precision == Plan(precision=name).config("precision")), None)
    if dtype is None:
        unmapped.append(f"precision: {plan.precision} (torchtune's recipes train every weight in one dtype: "
                        "bf16-pure or fp32)")
    else:
        fields["dtype"] = dtype
    _checkpointing(plan, fields, unmapped)
    offload = plan.config("offload")
    if offload.activations and not offload.states:
        fields["enable_activation_offloading"] = True
    elif not offload.is_default:
        unmapped.append(f"offload: [{', '.join(offload.items)}] (torchtune offloads activations only)")
    component = OPTIMIZERS.get(plan.optimizer)
    if component is None:
        unmapped.append(f"optimizer: {plan.optimizer}")
    else:
        fields["optimizer"] = {"_component_": component}
    fields["optimizer_in_bwd"] = bool(plan.optimizer_in_backward)
    fields["loss"] = {"_component_": "torch.nn.CrossEntropyLoss"} if not plan.loss_chunks else \
        {"_component_": "torchtune.modules.loss.LinearCrossEntropyLoss", "num_output_chunks": plan.loss_chunks}
    compiled = plan.config("compile")
    if compiled == Plan(compile="blocks").config("compile"):
        fields["compile"] = True
    elif not compiled.is_default:
        unmapped.append(f"compile: {compiled.text} (torchtune compiles each layer and the loss: compile: blocks)")
    fields["clip_grad_norm"] = plan.max_grad_norm
    return TorchtuneFields(fields, tuple(unmapped), tuple(notes))


def _model(plan: Plan, fields: dict, unmapped: list[str]) -> str:
    """The model's LoRA fields; the builder's prefix."""
    adapter, quantized = plan.config("adapter"), plan.config("base_weights")
    if not quantized.is_default and quantized != QLORA:
        unmapped.append(f"base_weights: {quantized.text} (torchtune's QLoRA is NF4 with double quantization)")
    if adapter.is_default:
        if not quantized.is_default:
            unmapped.append(f"base_weights: {quantized.text} without an adapter")
        return ""
    if type(adapter).__name__ != "LoRA" or adapter.dora or adapter.save or adapter.params or adapter.skip or adapter.only:
        unmapped.append(f"adapter: {plan.adapter} (torchtune's fields carry LoRA's rank, alpha, dropout and targets)")
        return "lora_"
    targets = {"linear-modules": (*ATTENTION, *MLP)}.get(adapter.targets[0], adapter.targets) \
        if adapter.targets else PEFTS_DEFAULT
    mlp = [t for t in targets if t in MLP]
    odd = [t for t in targets if t not in ATTENTION and t not in MLP and t != "lm_head"]
    if odd or mlp and len(mlp) != len(MLP):
        unmapped.append(f"adapter: {plan.adapter} (torchtune adapts q_proj, k_proj, v_proj, o_proj, the whole MLP or "
                        "the output)")
    fields["model"] = {"lora_attn_modules": [ATTENTION[t] for t in ATTENTION if t in targets],
                       "apply_lora_to_mlp": bool(mlp), "apply_lora_to_output": "lm_head" in targets,
                       "lora_rank": adapter.r, "lora_alpha": _number(adapter.alpha if adapter.alpha is not None else adapter.r),
                       "lora_dropout": adapter.dropout}
    return "lora_" if quantized.is_default else "qlora_"


def _checkpointing(plan: Plan, fields: dict, unmapped: list[str]) -> None:
    config = plan.config("checkpointing")
    if config.is_default:
        fields["enable_activation_checkpointing"] = False
    elif not isinstance(config, BlocksAC) or config.reentrant:
        unmapped.append(f"checkpointing: {config.text} (torchtune checkpoints whole layers, non-reentrant)")
    else:
        fields["enable_activation_checkpointing"] = True
        if config.every > 1:
            fields.update(ac_mode="selective", ac_option=config.every)


def _number(value: float) -> int | float:
    """A whole number as an int (``lora_alpha: 16``, as torchtune's configs write it)."""
    return int(value) if float(value).is_integer() else value
