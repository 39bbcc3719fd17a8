"""Precision: autocast (bf16, fp16 + GradScaler) and pure bf16.

Memory/compute trade-off. Autocast keeps fp32 master weights, gradients and optimizer states and
runs matmuls/convolutions in 16 bits: activations saved for backward are mostly 16-bit (about
half the bytes), but each weight is also cast to 16 bits per use (a temporary copy, cached for
the forward pass), so a model dominated by weights and optimizer states saves little. Tensor
cores make 16-bit matmuls several times faster on GPUs. fp16's narrow range needs a GradScaler
to keep small gradients from flushing to zero; bf16 has fp32's range and needs none.
``bf16-pure`` casts the weights themselves: parameters, gradients and optimizer states all take
half the bytes, at the cost of update precision (small updates can be lost to rounding; see
``bf16_update``).

``bf16-base`` is what an adapter's users run (NOTE [ The adapter users' precision ]): the base model
in bf16 as ``from_pretrained(dtype=torch.bfloat16)`` loads it, the adapter's weights in fp32 as
peft's ``get_peft_model`` leaves them, the step under bf16 autocast (``Trainer(bf16=True)``). Its
frozen weights take bf16-pure's bytes; the adapter's weights, gradients and AdamW states take
fp32's (16 bytes a parameter, not 8: 0.3 GiB for a 7B model's rank-16 LoRA), and peft's LoRA layer
casts its input to the adapter's dtype before the adapter's matmuls (fp32 temporaries the size of
the layer's input). Llama-2-7B, rank 16 on every linear layer, blocks, batch 2 x 2048, RTX 4090:
15.20 GiB allocated against bf16-pure's 14.64.
``fp16-base`` is the same in fp16 with a GradScaler (``Trainer(fp16=True)`` on a card without bf16).

Plan key ``precision``: ``fp32`` (:class:`FP32`), ``bf16`` / ``fp16`` (:class:`Autocast`),
``bf16-pure`` (:class:`BF16Pure`), ``bf16-base`` / ``fp16-base`` (:class:`AdapterBase`; with ``-noautocast``, the
same weights stepped without autocast: ai-toolkit's LoRA, each adapted layer's input kept in fp32), ``auto``
(:class:`AutoPrecision`: bf16 where the device supports it, fp16 otherwise, fp32 on a device with
neither).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from memfit.errors import UserError
from memfit.quiet import silenced_warnings
from memfit.techniques.base import Config, Export, Key, SearchContext, Technique, choice, register
from memfit.techniques.half_weights import (
    adapter_parameters,
    arrive_in,
    built_in,
    inputs_in,
    load_in,
    to_half,
)
from memfit.techniques.kept_in_fp32 import kept_ids

MODES = ("fp32", "bf16", "fp16", "bf16-pure", "bf16-base", "fp16-base", "bf16-base-noautocast", "fp16-base-noautocast",
         "auto")


class NoScaler:
    """GradScaler's interface for precisions that need no loss scaling."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Precision(Config):
    """What the step asks of its precision: the model conversion, the autocast context, the loss
    scaler and the batch's dtype."""

    name = "fp32"
    weights: ClassVar[str] = "fp32"
    """The dtype the weights (and so the optimizer's parameters) are held in."""
    scaled: ClassVar[bool] = False
    """The loss is scaled (fp16's GradScaler), so every gradient is unscaled and checked for
    overflow at once, after backward."""
    needs_adapter: ClassVar[bool] = False
    """It holds an adapter apart from the model (``bf16-base``): a plan that trains none cannot take it."""

    def values(self) -> dict:
        return {"precision": self.name}

    def resolve(self, device) -> Precision:
        return self

    def convert(self, model: torch.nn.Module, loaded: bool = False) -> torch.nn.Module:
        """``model`` in this precision's weights (``loaded``: built on the meta device and loaded as a
        checkpoint, memfit.techniques.loading)."""
        return model

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @property
    def quantized_compute_dtype(self) -> torch.dtype | None:
        """The dtype a 4-bit base layer computes in, as the recipes set bitsandbytes' ``bnb_4bit_compute_dtype``
        (NOTE [ QLoRA computes in the training dtype ] in memfit.techniques.kbit_training); None: its weights'."""
        return None

    def grad_scaler(self, device_type: str):
        return NoScaler()

    def prepare_batch(self, batch):
        """The batch as the model expects it (unchanged, except for bf16-pure)."""
        return batch

    def apply(self, parts) -> None:
        parts.precision = self.resolve(parts.device)
        parts.model = parts.precision.convert(parts.model, loaded=parts.loaded)

    def label(self, batch_size):
        return self.name

    def ablations(self):
        return [(f"precision {self.name}", FP32())] if self.name != "fp32" else []

    def export(self, into: Export) -> None:
        into.lightning["precision"] = LIGHTNING[self.name]
        into.kohya["mixed_precision"] = {"fp32": "no", "bf16-pure": "bf16"}.get(self.name, self.name)
        into.ai_toolkit["train.dtype"] = {"fp32": "fp32", "bf16-pure": "bf16"}.get(self.name)  # (None: no autocast there)

    @classmethod
    def from_arguments(cls, given: Export) -> Precision | None:
        """``TrainingArguments(bf16=True)`` / ``fp16=True``, Lightning's ``Trainer(precision=...)``;
        None for fp32, both trainers' default (a model loaded in bf16 is the Hugging Face adapter's
        to see: bf16-pure)."""
        if given.hf.get("bf16") or given.hf.get("fp16"):
            return Autocast("bf16" if given.hf.get("bf16") else "fp16")
        theirs = given.lightning.get("precision")
        if theirs is None or theirs == LIGHTNING["fp32"]:
            return None
        ours = {v: k for k, v in LIGHTNING.items()}.get(theirs)
        if ours is None:
            raise UserError(f"Trainer(precision={theirs!r}): memfit runs the precisions "
                            f"{', '.join(f'{v} ({k})' for k, v in LIGHTNING.items())}, not Trainer(precision="
                            f"{theirs!r}); remove it or choose one of them")
        return parse({"precision": ours})


@dataclass(frozen=True)
class FP32(Precision):
    """Full precision: the do-nothing precision."""

    rank = 0


@dataclass(frozen=True)
class Autocast(Precision):
    """fp32 weights, 16-bit compute under ``torch.autocast``."""

    dtype: str = "bf16"
    """bf16 or fp16 (fp16 with a GradScaler)."""
    rank = 1

    @property
    def name(self) -> str:
        return self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bf16" else torch.float16

    @property
    def scaled(self) -> bool:
        return self.dtype == "fp16"

    @property
    def quantized_compute_dtype(self) -> torch.dtype:
        return self.torch_dtype

    def resolve(self, device) -> Precision:
        if not (device.bf16 if self.dtype == "bf16" else device.fp16):
            alternative = "fp16 or auto" if self.dtype == "bf16" else "fp32 or auto"
            raise UserError(f"precision {self.dtype}: {device.name} has no {self.dtype} support; use {alternative}")
        return self

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        with silenced_warnings():
            ctx = torch.autocast(device_type, dtype=self.torch_dtype)
        if device_type == "cuda" and not torch.cuda.is_available():
            # NOTE [ Fake CUDA autocast ]: predicting for a GPU preset traces on fake CUDA tensors
            # on a machine without a GPU; torch.autocast then disables itself. The CUDA autocast
            # op lists (which ops run in 16 bits) are what the prediction needs, so keep it on.
            ctx._enabled = True
        return ctx

    def on_load(self, model, load) -> None:
        """NOTE [ QLoRA loads in 16 bits ]."""
        if load.bitsandbytes:
            arrive_in(model, self.torch_dtype)

    def grad_scaler(self, device_type: str):
        if self.dtype != "fp16":
            return NoScaler()
        if device_type == "cuda" and not torch.cuda.is_available():
            # GradScaler("cuda") disables itself without a GPU; see NOTE [ Fake CUDA autocast ].
            with silenced_warnings():
                scaler = torch.amp.GradScaler("cuda")
            scaler._enabled = True
            return scaler
        return torch.amp.GradScaler(device_type)

    def export(self, into: Export) -> None:
        super().export(into)
        into.hf[self.dtype] = True
        if self.dtype == "fp16" and not into.trains_adapter:  # (axolotl reads fp16: true so; its bf16 loads bf16 weights)
            into.axolotl["fp16"] = True
        else:
            into.not_carried(self, hf=False, lightning=False, kohya=False, ai_toolkit=False)


@dataclass(frozen=True)
class BF16Pure(Precision):
    """Weights, gradients and optimizer states in bf16 (no fp32 master copy)."""

    name = "bf16-pure"
    weights = "bf16"
    rank = 2
    numerics = "bf16 weights (no fp32 master copy)"

    def resolve(self, device) -> Precision:
        if not device.bf16:
            raise UserError(f"precision bf16-pure: {device.name} has no bf16 support; use fp16 or auto")
        return self

    def build_context(self):
        return built_in(torch.bfloat16)

    def prepare_batch(self, batch):
        return inputs_in(batch)

    def on_load(self, model, load) -> None:
        load_in(model)

    def convert(self, model: torch.nn.Module, loaded: bool = False) -> torch.nn.Module:
        """A model loaded as a checkpoint keeps its buffers as the load left them (the checkpoint's in bf16, a
        rotary ``inv_freq`` made in fp32 on purpose in fp32, as ``from_pretrained(dtype=torch.bfloat16)``
        leaves it); a model the workload builds is converted whole, as ``model.to(torch.bfloat16)`` does."""
        keep = kept_ids(model, torch.bfloat16, loaded) - {id(p) for p in adapter_parameters(model)[1]}
        return to_half(model, buffers=not loaded, keep=keep)

    def export(self, into: Export) -> None:
        super().export(into)
        into.hf["bf16"] = True  # with the model loaded in bf16, autocast changes nothing: all of it is bf16
        into.kohya["full_bf16"] = True
        if into.trains_adapter:  # (axolotl's bf16 keeps an adapter in fp32 over the bf16 model: bf16-base)
            into.not_carried(self, hf=False, lightning=False, kohya=False, ai_toolkit=False)
        else:
            into.axolotl["bf16"] = True
        into.hf_notes.append("precision: bf16-pure: load the model in bf16 (from_pretrained(..., "
                             "dtype=torch.bfloat16), or model.to(torch.bfloat16))")


# NOTE [ QLoRA loads in 16 bits ]
# A model loaded as a checkpoint under fp32 weights with autocast (precision bf16/fp16) arrives in fp32:
# from_pretrained(dtype=torch.float32), the recipe of a full fine-tune with fp32 master weights. A model
# that bitsandbytes quantizes while loading does not: every QLoRA recipe (peft's and transformers' guides,
# the Trainer examples, axolotl) loads it in its compute dtype (dtype=torch.bfloat16, or transformers 5's
# default "auto" on a bf16 checkpoint), each linear quantized from its 16-bit weight; then peft's
# prepare_model_for_kbit_training casts what was not quantized to fp32 (memfit.techniques.base_weights),
# holding each such tensor in 16 and 32 bits at once while it casts (a Llama-3.2-3B's embedding: 0.79 and
# 1.58 GB). Measured on an H200 (bench/qlora_load_gpu.py, 2026-12-04): from_pretrained's own peak was
# 2.28 GB, and memfit's prediction of a load in fp32 3.12 GB (+37%): the prediction loaded the embedding
# in fp32 and quantized each linear from fp32.

# NOTE [ The adapter users' precision ]
# peft's guides, axolotl and kohya's sd-scripts all train an adapter the same way: the base model is
# loaded in bf16 (``from_pretrained(dtype=torch.bfloat16)``; sd-scripts casts its frozen model to the
# mixed precision's dtype), the adapter's weights are upcast to fp32 (``get_peft_model``'s
# ``autocast_adapter_dtype=True``, its default; sd-scripts' network stays fp32 unless ``full_bf16``),
# and the step runs under bf16 autocast (``Trainer(bf16=True)``, accelerate's ``mixed_precision``).
# Neither ``bf16`` (autocast over fp32 weights: twice the base's bytes) nor ``bf16-pure`` (the adapter
# in bf16 too: half its weights', gradients' and states' bytes) is that loop, so ``bf16-base`` is:
# the parameters converted as bf16-pure converts them (the buffers as the load leaves them: a rotary
# table made in fp32 stays fp32, as ``from_pretrained`` leaves it), then peft's own
# ``cast_adapter_dtype`` over each adapter, as ``get_peft_model`` calls it. As in peft, only the
# adapter's layers are upcast: modules trained in full beside it (``save=``, peft's
# ``modules_to_save``) stay bf16, and train so.
#
# NOTE [ ai-toolkit's LoRA: no autocast ]
# ai-toolkit (ostris) runs the same weights without autocast: its ``train.dtype: bf16`` casts the model to
# bf16, keeps its LoRA modules in fp32 (``network.force_to(..., dtype=torch.float32)``) and calls the model
# under no autocast. Each adapted layer then casts its input to fp32 before the LoRA's first matmul
# (toolkit/network_mixins.py: ``lora_input = x.to(self.lora_down.weight.dtype)``), and backward keeps that
# fp32 copy: twice the input's bytes, once per adapted layer (q, k and v each hold their own copy of one
# input). Ops that autocast would run in fp32 (norms, softmax) run in bf16, so the model's own saved
# activations shrink a little. peft's LoRA layer does the same without autocast (``_cast_input_dtype``
# to the adapter's dtype, the output cast back), so ``bf16-base-noautocast`` is :class:`AdapterBase`
# with the autocast off; no GradScaler either (``fp16-base-noautocast``, ai-toolkit's fp16, scales no loss).
# A Trainer left without ``bf16=True`` over a model loaded in bf16 runs this loop too.
@dataclass(frozen=True)
class AdapterBase(Precision):
    """The base model in 16 bits, the adapter in fp32, 16-bit autocast (NOTE [ The adapter users'
    precision ]): ``bf16-base``, or ``fp16-base`` (a card without bf16: a T4's, and sd-scripts' fp16),
    whose loss is scaled by a GradScaler as ``Trainer(fp16=True)`` scales it."""

    dtype: str = "bf16"
    """bf16 or fp16."""
    autocast_on: bool = True
    """The step runs under autocast (peft's, axolotl's and kohya's loop); off: ai-toolkit's (NOTE [ ai-toolkit's
    LoRA: no autocast ]), each adapted layer's input cast to fp32, no loss scaling."""
    rank = None  # (between autocast and bf16-pure only where an adapter trains: not ordered, not searched)
    needs_adapter = True

    @property
    def name(self) -> str:
        return f"{self.dtype}-base" + ("" if self.autocast_on else "-noautocast")

    @property
    def weights(self) -> str:
        return self.dtype

    @property
    def numerics(self) -> str:
        return f"{self.dtype} base model (the adapter in fp32" + (")" if self.autocast_on else ", no autocast)")

    @property
    def scaled(self) -> bool:
        return self.autocast_on and Autocast(self.dtype).scaled

    @property
    def torch_dtype(self) -> torch.dtype:
        return Autocast(self.dtype).torch_dtype

    def resolve(self, device) -> Precision:
        if not (device.bf16 if self.dtype == "bf16" else device.fp16):
            other = ("fp16-base" + self.name[len("bf16-base"):]) if self.dtype == "bf16" else "fp32"
            raise UserError(f"precision {self.name}: {device.name} has no {self.dtype} support; use {other} or auto")
        return self

    def build_context(self):
        return built_in(self.torch_dtype)

    def prepare_batch(self, batch):
        return inputs_in(batch, self.torch_dtype)

    def on_load(self, model, load) -> None:
        load_in(model, self.torch_dtype)

    def convert(self, model: torch.nn.Module, loaded: bool = False) -> torch.nn.Module:
        """The rest in 16 bits (an adapter already in fp32, a user's model's trained one, keeps its bits;
        the buffers as the load or the build left them), then peft's upcast of each adapter."""
        names, adapter = adapter_parameters(model)
        if not names:
            raise UserError(f"precision {self.name} keeps an adapter's weights in fp32 over a {self.dtype} base model, "
                            "and the plan trains no adapter; add one (adapter: lora:r=16) or use "
                            f"{'bf16-pure' if self.dtype == 'bf16' else 'fp16'}")
        from peft.tuners.tuners_utils import cast_adapter_dtype
        keep = {id(p) for p in adapter} | kept_ids(model, self.torch_dtype, loaded)
        model = to_half(model, self.torch_dtype, buffers=False, keep=keep)
        for name in sorted(names):
            cast_adapter_dtype(model, adapter_name=name)
        if self.scaled:
            _check_unscalable(model, self.name)
        return model

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        return Autocast(self.dtype).autocast(device_type) if self.autocast_on else contextlib.nullcontext()

    def grad_scaler(self, device_type: str):
        return Autocast(self.dtype).grad_scaler(device_type) if self.scaled else NoScaler()

    def export(self, into: Export) -> None:
        torch_dtype = "torch.bfloat16" if self.dtype == "bf16" else "torch.float16"
        note = (f"precision: {self.name}: load the model in {self.dtype} (from_pretrained(..., dtype={torch_dtype})) "
                "and keep get_peft_model's autocast_adapter_dtype=True (its default: the adapter in fp32)")
        if self.autocast_on:
            into.lightning["precision"] = LIGHTNING[self.dtype]
            into.kohya["mixed_precision"] = self.dtype  # (its LoRA: the network fp32)
            into.hf[self.dtype] = into.axolotl[self.dtype] = True
        else:
            into.axolotl_unmapped.append(f"precision: {self.name} (axolotl runs an adapter under autocast: "
                                         f"{self.dtype}-base)")
            into.lightning["precision"] = LIGHTNING["fp32"]
            into.kohya_unmapped.append(f"precision: {self.name} (sd-scripts runs its LoRA under autocast: "
                                       f"{self.dtype}-base)")
            into.ai_toolkit["train.dtype"] = self.dtype  # (its LoRA: the network fp32, no autocast)
            note += f", with no autocast ({'bf16' if self.dtype == 'bf16' else 'fp16'}=False in TrainingArguments)"
        into.hf_notes.append(note)
        into.lightning_notes.append(note)


def _check_unscalable(model: torch.nn.Module, name: str) -> None:
    """A GradScaler refuses to unscale fp16 gradients: a module trained in full beside the adapter, which
    peft leaves in the model's fp16 (``modules_to_save``), fails the user's Trainer(fp16=True) at its first
    step; so does it here, in one line, before a step."""
    half = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
    if half:
        raise UserError(f"precision {name}: {half[0]} trains in fp16 (a module trained beside the adapter stays in the "
                        "model's dtype), and a GradScaler cannot unscale fp16 gradients, as Trainer(fp16=True) fails "
                        "on it too; train only the adapter, or use precision fp16 (fp32 weights)")



@dataclass(frozen=True)
class AutoPrecision(Precision):
    """bf16 where the device supports it, else fp16, else fp32."""

    name = "auto"
    rank = None

    def resolve(self, device) -> Precision:
        return Autocast("bf16") if device.bf16 else Autocast("fp16") if device.fp16 else FP32()

    def export(self, into: Export) -> None:
        into.not_carried("precision: auto (export the plan for a device: --device resolves it)")


LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-pure": "bf16-true"}
"""Lightning's ``Trainer(precision=...)`` for each of memfit's precisions."""


def parse(values: dict) -> Precision:
    mode = choice("precision", values["precision"], MODES)
    return {"fp32": FP32(), "bf16": Autocast("bf16"), "fp16": Autocast("fp16"), "bf16-pure": BF16Pure(),
            "bf16-base": AdapterBase("bf16"), "fp16-base": AdapterBase("fp16"),
            "bf16-base-noautocast": AdapterBase("bf16", autocast_on=False),
            "fp16-base-noautocast": AdapterBase("fp16", autocast_on=False), "auto": AutoPrecision()}[mode]


def search(ctx: SearchContext) -> list[str]:
    device = ctx.device
    return ["fp32", "bf16" if device.bf16 else "fp16"] + (["bf16-pure"] if device.bf16 else [])


TECHNIQUE = register(
    Technique("precision", (Key("precision", "fp32", "fp32 | bf16 | fp16 | bf16-pure | bf16-base / fp16-base (the base "
                                "model in 16 bits, an adapter in fp32, autocast: peft's, axolotl's and kohya's LoRA; -noautocast: without "
                                "autocast, ai-toolkit's) | auto "
                                "(bf16 where supported, else fp16, else fp32).", metavar="PRECISION"),),
              parse, search=search),
    Precision, FP32, Autocast, BF16Pure, AdapterBase, AutoPrecision)
