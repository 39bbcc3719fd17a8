"""Weights and inputs in 16 bits, as a checkpoint loaded with ``dtype=`` leaves them: the conversions the
16-bit precisions share (memfit.techniques.precision). A model built in fp32 and then cast holds both
copies for a moment, and the caching allocator keeps the fp32 one's segments: each helper here avoids that
the way ``from_pretrained(dtype=torch.bfloat16)`` does, by building or loading in 16 bits, and keeps what
the library keeps in fp32 (a rotary table, ``_keep_in_fp32_modules``) as the load leaves it."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_map

from memfit.techniques.adapter import is_lycoris_module
from memfit.techniques.kept_in_fp32 import arrive_in_fp32


def adapter_parameters(model: torch.nn.Module) -> tuple[set[str], list[torch.nn.Parameter]]:
    """The names of the peft adapters in ``model`` and their layers' parameters, and a LyCORIS network's modules'
    (memfit.techniques.lycoris_networks: named ``lycoris``)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        BaseTunerLayer = ()  # noqa: N806 - (no peft: no peft layer is one)
    names, params = set(), []
    for m in model.modules():
        if is_lycoris_module(m):
            names.add("lycoris")
            params += list(m.parameters(recurse=False))
        elif isinstance(m, BaseTunerLayer):
            for attr in m.adapter_layer_names:
                for name, part in getattr(m, attr, {}).items():
                    names.add(name)
                    params += [part] if isinstance(part, torch.nn.Parameter) else list(part.parameters())
    return names, params


@contextlib.contextmanager
def built_in(dtype: torch.dtype = torch.bfloat16):
    """The model is built in ``dtype`` (floating-point tensors it creates without a dtype): a 7B model
    built in fp32 first would take 26 GiB of device memory, and the allocator would keep it
    reserved after the cast (what from_pretrained(dtype=torch.bfloat16) avoids too)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def inputs_in(batch, dtype: torch.dtype = torch.bfloat16):
    """Floating-point inputs follow the weights into ``dtype`` (integer ids and labels stay)."""
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, batch)


def load_in(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
    """A checkpoint loaded with ``dtype=`` casts each tensor it holds to ``dtype`` before it reaches the
    device. The parameters already are (built under :func:`built_in`), but a persistent buffer the
    model's ``__init__`` makes in fp32 explicitly (SD3's 226 MB sin-cos position table) is cast here, on
    the meta device, so that it arrives in 16 bits rather than in fp32 to be converted on the device.
    Buffers no checkpoint holds (rotary tables) stay as the library leaves them, as ``from_pretrained``
    leaves them; what the model's class keeps in fp32 arrives in fp32 (memfit.techniques.kept_in_fp32). Parameters are converted later, by :func:`to_half`: other configs' ``on_load`` key
    parameters by identity (quantizers, swapped blocks)."""
    held = {id(t) for t in model.state_dict(keep_vars=True).values()} - arrive_in_fp32(model, dtype)
    cast: dict[int, torch.Tensor] = {}  # (a buffer two modules share stays shared)
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None and id(b) in held and b.is_floating_point() and b.element_size() > 2:
                if id(b) not in cast:
                    cast[id(b)] = b.to(dtype)
                module._buffers[name] = cast[id(b)]


def to_half(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16, buffers: bool = True,
             keep: frozenset[int] | set[int] = frozenset()) -> torch.nn.Module:
    """Every floating-point parameter in ``dtype`` (float8 base weights stay as stored), and every buffer
    (``buffers``; else they stay as the load left them: :func:`load_in` cast those a checkpoint holds,
    and a table the model makes in fp32 on purpose, such as a rotary ``inv_freq``, stays fp32, as after
    ``from_pretrained(dtype=torch.bfloat16)``); parameters whose ``id`` is in ``keep`` stay as they are.
    Parameters are replaced one by one (tied weights stay tied) rather than by ``model.to()``, which
    swaps tensors in place and fails for tied parameters on fake tensors."""
    converted: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.element_size() == 1 or id(p) in keep:
                continue
            if id(p) not in converted:
                converted[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            module._parameters[name] = converted[id(p)]
        for name, b in list(module._buffers.items()) if buffers else ():
            if b is not None and b.is_floating_point():
                module._buffers[name] = b.to(dtype)
    return model


def arrive_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point tensor a checkpoint holds arrives in ``dtype`` (``from_pretrained(dtype=...)``):
    the meta parameters wider than 16 bits are made 16-bit on the meta device, keeping their identity
    (quantizers key them by it), and the buffers as :func:`load_in` casts them; what the model's class
    keeps in fp32 stays fp32."""
    kept = arrive_in_fp32(model, dtype)
    load_in(model, dtype)
    for p in model.parameters():
        if p.device.type == "meta" and p.is_floating_point() and p.element_size() > 2 and id(p) not in kept:
            p.data = torch.empty_like(p, dtype=dtype)


def precision_notes(plan) -> list[str]:
    """What an adapter's plan in ``bf16-pure`` is not. QLoRA: the loop of peft's and transformers' guides,
    whose ``prepare_model_for_kbit_training`` keeps the weights it does not quantize in fp32 (docs/fine-tuning.md:
    30% more on a small model than bf16-pure predicts). LoRA: ``get_peft_model`` over a model loaded in bf16,
    which keeps the adapter in fp32 (``bf16-base``: NOTE [ The adapter users' precision ])."""
    if plan.precision != "bf16-pure" or plan.config("adapter").is_default:
        return []
    from memfit.techniques.base_weights import Int8Weights, Quantized4bit
    if not isinstance(plan.config("base_weights"), (Quantized4bit, Int8Weights)):
        return ["bf16-pure keeps the adapter in bf16 too (torchtune's and SimpleTuner's LoRA); peft's get_peft_model over a "
                "model loaded in bf16 keeps it in fp32 (as axolotl and kohya's sd-scripts do): --precision bf16-base "
                "predicts that"]
    return ["bf16-pure keeps the weights that are not quantized, and the adapter, in bf16 (torchtune's and Unsloth's "
            "QLoRA); a loop that calls peft's prepare_model_for_kbit_training keeps them in fp32: --precision bf16 "
            "predicts that loop"]
