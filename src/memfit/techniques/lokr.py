"""LoKr adapters (LyCORIS's Kronecker-product adapter, as PEFT implements it): a *method*, like LoRA.

A LoKr adapter on a linear layer W [out, in] factors both sides, out = a * c and in = b * d (the factors
closest to ``factor``, or to the square root where ``factor`` is -1), and learns ``w1`` [a, b] and ``w2``
[c, d]; the update is their Kronecker product ``kron(w1, w2)``, of W's own shape, scaled by alpha / r.
Where r is small against w2's sides, w2 itself is low-rank (``w2_a @ w2_b``); with ``decompose_both``
w1 too. So a LoKr trains far fewer parameters than a LoRA of the same rank (a few thousand for a
3072 x 3072 layer), and its optimizer states are negligible.

The memory trade-off is the other way round for activations and time. PEFT's LoKr layer builds the
whole update every forward and multiplies the input by it (``F.linear(x, kron(w1, w2))``), so for each
adapted layer autograd keeps a full [out, in] update for the backward, in the adapter's dtype (fp32
when the adapter is kept in fp32 beside bf16 base weights, with the input cast to it), and the
backward computes a full [out, in] gradient of it before reducing it to w1's and w2's: a full-sized
weight gradient per layer at a time, and the compute of full fine-tuning's weight gradients. Where
LoRA's activations barely exceed the frozen model's, a LoKr over every linear layer keeps a second
copy of the adapted weights for the backward, unless the blocks are checkpointed (then one block's).
memfit traces PEFT's layer, so all of this is in the prediction, not assumed.

``factored=1`` is ai-toolkit's LoKr forward (toolkit/models/lokr.py, its linear layers' fast path): the update
never exists as a matrix. With the input's features viewed as [in_m, in_n], ``kron(w1, w2) @ x`` is
``w1 @ X @ w2.T`` (the Kronecker mixed product), two small contractions in the base layer's dtype: the factors
are cast to it, and the backward keeps activation-sized intermediates ([tokens, in_m, out_k], and [tokens, in_m,
r] where w2 is low-rank) in place of a weight-sized update. Its compute is the matmuls' of an [in_m x in_n]
by [in_n x out_k] product per token: a fraction of the layer's own. The same function as PEFT's layer, rounded
in another order (and in the base's 16 bits where PEFT's is in fp32).

Plan key ``adapter``: ``lokr:r=16,alpha=32,factor=16,decompose_both=1,factored=1,targets=...,skip=...,only=...,
save=...``: ``r=full`` keeps w2 a full matrix (ai-toolkit's ``lokr_full_rank``; scale 1). PEFT's
``LoKrConfig`` is injected with ``inject_adapter_in_model``, the targets resolved as LoRA's (a
diffusers model's attention projections, PEFT's defaults for a transformers type, else every linear
layer but the output layer). No dropout (LoKr has none on its input), and no ``params=``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from memfit.errors import UserError
from memfit.techniques.adapter import ALL_LINEAR, LoRA, peft_or_error

FULL_RANK = 1 << 20
"""The rank that keeps w2 a full matrix for any layer (PEFT and LyCORIS decompose it where r < half its
larger side): ``r=full``, ai-toolkit's ``lokr_full_rank``."""


@dataclass(frozen=True)
class LoKr(LoRA):
    """A LoKr adapter on the target linear layers (PEFT's ``LoKrConfig``); the rest of the model is frozen."""

    factor: int = -1
    """The factor each side is split by (-1: the factors nearest its square root), PEFT's ``decompose_factor``."""
    decompose_both: bool = False
    """Also make w1 low-rank (where r is below half its larger side)."""
    factored: bool = False
    """ai-toolkit's forward: the update applied as two contractions, never built as a matrix (the module's NOTE)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dropout:
            raise UserError(f"plan: adapter {self.text_value()}: LoKr has no dropout on its input; leave dropout out")
        if self.params:
            raise UserError(f"plan: adapter {self.text_value()}: LoKr adapts linear layers only; leave params out "
                            "(lora:...,params= adapts a mixture of experts' expert weights)")
        if self.dora:
            raise UserError("plan: adapter: LoKr has no weight-decomposed form; write lokr:... or dora:...")
        if not is_factor(self.factor):
            raise UserError(f"plan: adapter {self.text_value()}: factor must be -1 or a whole number >= 1, got "
                            f"{self.factor!r}; write e.g. factor=16")

    def check(self, plan) -> None:
        base = plan.config("base_weights")
        if not self.factored and getattr(base, "quant_type", None) in ("nf4", "fp4"):
            raise UserError(f"plan: base_weights {plan.base_weights} packs two weights a byte, and PEFT's LoKr layer "
                            "shapes its update as the base weight (PEFT fails there too); use lokr:...,factored=1 "
                            "(ai-toolkit's forward), base_weights int8 or fp8, or lora:...")

    @property
    def kind(self) -> str:
        return "lokr"

    @property
    def full_rank(self) -> bool:
        return self.r >= FULL_RANK

    @property
    def scale_alpha(self) -> float:
        # (LyCORIS and ai-toolkit scale a full-rank LoKr by 1; PEFT by alpha / r: so alpha = r)
        return float(self.r) if self.full_rank else super().scale_alpha

    def text_value(self) -> str:
        text = super().text_value()
        if self.full_rank:
            text = text.replace(f"r={self.r}", "r=full", 1)
        extra = ([f"factor={self.factor}"] if self.factor != -1 else []) + \
            (["decompose_both=1"] if self.decompose_both else []) + (["factored=1"] if self.factored else [])
        return ",".join([text, *extra])

    def peft_config(self, model):
        """The PEFT ``LoKrConfig`` for ``model``: LoRA's targets, LoKr's factors."""
        lora = super().peft_config(model)
        return peft_or_error().LoKrConfig(r=self.r, alpha=self.scale_alpha, decompose_factor=self.factor,
                                          decompose_both=self.decompose_both, target_modules=lora.target_modules,
                                          modules_to_save=lora.modules_to_save)

    def apply(self, parts) -> None:
        super().apply(parts)
        if self.factored:
            from peft.tuners.lokr.layer import Linear
            for module in parts.model.modules():
                if isinstance(module, Linear):
                    module.forward = types.MethodType(factored_forward, module)

    def label(self, batch_size):
        return "lokr-full" if self.full_rank else f"lokr{self.r}"

    def export(self, into) -> None:
        # (ai-toolkit's LoKr is the factored one, over the layers its LoRA takes; kohya's runs LyCORIS's forward)
        ai_toolkit = self.factored and not self.save and (self.targets == (ALL_LINEAR,) or self.in_blocks)
        into.not_carried(self, kohya=True, ai_toolkit=not ai_toolkit, axolotl=True)
        if ai_toolkit:
            into.ai_toolkit.update({"network.type": "lokr", "network.lokr_full_rank": self.full_rank,
                                    **({} if self.full_rank else {"network.linear": self.r,
                                                                  "network.linear_alpha": self.scale_alpha}),
                                    "network.lokr_factor": self.factor, **self._ai_toolkit_layers()})
        note = f"build the PEFT model in your code: get_peft_model(model, {self._peft_text()})"
        into.hf_notes.append(note)
        into.lightning_notes.append(note)

    def _peft_text(self) -> str:
        text = super()._peft_text().removeprefix("LoraConfig(").removesuffix(")")
        text = text.replace("lora_alpha=", "alpha=", 1)
        extra = ([f"decompose_factor={self.factor}"] if self.factor != -1 else []) + \
            (["decompose_both=True"] if self.decompose_both else [])
        return f"LoKrConfig({', '.join([text, *extra])})"


def is_factor(value) -> bool:
    """Whether ``value`` is a LoKr factor: -1 (the factors nearest each side's square root) or a whole number >= 1."""
    return isinstance(value, int) and not isinstance(value, bool) and (value == -1 or value >= 1)


def factored_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A PEFT LoKr linear layer's output as ai-toolkit's LoKr computes it (``factored=1``: the module's NOTE): the
    base layer's output plus ``w1 @ X @ w2.T`` for each token's features X [in_m, in_n], in the base output's dtype."""
    base = layer.base_layer(x, *args, **kwargs)
    name = layer.active_adapters[0]
    w1 = layer.lokr_w1[name] if name in layer.lokr_w1 else layer.lokr_w1_a[name] @ layer.lokr_w1_b[name]
    dtype = base.dtype
    w1 = w1.to(dtype)
    features = (x.to(dtype) if x.dtype != dtype else x).unflatten(-1, (w1.shape[1], -1))
    if name in layer.lokr_w2:
        inner = torch.einsum("...qs,os->...qo", features, layer.lokr_w2[name].to(dtype))
    else:  # (a low-rank w2: through its rank first, never an [out_k, in_n] matrix)
        inner = torch.einsum("...qs,rs->...qr", features, layer.lokr_w2_b[name].to(dtype))
        inner = torch.einsum("...qr,or->...qo", inner, layer.lokr_w2_a[name].to(dtype))
    delta = torch.einsum("...qo,pq->...po", inner, w1 * layer.scaling[name]).flatten(-2, -1)
    delta = delta * 1.0  # (ai-toolkit scales by its network's multiplier, 1 in training: a tensor of delta's size)
    return (base + delta).to(x.dtype)


def parse_lokr(options: dict, text: str) -> LoKr:
    """``lokr:OPTIONS`` once memfit.techniques.adapter_key has read LoRA's options; ``factor``, ``decompose_both`` and ``r=full``
    are LoKr's own (and ``factored``)."""
    if options.get("r") == "full":
        options["r"] = FULL_RANK
    if "factor" in options:
        options["factor"] = _whole(options["factor"], "factor", text)
    for flag in ("decompose_both", "factored"):
        if flag in options:
            value = str(options[flag]).lower()
            if value not in ("0", "1", "true", "false"):
                raise UserError(f"plan: adapter {text!r}: {flag}={value} is not 0/1 or true/false")
            options[flag] = value in ("1", "true")
    return LoKr(**options)


def _whole(value, name: str, text: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UserError(f"plan: adapter {text!r}: {name}={value} is not a whole number") from None
