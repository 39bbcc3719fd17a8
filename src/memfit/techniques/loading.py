"""Loading a model the way its library loads a checkpoint: built on the meta device, then each
weight materialised on the step's device in its final form.

Memory trade-off. Building a model on the device and converting it afterwards
(``Model(config).cuda()``, then ``.to(torch.bfloat16)`` or a quantizer) holds the whole
full-precision model for a moment: 26 GiB for a 7B model in fp32. The caching allocator keeps
those segments reserved after the conversion frees them, so a 7.4 GiB QLoRA step reserved 22 GiB.
Loading as the libraries load a checkpoint holds, beyond the final model, at most one weight in
full precision: the one being quantized.

Load as users load
------------------
transformers' ``from_pretrained`` (5.x: ``convert_and_load_state_dict_in_model``) builds the model
on the meta device, then takes the checkpoint's keys in natural order (``layers.2`` before
``layers.10``). Each tensor is read on the host and copied to the device already cast to the
load dtype (a blocking copy casts on the host: the device sees the final tensor only). A weight
that bitsandbytes quantizes while loading arrives in the load dtype and is quantized on the device
(``Params4bit(...).to(device)``); its full-precision copy is freed before the next key. Keys that
no checkpoint holds (non-persistent buffers) are then made on the device with ``empty_like``, and
the model's own initialisation gives them values. diffusers' ``from_pretrained`` and a
``.to(device, dtype)`` of a model loaded on the host reach the device the same way: one
allocation per tensor, in its final form.

memfit has no checkpoint: :func:`materialise` makes each tensor with ``torch.empty`` on the device,
in the order and form the checkpoint's would arrive in (what the memory prediction needs), and
its values come from the model's own initialisation (transformers' ``initialize_weights``,
``reset_parameters`` elsewhere), as ``from_pretrained`` initialises the keys a checkpoint lacks.
A weight is initialised before it is quantized. On a CPU device the checkpoint's own read buffers
(host memory) are not modelled: only what reaches the device.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from memfit.quiet import stand_in_values
from memfit.techniques.host_tensors import BuildRecord

Quantizer = Callable[[torch.Tensor], torch.nn.Parameter]
"""A weight in its load dtype, on the device -> the quantized parameter that replaces it."""


@dataclass
class Load:
    """What the load does beyond casting, gathered from the plan's techniques before the weights
    arrive (:meth:`memfit.techniques.base.Config.on_load`)."""

    quantizers: dict[int, Quantizer] = field(default_factory=dict)
    """``id`` of a meta weight -> how the load quantizes it (bitsandbytes' formats, fp8)."""
    on_host: set[int] = field(default_factory=set)
    """``id`` of meta parameters the load makes in host memory, quantized there if they are
    quantized (the weights of swapped blocks: memfit.techniques.swap_blocks), as a loader that reads
    the checkpoint on the host and moves the rest to the device leaves them."""
    bitsandbytes: bool = False
    """bitsandbytes quantizes while loading (transformers' ``BitsAndBytesConfig``): a recipe that loads
    in its compute dtype (NOTE [ QLoRA loads in 16 bits ] in memfit.techniques.precision)."""


def natural_key(name: str) -> tuple:
    """transformers' ``dot_natural_key``: dotted names with numbers compared as numbers."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in name.split("."))


@contextlib.contextmanager
def on_meta() -> Iterator[BuildRecord]:
    """Build on the meta device (no memory, no initialisation work). Yields the build's record,
    whose ``host_tensors(model)`` makes the plain tensor attributes again on the host (NOTE [ Plain
    tensors of a meta build ] in memfit.techniques.host_tensors)."""
    with torch.device("meta"), BuildRecord() as record:
        yield record


def materialise(model: torch.nn.Module, device: str | torch.device, load: Load | None = None,
                buffer_values: dict[str, torch.Tensor] | None = None) -> None:
    """Give every meta tensor of ``model`` its storage on ``device``, one tensor at a time, as a
    checkpoint's load would (see the module's docstring); tied tensors stay tied. ``buffer_values``:
    buffers' values by name, made on the host (NOTE [ Buffers of a meta build ] in
    memfit.techniques.host_tensors), copied in once every tensor has its own."""
    load = load or Load()
    owners = _owners(model)
    persistent = model.state_dict(keep_vars=True)
    buffers = dict(model.named_buffers(remove_duplicate=False))
    ordered = sorted(persistent, key=natural_key) + sorted(set(buffers) - set(persistent), key=natural_key)
    done: set[int] = set()
    quantized: list[torch.nn.Module] = []
    for name in ordered:
        old = persistent.get(name, buffers.get(name))
        if old is None or id(old) in done or old.device.type != "meta":
            continue
        done.add(id(old))
        new = _empty(old, device, id(old) in load.on_host)
        quantize = load.quantizers.get(id(old))
        if quantize is None:
            _put(owners[id(old)], _as_kind(old, new))
            continue
        module = owners[id(old)][0][0]
        _put(owners[id(old)], torch.nn.Parameter(new, requires_grad=False))
        _initialise_module(model, module)  # values before quantizing, as the checkpoint's weight has them
        del new
        weight = quantize(module.get_parameter(owners[id(old)][0][1]))
        if weight is not None:  # (None: the quantizer replaced it itself, a parametrization: an expert's weight)
            _put(owners[id(old)], weight)
        quantized.append(module)
    _initialise(model, skip=quantized, buffer_values=buffer_values or {})


def _copy_in(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Each buffer's value, cast on the host to the buffer's dtype and copied to its device (no
    allocation there)."""
    buffers = dict(model.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, value in values.items():
            buffer = buffers.get(name)
            if buffer is not None and buffer.shape == value.shape:
                buffer.copy_(value.to(buffer.dtype))


def _empty(old: torch.Tensor, device: str | torch.device, on_host: bool) -> torch.Tensor:
    """Uninitialised storage for ``old`` on ``device``, or in host memory (pinned for a CUDA device)."""
    if not on_host:
        return torch.empty(old.shape, dtype=old.dtype, device=device)
    pinned = torch.device(device).type == "cuda"
    return torch.empty(old.shape, dtype=old.dtype, device="cpu", pin_memory=pinned)


def _owners(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """``id`` of each parameter and buffer -> every (module, attribute) holding it (tied ones several)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                owners.setdefault(id(t), []).append((module, attr))
    return owners


def _as_kind(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return torch.nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else new


def _put(holders: list[tuple[torch.nn.Module, str]], value: torch.Tensor) -> None:
    for module, attr in holders:
        table = module._parameters if attr in module._parameters else module._buffers
        table[attr] = value


# -- values -------------------------------------------------------------------------------------

_BIAS = re.compile(r"(^|_)bias$")


@stand_in_values()
def _initialise(model: torch.nn.Module, skip: list[torch.nn.Module], buffer_values: dict[str, torch.Tensor]) -> None:
    """Values for every tensor: a finite default first (a module no initialiser covers must not
    train on uninitialised memory), the buffers' values their build computed, then the model's own
    initialisation (the eager order: ``__init__``'s values, then the library's init)."""
    skipped = {id(m) for m in skip}
    with torch.no_grad():
        for module in model.modules():
            if id(module) in skipped:
                continue
            for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is not None:
                    _default_fill(attr, t)
    _copy_in(model, buffer_values)
    hf_init = getattr(model, "initialize_weights", None)
    if callable(hf_init) and hasattr(model, "_init_weights"):
        for module in model.modules():  # building marked them initialised (on meta: no values yet)
            module.__dict__.pop("_is_hf_initialized", None)
        for module in skip:  # (and their tensors: a parent's init may reach them, GPT-2's scaled c_proj)
            module._is_hf_initialized = True
            for t in [*module._parameters.values(), *module._buffers.values()]:
                if t is not None:
                    t._is_hf_initialized = True
        hf_init()
        return
    for module in model.modules():
        if id(module) not in skipped:
            _reset(module)


def _default_fill(attr: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        t.zero_()
    elif t.dim() >= 2:
        t.normal_(0.0, 0.02)
    elif _BIAS.search(attr):
        t.zero_()
    else:
        t.fill_(1.0)


@stand_in_values()
def _initialise_module(model: torch.nn.Module, module: torch.nn.Module) -> None:
    """One module's values (a weight about to be quantized). A module with a weight quantized already as a
    parametrization (experts' weights) has its new tensors filled only: its initialisation would dequantize the
    others, which a checkpoint's load never does."""
    with torch.no_grad():
        for attr, t in module._parameters.items():
            if t is not None:
                _default_fill(attr, t)
    if torch.nn.utils.parametrize.is_parametrized(module):
        return
    init = getattr(model, "_init_weights", None)
    if callable(init):
        init(module)
    else:
        _reset(module)


def _reset(module: torch.nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        with torch.no_grad():
            reset()
