"""Quantized base weights (QLoRA's base): the frozen model's linear layers stored in 4 or 8 bits.

Memory/compute trade-off, per frozen linear weight of N elements:
- ``as-is`` (:class:`AsIsWeights`): the workload's weights, 4N bytes in fp32 (2N in bf16).
- ``nf4`` / ``fp4`` (:class:`Quantized4bit`): bitsandbytes' ``Linear4bit``: N/2 bytes of packed
  4-bit codes plus one fp32 absmax per 64-weight block (N/16 bytes); ``:double_quant=true``
  (QLoRA's double quantization) stores the absmax in 8 bits (N/64) with one fp32 scale per 256
  blocks. Each matmul dequantizes the weight ([out, in] in the compute dtype: the training's 16-bit dtype,
  as recipes set ``bnb_4bit_compute_dtype``, memfit.techniques.kbit_training) in forward (unless
  CUDA's fused kernel takes a small batch) and again in backward: one weight-sized temporary at a
  time, and the dequantization work every step. Lossy (NF4: about 9% relative error on a random
  layer's output, see the tests).
- ``nf4:experts=true`` (and fp4): a mixture of experts' 3-D expert weights too, with bitsandbytes'
  parametrization, as axolotl's ``quantize_moe_experts`` (memfit.techniques.quantized_experts).
- ``int8`` (:class:`Int8Weights`): bitsandbytes' ``Linear8bitLt`` (LLM.int8, outlier threshold 6):
  N bytes plus one fp32 scale per row.
The LM head (the model's output embedding, or a layer named ``lm_head``) stays as it is, as
transformers' ``BitsAndBytesConfig`` leaves it, and so do the modules the model's class keeps in fp32 (its
``_keep_in_fp32_modules``: T5's ``wo``, Wan's time embedder), as transformers' and diffusers' bitsandbytes loads
leave them (NOTE [ What bitsandbytes leaves unquantized ]). Then, as peft's ``prepare_model_for_kbit_training``:
every other parameter is frozen (a quantized weight takes no gradient), fp16/bf16 parameters that
were not quantized (norms, embeddings) go to fp32 (memfit.techniques.kbit_training; the input embeddings'
output requires grad only under the reentrant checkpoint, as peft makes it).
The LM head keeps the workload's ``requires_grad`` (peft's ``get_peft_model`` freezes it when an
adapter is added), so a plan without an adapter trains the head on a quantized body. Gradient
checkpointing is the ``checkpointing`` key's business. Runs in plan order 2, before ``precision``
and before an ``adapter`` wraps the quantized layers.
- ``fp8`` (:class:`Float8Weights`): float8 e4m3 codes, N bytes plus one fp32 scale per row, upcast
  to the compute dtype per matmul in forward and backward (kohya's ``--fp8_base``;
  memfit.techniques.fp8_linear says why not torchao's subclass). About 2.5% relative error on a
  random layer's output. Needs a torch with float8 dtypes, not bitsandbytes.
Needs bitsandbytes (``pip install bitsandbytes``) but for fp8; 4-bit and 8-bit layers run forward and
backward on CPU and CUDA. Paged optimizers (``bnb.optim.PagedAdamW``) in a workload are not
modelled: their states live in CUDA unified memory that the driver pages out.
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass

import torch

from memfit.errors import UserError
from memfit.techniques.base import Config, Export, Key, Technique, register
from memfit.techniques.bnb_kernels import fake_parameter_subclasses, gemm_4bit_kernels, has_4bit_layers
from memfit.techniques.fp8_linear import Float8Linear, float8_available, quantize
from memfit.techniques.kbit_training import (
    compute_in,
    has_peft_adapter,
    output_layer,
    prepare_for_kbit_training,
)
from memfit.techniques.quantized_experts import (
    EXPERTS_NOTE,
    check_adapter,
    experts_3d_parameters,
    experts_to_quantize,
    quantize_expert,
    quantizes_experts,
)

FORMATS = ("as-is", "nf4", "fp4", "int8", "fp8")
BLOCKSIZE = 64
"""Weights per 4-bit absmax block (bitsandbytes' and transformers' default)."""


class BaseWeights(Config):
    """The plan key ``base_weights``: how the base model's linear weights are stored."""

    rank = None  # a method (what is trained changes), not compared with the other values

    def trace_context(self) -> contextlib.AbstractContextManager:
        return _bnb_on_fake_tensors(tables="bitsandbytes" in sys.modules)

    def apply(self, parts) -> None:
        """Quantize (variants; a model loaded as a checkpoint was quantized while loading), prepare
        it for k-bit training, and model the 4-bit matmuls of any bitsandbytes layer, the workload's
        own included (see NOTE [ 4-bit matmul kernels on fake tensors ])."""
        if self.layer is not None:
            if not parts.loaded:
                _quantize_linears(parts.model, self, self.text)
                for module, name in self.expert_weights(parts.model):
                    self.quantize_expert(module, name)
            precision = parts.plan.config("precision").resolve(parts.device)
            prepare_for_kbit_training(parts.model, freeze=not has_peft_adapter(parts.model),
                                      upcast=precision.weights == "fp32")
            compute_in(parts.model, precision.quantized_compute_dtype)
        if has_4bit_layers(parts.model):
            parts.contexts.append(lambda: gemm_4bit_kernels(parts.device))

    def on_load(self, model, load) -> None:
        """bitsandbytes quantizes while transformers loads (``BitsAndBytesConfig``): its layers
        replace the linears on the meta device, and each weight arrives in full precision and is
        quantized on the device before the next (memfit.techniques.loading)."""
        if self.layer is None:
            return
        for layer in _replace_linears(model, self, self.text):
            load.quantizers[id(layer.weight)] = lambda full, layer=layer: self.quantized(layer, full)
        for module, name in self.expert_weights(model):
            load.quantizers[id(module.get_parameter(name))] = lambda full, m=module, n=name: self.quantize_expert(m, n)
        load.bitsandbytes = self.bitsandbytes

    bitsandbytes = True
    """Quantized by bitsandbytes while transformers loads (``BitsAndBytesConfig``): loaded in the compute
    dtype (NOTE [ QLoRA loads in 16 bits ] in memfit.techniques.precision); fp8 is memfit's own."""

    layer = None
    """``layer(linear)``: the bitsandbytes layer that replaces ``linear``, its weight not yet
    quantized (a method of the variants that quantize; None: nothing is)."""

    def quantized(self, layer, full: torch.Tensor) -> torch.nn.Parameter:
        """``layer``'s weight quantized from ``full`` (the weight in full precision, on the device)."""
        raise NotImplementedError

    def expert_weights(self, model) -> list[tuple[torch.nn.Module, str]]:
        """(module, name) of the experts' 3-D weights this format quantizes (none but ``nf4:experts=true``)."""
        return []

    def require(self) -> None:
        """Raise the user error that says what this format needs, where it is missing here."""
        _require_bitsandbytes(self.text)


@dataclass(frozen=True)
class AsIsWeights(BaseWeights):
    """The workload's weights, as they are."""

    def values(self) -> dict:
        return {"base_weights": "as-is"}


@dataclass(frozen=True)
class Quantized4bit(BaseWeights):
    """bitsandbytes ``Linear4bit`` with NF4 or FP4 codes, 64-weight blocks."""

    quant_type: str = "nf4"
    """``nf4`` (normal-float, QLoRA's) or ``fp4``."""
    double_quant: bool = False
    """Quantize the block scales too (8-bit absmax, one fp32 scale per 256 blocks)."""
    experts: bool = False
    """A mixture of experts' 3-D expert weights too (NOTE [ Experts quantized as parametrizations ])."""

    @property
    def numerics(self) -> str:
        return f"{self.quant_type.upper()} base weights"

    def trace_context(self) -> contextlib.AbstractContextManager:
        return _bnb_on_fake_tensors(tables=True)

    def values(self) -> dict:
        options = [o for o, on in (("double_quant=true", self.double_quant), ("experts=true", self.experts)) if on]
        return {"base_weights": self.quant_type + (":" + ",".join(options) if options else "")}

    def label(self, batch_size):
        return self.quant_type + ("-dq" if self.double_quant else "") + ("-experts" if self.experts else "")

    def expert_weights(self, model) -> list[tuple[torch.nn.Module, str]]:
        return experts_to_quantize(model, self.text) if self.experts else []

    def check(self, plan) -> None:
        if self.experts:
            check_adapter(self.text, plan.config("adapter"))

    def quantize_expert(self, module: torch.nn.Module, name: str) -> None:
        quantize_expert(module, name, self.quant_type, self.double_quant, BLOCKSIZE)

    def layer(self, linear: torch.nn.Linear):
        import bitsandbytes as bnb
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  compute_dtype=linear.weight.dtype, compress_statistics=self.double_quant,
                                  quant_type=self.quant_type, device="meta")
        layer.compute_follows_plan = True  # (memfit.techniques.kbit_training.compute_in)
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, blocksize=BLOCKSIZE,
                                         compress_statistics=self.double_quant, quant_type=self.quant_type,
                                         module=layer)
        return layer

    def quantized(self, layer, full: torch.Tensor) -> torch.nn.Parameter:
        import bitsandbytes as bnb
        weight = bnb.nn.Params4bit(full, requires_grad=False, blocksize=BLOCKSIZE, compress_statistics=self.double_quant,
                                   quant_type=self.quant_type, module=layer)
        return weight.to(full.device)  # quantizes (bitsandbytes' Params4bit.to, as transformers' Bnb4bitQuantize)

    def export(self, into: Export) -> None:
        into.not_carried(self, ai_toolkit=self.quant_type != "nf4" or self.experts, axolotl=self.quant_type != "nf4")
        if self.quant_type == "nf4":
            into.ai_toolkit.update({"model.quantize": True, "model.qtype": "uint4"})  # (torchao's 4-bit: half a byte)
            into.axolotl.update(load_in_4bit=True, **({"quantize_moe_experts": True} if self.experts else {}))
            if not self.double_quant:
                into.axolotl_notes.append("axolotl's qlora quantizes with double quantization (nf4:double_quant=true): "
                                          "about 0.4 bits a weight less than the plan's nf4, a little under the "
                                          "predicted memory")
        into.hf_notes.append(f"load the model with from_pretrained(..., dtype=torch.bfloat16 (torch.float16 under fp16), "
                             f"quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="
                             f"'{self.quant_type}', bnb_4bit_use_double_quant={self.double_quant}, bnb_4bit_compute_dtype=torch.bfloat16 "
                             "(torch.float16 under fp16))): the load memfit "
                             "predicts (NOTE [ QLoRA loads in 16 bits ])" + (EXPERTS_NOTE if self.experts else ""))


@dataclass(frozen=True)
class Int8Weights(BaseWeights):
    """bitsandbytes ``Linear8bitLt`` (LLM.int8 with outlier threshold 6.0)."""

    numerics = "int8 base weights"

    def values(self) -> dict:
        return {"base_weights": "int8"}

    def label(self, batch_size):
        return "int8"

    def apply(self, parts) -> None:
        if not parts.device.is_gpu and getattr(parts.plan.config("adapter"), "dora", False):
            raise UserError("plan: DoRA over int8 base weights fails on the CPU from its second step (peft re-wraps "
                            "the 8-bit weight every forward there, and bitsandbytes drops its scales); plan it for a "
                            "GPU (--device), or use base_weights: nf4 (QDoRA)")
        super().apply(parts)

    def layer(self, linear: torch.nn.Linear):
        import bitsandbytes as bnb
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                    has_fp16_weights=False, threshold=6.0, device="meta")
        layer.weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False, has_fp16_weights=False)
        return layer

    def quantized(self, layer, full: torch.Tensor) -> torch.nn.Parameter:
        import bitsandbytes as bnb
        weight = bnb.nn.Int8Params(full, requires_grad=False, has_fp16_weights=False)
        return weight._quantize(full.device)  # bitsandbytes' own quantization (fp16 rows, then int8)

    def export(self, into: Export) -> None:
        into.not_carried(self, axolotl=False)
        into.axolotl["load_in_8bit"] = True
        into.hf_notes.append("load the model with from_pretrained(..., dtype=torch.bfloat16 (torch.float16 under fp16), "
                             "quantization_config=BitsAndBytesConfig(load_in_8bit=True))")


@dataclass(frozen=True)
class Float8Weights(BaseWeights):
    """float8 e4m3 codes with one fp32 scale per output row, upcast per matmul
    (memfit.techniques.fp8_linear)."""

    numerics = "fp8 (e4m3) base weights"
    bitsandbytes = False

    def __post_init__(self) -> None:
        self.require()

    def values(self) -> dict:
        return {"base_weights": "fp8"}

    def label(self, batch_size):
        return "fp8"

    def require(self) -> None:
        if not float8_available():
            raise UserError(f"plan: base_weights fp8 needs a torch with float8 dtypes (2.1 or later; this is "
                            f"{torch.__version__}); upgrade torch, or use base_weights: as-is")

    def check(self, plan) -> None:
        if getattr(plan.config("adapter"), "dora", False):
            raise UserError("plan: base_weights fp8 does not take a DoRA adapter (DoRA normalises the base weight "
                            "itself every step); use lora:... or base_weights: as-is")

    def layer(self, linear: torch.nn.Linear):
        return Float8Linear.from_linear(linear)

    def quantized(self, layer, full: torch.Tensor) -> torch.nn.Parameter:
        return quantize(layer, full)

    def export(self, into: Export) -> None:
        into.not_carried(self, kohya=False)
        into.kohya["fp8_base"] = True
        into.ai_toolkit.update({"model.quantize": True, "model.qtype": "qfloat8"})  # (optimum-quanto's float8)
        into.hf_notes.append("store the frozen linear weights in float8_e4m3fn with a scale per row and upcast per "
                             "matmul (kohya's --fp8_base)")


def _quantize_linears(model: torch.nn.Module, config: BaseWeights, text: str) -> None:
    """The linears replaced (:func:`_replace_linears`) and their weights quantized where they are."""
    for layer in _replace_linears(model, config, text):
        layer.weight = config.quantized(layer, layer.weight.data)


def _replace_linears(model: torch.nn.Module, config: BaseWeights, text: str) -> list[torch.nn.Module]:
    """Every ``nn.Linear`` but the output layer, and every transformers ``Conv1D`` (GPT-2's), replaced by
    ``config.layer(linear)`` (bias kept); returns the new layers, their weights not yet quantized. In a
    workload that already trains a peft adapter, only its frozen linears (the base layers under the
    adapter's): the adapter's own matrices and ``modules_to_save`` copies train, in full precision, as
    in QLoRA."""
    config.require()
    head = output_layer(model)
    adapted = has_peft_adapter(model)
    # and the children a workload's model says its trainers leave unquantized (``unquantized``: LTX-2's connectors)
    kept = (_kept_in_their_dtype(model) if config.bitsandbytes else set()) | {
        id(sub) for name in getattr(model, "unquantized", ()) for sub in model.get_submodule(name).modules()}
    targets = [(name, m) for name, m in model.named_modules()
               if _is_linear(m) and m is not head and not (adapted and m.weight.requires_grad) and id(m) not in kept]
    if not targets:
        raise UserError(f"plan: base_weights {text} found no nn.Linear layer to quantize in the model "
                        "(besides its output layer); use base_weights: as-is for this model")
    layers = []
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = config.layer(linear if type(linear) is torch.nn.Linear else _as_linear(linear))
        if linear.bias is not None:
            layer.bias = linear.bias
        layer.train(linear.training)
        setattr(parent, child, layer)
        layers.append(layer)
    return layers


# NOTE [ What bitsandbytes leaves unquantized ]
# transformers' and diffusers' bitsandbytes loads skip, besides the output layer, the modules their class names
# in ``_keep_in_fp32_modules`` (both add them to ``modules_to_not_convert``, whatever the dtype): T5's ``wo``,
# Wan's ``time_embedder``. Wan's matters beyond its bytes: its forward casts the timestep to the time
# embedder's first weight's dtype unless that is int8, so a 4-bit embedder (uint8 storage) gets a uint8
# timestep and the step fails. Matched as diffusers matches them, a name's whole components (transformers also
# takes a name's end and expressions: none of the lists here needs them).
def _kept_in_their_dtype(model: torch.nn.Module) -> set[int]:
    """``id`` of the modules a bitsandbytes load leaves unquantized: every module inside one that the
    outermost model class holding it names in ``_keep_in_fp32_modules`` (NOTE [ What bitsandbytes leaves
    unquantized ])."""
    out: set[int] = set()
    roots = [m for m in model.modules() if getattr(m, "_keep_in_fp32_modules", None)]
    inner = {id(sub) for r in roots for sub in r.modules() if sub is not r}
    for root in (r for r in roots if id(r) not in inner):
        keys = [k for k in root._keep_in_fp32_modules if isinstance(k, str)]
        for name, module in root.named_modules():
            if any(f".{k}." in f".{name}." for k in keys):
                out.add(id(module))
    return out


def _is_linear(module: torch.nn.Module) -> bool:
    """An ``nn.Linear`` (not a subclass: a quantized layer already), or a transformers ``Conv1D``: the
    layers transformers' bitsandbytes integration quantizes (``replace_with_bnb_linear``)."""
    kind = type(module)
    return kind is torch.nn.Linear or (kind.__name__ == "Conv1D" and kind.__module__ == "transformers.pytorch_utils")


# NOTE [ GPT-2's Conv1D ]
# GPT-2 (and GPT-J's relatives in transformers) computes its projections with ``Conv1D``: ``x @ W + b``
# with W stored (in, out), the transpose of an ``nn.Linear``'s. transformers' ``BitsAndBytesConfig``
# replaces it by a ``Linear4bit`` of the same features and transposes the checkpoint's weight as it
# loads (its ``source_cls``); peft then adapts the 4-bit layer as a linear (``fan_in_fan_out`` off). So
# here too: the layer is quantized from the transposed weight, a copy of one layer at a time where the
# weights are already built, none where the model loads as a checkpoint (its weights arrive one at a
# time, in the layer's own shape).
def _as_linear(conv: torch.nn.Module) -> torch.nn.Linear:
    """The ``nn.Linear`` a ``Conv1D`` computes (its weight transposed; NOTE [ GPT-2's Conv1D ])."""
    w = conv.weight
    linear = torch.nn.Linear(w.shape[0], w.shape[1], bias=False, device="meta", dtype=w.dtype)
    linear.weight = torch.nn.Parameter(w.detach().t().contiguous(), requires_grad=w.requires_grad)
    linear.bias = conv.bias
    linear.train(conv.training)
    return linear


STORED_BYTES = {"nf4": 0.5, "fp4": 0.5, "int8": 1, "fp8": 1}
"""Bytes per element of a linear weight stored in each quantized format, its scales left out."""


def least_weight_bytes(params, model: torch.nn.Module, base_weights: str | None, other: int = 2) -> int:
    """Bytes of ``params`` (of ``model``) at the least any plan stores them: the linear weights
    ``base_weights`` quantizes (each ``nn.Linear`` but the output layer, :func:`_replace_linears`) at
    the format's bytes per element, scales left out; every other parameter at ``other`` bytes (16 bits).
    A mixture of experts' 3-D expert weights are not ``nn.Linear`` layers: only ``experts=true`` quantizes them."""
    per = STORED_BYTES.get(str(base_weights or "as-is").split(":", 1)[0])  # ("nf4:double_quant=true")
    head = output_layer(model)
    linear = {id(m.weight) for m in model.modules() if _is_linear(m) and m is not head} if per else set()
    if per and quantizes_experts(base_weights):
        linear |= {id(m.get_parameter(name)) for m, name in experts_3d_parameters(model)}
    return int(sum(p.numel() * (per if id(p) in linear else other) for p in params))


def _require_bitsandbytes(text: str) -> None:
    from memfit.techniques.optimizers import bitsandbytes_available
    if not bitsandbytes_available():
        raise UserError(f"plan: base_weights {text} needs bitsandbytes, which is not installed here "
                        "(pip install bitsandbytes), or use base_weights: as-is")


def _is_fake(model: torch.nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return any(isinstance(p, FakeTensor) for p in model.parameters())


@contextlib.contextmanager
def _bnb_on_fake_tensors(tables: bool):
    """NOTE [ bitsandbytes parameters on fake tensors ], and (``tables``) bitsandbytes' constant
    tables computed for real (NOTE [ bitsandbytes tables on fake tensors ]) for double
    quantization's 8-bit absmax. ``as-is`` asks for the tables only when the workload has already
    imported bitsandbytes: importing it costs every trace half a second."""
    from memfit.techniques.optimizers import real_quantization_tables
    with fake_parameter_subclasses(), (real_quantization_tables() if tables else contextlib.nullcontext()):
        yield


_GRAMMAR = re.compile(r"^(as-is|int8|fp8|(nf4|fp4)(:((double_quant|experts)=(true|false)"
                      r"(,(double_quant|experts)=(true|false))?))?)$")


def parse(values: dict) -> BaseWeights:
    text = str(values["base_weights"])
    m = _GRAMMAR.match(text)
    options = dict(o.split("=") for o in (m.group(4) or "").split(",") if o) if m else {}
    if not m or (m.group(4) and len(options) != m.group(4).count(",") + 1):
        raise UserError(f"plan: base_weights {text!r} is not valid; choose one of as-is, nf4, fp4, int8, fp8 "
                        "(nf4 and fp4 take :double_quant=true and experts=true, e.g. nf4:double_quant=true)")
    if m.group(2):
        return Quantized4bit(m.group(2), options.get("double_quant") == "true", options.get("experts") == "true")
    if text == "fp8":
        return Float8Weights()
    return {"as-is": AsIsWeights(), "int8": Int8Weights()}[text]


TECHNIQUE = register(
    Technique("base_weights", (Key("base_weights", "as-is", "Base model's linear weights: as-is | nf4 | fp4 | int8 | "
                                   "fp8; nf4/fp4 take :double_quant=true (QLoRA's nf4:double_quant=true) and "
                                   "experts=true (a mixture of experts' 3-D expert weights too).",
                                   metavar="FORMAT"),),
              parse),
    BaseWeights, AsIsWeights, Quantized4bit, Int8Weights, Float8Weights)
