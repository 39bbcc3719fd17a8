"""A mixture of experts' 3-D expert weights in 4 bits: ``base_weights: nf4:experts=true`` (memfit.techniques.base_weights).

Memory/compute trade-off: the experts are most of a MoE's bytes (Qwen3-30B-A3B: 57 of 61 GB in bf16), and
transformers 5 holds them as 3-D parameters, which bitsandbytes' ``BitsAndBytesConfig`` does not quantize. In
4 bits they take a quarter of that and a little (one fp32 scale a 64-weight block). The cost is a dequantization
of a layer's experts, whole, each time the layer runs (forward, and the recompute of a checkpointed one), and,
where the layer is not checkpointed, the dequantized copy its grouped matmul keeps for backward: then the codes
save nothing at the peak.
"""

from __future__ import annotations

import torch

from memfit.errors import UserError

# NOTE [ Experts quantized as parametrizations ]
# transformers 5 holds a mixture of experts' weights as 3-D parameters ([experts, out, in], one grouped matmul
# for all), not as one ``nn.Linear`` an expert, so ``BitsAndBytesConfig`` leaves them in 16 bits: QLoRA of
# Qwen3-30B-A3B keeps 57 GiB of bf16 experts. axolotl's ``quantize_moe_experts`` quantizes each as it loads
# with bitsandbytes' own parametrization (``replace_parameter_4bit``): the parameter becomes its 4-bit codes
# (``parametrizations.<name>.original``), and reading ``module.<name>`` dequantizes the whole tensor, cached
# between the module's forward pre-hook and hook (bitsandbytes registers them). memfit applies the same
# function, to the same tensors, as the checkpoint's load makes each (memfit.techniques.loading), and the
# trace sees what it allocates: the dequantized copy of a layer's experts while the layer runs, and, where the
# layer is not checkpointed, the copy its grouped matmul saves for backward (the codes save nothing then).
# An adapter cannot target the quantized tensors (PEFT's ``target_parameters`` no longer finds them), as
# axolotl refuses ``lora_target_linear`` with ``quantize_moe_experts``.
EXPERTS_NOTE = ("; then quantize each expert's 3-D weight, which BitsAndBytesConfig leaves in 16 bits, with "
                "bitsandbytes.nn.parametrize.replace_parameter_4bit(module, name, quant_type=..., "
                "compress_statistics=...) (axolotl's quantize_moe_experts does it as the weights load)")
"""What a plan with ``experts=true`` adds to the Hugging Face loading note."""


def experts_3d_parameters(model) -> list[tuple[torch.nn.Module, str]]:
    """(module, name) of a mixture of experts' weights held as 3-D parameters (one matrix per expert: transformers
    5's fused experts, in a module that counts ``num_experts``), which only ``experts=true`` quantizes."""
    return [(m, name) for m in model.modules() if isinstance(getattr(m, "num_experts", None), int)
            for name, p in m.named_parameters(recurse=False) if p.dim() >= 3]


def quantize_expert(module: torch.nn.Module, name: str, quant_type: str, double_quant: bool, blocksize: int) -> None:
    """``module``'s 3-D weight ``name`` quantized where it is, as bitsandbytes' parametrization that dequantizes it
    on access (axolotl's ``quantize_moe_experts``)."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit
    replace_parameter_4bit(module, name, compress_statistics=double_quant, quant_type=quant_type, blocksize=blocksize)


def quantizes_experts(base_weights) -> bool:
    """Whether a plan's ``base_weights`` value quantizes the experts' 3-D weights too (its ``experts=true`` option:
    memfit.techniques.base_weights' grammar)."""
    return "experts=true" in str(base_weights or "")


def with_experts(base_weights: str) -> str:
    """A 4-bit ``base_weights`` value with ``experts=true`` beside its other options (``nf4`` -> ``nf4:experts=true``,
    ``nf4:double_quant=true`` -> ``nf4:double_quant=true,experts=true``)."""
    return base_weights + ("," if ":" in base_weights else ":") + "experts=true"


def experts_left_said(model, base_weights, element_bytes: int) -> str:
    """The experts' 3-D weights that a quantized ``base_weights`` (a plan value) leaves as they are, in words for a
    refusal's count of the weights' bytes (at ``element_bytes`` each); "" where none is left so."""
    from memfit.units import fmt_bytes
    if quantizes_experts(base_weights):
        return ""
    kept = sum(m.get_parameter(name).numel() for m, name in experts_3d_parameters(model)) * element_bytes
    fmt = str(base_weights).split(":", 1)[0]
    return (f", {fmt_bytes(kept)} of them the experts' 3-D weights, which {fmt} leaves unquantized (no nn.Linear; "
            "nf4:experts=true quantizes them)") if kept else ""


def experts_to_quantize(model, text: str) -> list[tuple[torch.nn.Module, str]]:
    """The model's 3-D expert weights, for ``base_weights`` ``text`` with ``experts=true``; none is one line."""
    found = experts_3d_parameters(model)
    if not found:
        raise UserError(f"plan: base_weights {text}: the model has no mixture of experts' 3-D expert weights to "
                        "quantize (its experts, if any, are nn.Linear layers, which nf4 quantizes already); drop "
                        "experts=true")
    return found


def check_adapter(text: str, adapter) -> None:
    """An adapter on the experts' parameters cannot take quantized experts: one line."""
    if getattr(adapter, "params", ()):
        raise UserError(f"plan: base_weights {text} quantizes the experts' 3-D weights, which an adapter's params= "
                        "(PEFT's target_parameters) can then not adapt (axolotl refuses lora_target_linear with "
                        "quantize_moe_experts alike); drop params=, or experts=true")
