"""LyCORIS networks (the lycoris-lora library): the LoKr, LoHa, LoCon and other adapters SimpleTuner trains by
default and kohya's sd-scripts trains through ``lycoris.kohya``; a *method*, like LoRA.

LyCORIS wraps each target module of the trained model (by class: every ``Linear``, ``Conv`` and norm layer unless
a preset narrows it, as SimpleTuner's ``apply_preset`` does to ``Attention`` and ``FeedForward``) with a module of
the chosen algorithm, and replaces the module's forward with its own. What that costs differs from PEFT's layers of
the same name, and memfit runs LyCORIS's own modules, so the trace holds what they hold:

- ``lokr`` (its default ``bypass_mode`` off, on a plain ``Linear``): the update ``kron(w1, w2)`` is built as a
  matrix, cast to the base weight's dtype, added to a copy of the base weight and subtracted again, and the input
  is multiplied by that weight-sized difference in the input's dtype: weight-sized temporaries in the forward, and
  one weight-sized tensor per adapted layer kept for the backward (bf16 beside a bf16 base, where PEFT's layer keeps
  fp32); its few parameters ([a, b] and [c, d] factors; w2 low-rank below half its larger side) cost little.
- ``loha``: the Hadamard product of two low-rank products, also built as a matrix each forward (its own autograd
  function keeps the four factors, not the product).
- ``locon``/``lora``: a down and an up projection beside the layer, as LoRA: activations of [tokens, dim].

Over quantized base weights LyCORIS runs a bypass form (the base layer's output plus the update's product with the
input) for the quantized layers it knows: bitsandbytes' 8-bit layer (``base_weights: int8``), quanto's, its own fp8
one. memfit's fp8 layer and bitsandbytes' plain 4-bit one are none of them, and its rebuilt forward would add the
update to their stored weights (no kernel for that; a real run fails): refused in one line.

Plan key ``adapter``: ``lycoris:algo=lokr,dim=10000,alpha=1,factor=16,modules=Attention+FeedForward``: ``create_lycoris``
over the trained model (a workload's denoiser beside its text encoders) with ``linear_dim`` ``dim`` (default 4),
``linear_alpha`` ``alpha`` (default 1) and ``factor`` (LoKr's; default -1), and ``modules`` as the preset's
``target_module`` (default LyCORIS's own). The model is frozen first, as SimpleTuner freezes it; the network's
modules become submodules of the layers they wrap, so the step trains their parameters and nothing else.
Needs ``pip install 'memfit[lycoris]'``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from memfit.errors import UserError, brief
from memfit.quiet import logger_errors_only
from memfit.techniques.adapter import Adapter
from memfit.techniques.half_weights import built_in
from memfit.techniques.lokr import is_factor

ALGOS = ("lokr", "loha", "locon", "lora", "full", "diag-oft", "boft", "glora", "ia3", "dylora")
"""LyCORIS's algorithms (``algo``) memfit passes through; which module each builds is LyCORIS's choice."""


@dataclass(frozen=True)
class LycorisAdapter(Adapter):
    """A LyCORIS network over the trained model (the module's docstring)."""

    algo: str = "lokr"
    dim: int = 4
    """LyCORIS's ``linear_dim`` (LoKr: at least half a factor's larger side keeps w2 a full matrix)."""
    alpha: float = 1.0
    """LyCORIS's ``linear_alpha``."""
    factor: int = -1
    """LoKr's factor (-1: the factors nearest each side's square root)."""
    modules: tuple[str, ...] = ()
    """Module class names to wrap (the preset's ``target_module``); empty: LyCORIS's default."""

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise UserError(f"plan: adapter {self.text_value()}: algo {self.algo!r} is not one of LyCORIS's "
                            f"({', '.join(ALGOS)})")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 1:
            raise UserError(f"plan: adapter {self.text_value()}: dim must be a whole number >= 1; write e.g. dim=16")
        if not self.alpha > 0:
            raise UserError(f"plan: adapter {self.text_value()}: alpha must be > 0; write e.g. alpha=1")
        if not is_factor(self.factor):
            raise UserError(f"plan: adapter {self.text_value()}: factor must be -1 or a whole number >= 1")

    @property
    def kind(self) -> str:
        return "lycoris"

    def text_value(self) -> str:
        opts = [f"algo={self.algo}", f"dim={self.dim}", f"alpha={self.alpha:g}"]
        opts += [f"factor={self.factor}"] if self.factor != -1 else []
        opts += ["modules=" + "+".join(self.modules)] if self.modules else []
        return "lycoris:" + ",".join(opts)

    def check(self, plan) -> None:
        base = plan.config("base_weights")
        if not base.is_default and plan.base_weights != "int8":  # (bitsandbytes' Linear8bitLt: LyCORIS's bypass)
            raise UserError(f"plan: adapter {self.text_value()} over base_weights {plan.base_weights}: LyCORIS knows "
                            "memfit's fp8 and bitsandbytes' 4-bit layers as no quantized layer of its own and adds "
                            "its update to their stored weight, which fails; use base_weights int8 or as-is, or "
                            "lokr:...,factored=1")


    def apply(self, parts) -> None:
        import torch
        lycoris = lycoris_or_error()
        denoiser = getattr(parts.model, "denoiser", None)
        trained = denoiser if isinstance(denoiser, torch.nn.Module) else parts.model
        parts.model.requires_grad_(False)
        # (made in fp32 as the trainers make it, where a 16-bit precision builds the model in 16 bits)
        with _preset(lycoris.LycorisNetwork, self.modules), logger_errors_only("LyCORIS"), built_in(torch.float32):
            try:
                network = lycoris.create_lycoris(trained, 1.0, self.dim, self.alpha, algo=self.algo, factor=self.factor)
            except (ValueError, AssertionError, NotImplementedError) as e:  # (BOFT: a side it cannot decompose)
                raise UserError(f"plan: adapter {self.text_value()}: LyCORIS refuses it on this model ({brief(e)}); "
                                "name the module classes to wrap (modules=Attention+FeedForward) or another "
                                "algo") from None
        if not network.loras:
            raise UserError(f"plan: adapter {self.text_value()}: LyCORIS wraps no module of the model; name module "
                            "classes it holds (modules=Attention+FeedForward)")
        network.apply_to()
        for module in network.loras:  # (the wrapped layer holds its module: the step trains what the network trains)
            module.org_module[0].add_module("lycoris", module)

    def label(self, batch_size):
        return f"lycoris-{self.algo}{self.dim}"

    def export(self, into) -> None:
        into.not_carried(self, kohya=True, ai_toolkit=True, axolotl=True)
        note = (f"build the network in your code: create_lycoris(model, 1.0, {self.dim}, {self.alpha:g}, "
                f"algo={self.algo!r}, factor={self.factor}).apply_to()")
        into.hf_notes.append(note)
        into.lightning_notes.append(note)


@contextlib.contextmanager
def _preset(network_class, modules: tuple[str, ...]):
    """``LycorisNetwork.apply_preset`` sets class attributes for every later network of the process: set the target
    modules for this one, and put back what was there."""
    keys = ("TARGET_REPLACE_MODULE", "TARGET_REPLACE_NAME", "MODULE_ALGO_MAP", "NAME_ALGO_MAP", "TARGET_EXCLUDE_NAME")
    before = {key: getattr(network_class, key) for key in keys}
    try:
        if modules:
            network_class.apply_preset({"target_module": list(modules)})
        yield
    finally:
        for key, value in before.items():
            setattr(network_class, key, value)


def lycoris_or_error():
    try:
        import lycoris
    except ImportError:
        raise UserError("plan: adapter lycoris:... needs lycoris-lora (pip install 'memfit[lycoris]' or pip install "
                        "lycoris-lora)") from None
    return lycoris


def parse_lycoris(options: dict, text: str) -> LycorisAdapter:
    """``lycoris:OPTIONS`` (memfit.techniques.adapter_key splits them)."""
    values: dict = {}
    for name, value in options.items():
        if name == "algo":
            values[name] = value.lower()
        elif name == "modules":
            values[name] = tuple(v for v in value.split("+") if v)
        else:
            try:
                values[name] = float(value) if name == "alpha" else int(value)
            except ValueError:
                raise UserError(f"plan: adapter {text!r}: {name}={value} is not a number") from None
    return LycorisAdapter(**values)
