"""torchao's low-bit AdamW: the two moments stored in 8 bits, 4 bits or fp8.

Memory/compute trade-off, per parameter of N bytes in fp32 (AdamW keeps 2N of moments):

- ``adamw8bit-ao`` (:class:`AoAdamW8bit`): ``torchao.optim.AdamW8bit``, both moments as uint8 codes
  on a dynamic-tree map with one fp32 scale per 256 values: N/2 + N/128. Same idea as
  bitsandbytes' ``adamw8bit``, in PyTorch ops instead of a CUDA/C library.
- ``adamw4bit-ao`` (:class:`AoAdamW4bit`): ``torchao.optim.AdamW4bit``, two 4-bit codes per byte
  (the second moment on a linear map, as in "Memory Efficient Optimizers with 4-bit States"),
  one scale per 128 values: N/4 + N/64. The lossiest of the three.
- ``adamwfp8-ao`` (:class:`AoAdamWFp8`): ``torchao.optim.AdamWFp8``, float8_e4m3 moments with one
  scale per 256 values: N/2 + N/128, with fp8's wider dynamic range than the 8-bit code map.

Tensors under 4096 values (or not a multiple of the block) keep fp32 moments, as in bitsandbytes.
Each update dequantises a parameter's moments to fp32, steps them, and requantises them, in one
``torch.compile``'d function per parameter shape (``single_param_adam``, ``dynamic=False``): its
fp32 temporaries are Inductor's, a parameter at a time, and the first step of each new shape
pays a compilation (seconds on a CPU). With ``precision: bf16-pure`` and ``bf16_update:
stochastic`` the compiled update rounds the fp32 result into the bf16 weights stochastically
(torchao's ``bf16_stochastic_round``: no extra memory); Kahan compensation is not available.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from dataclasses import dataclass

import torch

from memfit.errors import UserError
from memfit.techniques.optimizer_variant import OptimizerVariant, hyperparameters, regroup

MIN_VERSION = "0.18.0"
INSTALL = f"pip install 'memfit[ao]' (torchao>={MIN_VERSION})"
CLASSES = {"adamw8bit-ao": "AdamW8bit", "adamw4bit-ao": "AdamW4bit", "adamwfp8-ao": "AdamWFp8"}
"""memfit's name -> the torchao.optim class."""


@functools.cache
def torchao_problem(name: str) -> str | None:
    """Why optimizer ``name`` cannot run here (None: it can): torchao missing, too old, or
    broken against this torch. Asked once a process (a search asks for each plan)."""
    import logging
    try:
        from importlib.metadata import version
        installed = version("torchao")
    except Exception:  # noqa: BLE001 - not installed
        return f"optimizer {name} needs torchao, which is not installed; {INSTALL}"
    if _version_tuple(installed) < _version_tuple(MIN_VERSION):
        return f"optimizer {name} needs torchao>={MIN_VERSION}, found {installed}; {INSTALL}"
    pytree_log = logging.getLogger("torch.utils._pytree")  # (torchao registers enums torch now handles itself)
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        import torchao.optim as ao_optim
        getattr(ao_optim, CLASSES[name])
    except Exception as e:  # noqa: BLE001 - an install that does not match this torch
        return (f"optimizer {name}: torchao {installed} does not import with torch {torch.__version__} "
                f"({type(e).__name__}); install the torchao release built for this torch: {INSTALL}")
    finally:
        pytree_log.setLevel(level)
    return None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


class TorchaoAdamW(OptimizerVariant):
    """A torchao low-bit AdamW with the workload's hyperparameters, group by group."""

    hf_name = None
    """Hugging Face ``TrainingArguments.optim`` for the same optimizer (None: it has none)."""
    compiles_per_weight_dtype = True
    slow_host_update = True

    def check(self, plan) -> None:
        problem = torchao_problem(self.name)
        if problem:
            raise UserError(problem)
        refused = _refused_with(plan)
        if refused:
            raise UserError(f"plan: optimizer {self.name} cannot be combined with {refused}")

    def factory(self, workload_factory, params):
        like = workload_factory(params)
        cls = routed(CLASSES[self.name])
        defaults = hyperparameters(like.defaults)
        return lambda ps: cls(regroup(ps, like, hyperparameters), **defaults)

    def notes(self) -> list[str]:
        return [f"{self.name}: torchao's compiled update, predicted through Inductor's own wrapper on fake "
                "tensors (its first step per parameter shape compiles: not counted in step time)"]

    def export(self, into) -> None:
        if self.hf_name:
            into.hf["optim"] = into.axolotl["optimizer"] = self.hf_name
            into.not_carried(self, hf=False, axolotl=False)
        else:
            into.not_carried(self)


@dataclass(frozen=True)
class AoAdamW8bit(TorchaoAdamW):
    """torchao's AdamW8bit: 8-bit dynamic-tree moments, block 256."""

    name = "adamw8bit-ao"
    rank = 1
    state_bytes_at_least = 2.0  # two 8-bit moments (and a scale per 256)
    numerics = "8-bit AdamW states"
    hf_name = "adamw_torch_8bit"


@dataclass(frozen=True)
class AoAdamW4bit(TorchaoAdamW):
    """torchao's AdamW4bit: 4-bit moments, block 128."""

    name = "adamw4bit-ao"
    rank = 2
    state_bytes_at_least = 1.0  # two 4-bit moments (and a scale per 128)
    numerics = "4-bit AdamW states"
    hf_name = "adamw_torch_4bit"


@dataclass(frozen=True)
class AoAdamWFp8(TorchaoAdamW):
    """torchao's AdamWFp8: float8_e4m3 moments, block 256."""

    name = "adamwfp8-ao"
    rank = 1
    state_bytes_at_least = 2.0  # two fp8 moments (and a scale per 256)
    numerics = "fp8 AdamW states"


VARIANTS = {cls.name: cls for cls in (AoAdamW8bit, AoAdamW4bit, AoAdamWFp8)}


def _refused_with(plan) -> str | None:
    """The technique in ``plan`` a torchao optimizer cannot run with, and why (None: none)."""
    if plan.config("shard").fsdp2:
        return ("shard (FSDP2): torchao's states are DTensor-aware, but memfit has not traced or measured "
                "the pair yet; use shard: none, or optimizer adamw with shard")
    if "optimizer_states:step=device" in plan.offload:
        return ("offload: [optimizer_states:step=device]: its per-parameter fetch copies plain state "
                "tensors; use offload: [optimizer_states] (the host steps torchao's update, slowly: a compiled CPU "
                "kernel), or optimizer adamw with offload: [optimizer_states:step=device]")
    if plan.bf16_update == "kahan":
        return ("bf16_update: kahan: torchao's update has no compensation buffer; use bf16_update: "
                "stochastic (torchao's bf16_stochastic_round)")
    return None


# -- routing torchao's torch.compile through memfit's compiled regions ---------------------------

_ROUTE_LOCK = threading.RLock()
_COMPILED: dict = {}


# NOTE [ torchao's step through memfit's compiled regions ]
# torchao calls ``torch.compile(single_param_adam, fullgraph=True, dynamic=False)`` inside ``step``.
# torch.compile refuses to run under memfit's dispatch modes (the fake trace's tracker, a profile's
# tracker), and on fake tensors its kernels must not run at all. So while one of these optimizers
# steps, ``torch.compile`` of that one function is routed to :func:`memfit.techniques.compiled.compiled`
# with torchao's options: on real tensors Inductor's kernels, exactly as torchao compiles them; on
# fake tensors the same capture and Inductor pipeline down to its generated wrapper, so the
# prediction holds Inductor's own temporaries and buffer reuse. Every other ``torch.compile`` call
# goes through unchanged; the route is held under a lock, so threads stepping at once (offloaded
# states on CUDA) neither see it half installed nor leave it behind. The quantized states are
# tensor subclasses: the tracker counts the plain tensors inside them (``memory.storages.byte_holders``).
#
# torchao's ``CPUOffloadOptimizer`` is not used: it runs on CUDA/XPU only, steps every parameter
# after backward (memfit's ``offload: [optimizer_states]`` steps each one on the host as its
# gradient arrives, during backward) and frees gradients only without accumulation. memfit's
# offload takes these optimizers as its host optimizer instead (one implementation of offload).
# Measured on an H100 (``bench/ao_cpu_offload_gpu.py``, 4 Llama layers at 7B width, fp32 master):
# torchao's 333.2 ms a step against memfit's 350.6 (0.95x; 0.94x and 1.02x in the two processes), the
# same 10.90 GiB peak: no clear win to keep a second implementation for.
def routed(class_name: str) -> type:
    """torchao's optimizer class ``class_name``, with its step's compile routed (NOTE [ torchao's
    step through memfit's compiled regions ]). Made once per class."""
    _real_code_maps()  # (each time: a cleared cache would be refilled in the trace)
    if class_name not in _COMPILED:
        import torchao.optim as ao_optim
        base = getattr(ao_optim, class_name)
        _COMPILED[class_name] = type(class_name, (base,), {"step": _routed_step(base.step),
                                                           "__module__": __name__})
    return _COMPILED[class_name]


# NOTE [ torchao's code maps are computed for real ]
# Torchao builds the 8-bit and 4-bit code maps (constant tables of 256 and 16 values) with
# ``.tolist()`` and caches them for the process (``functools.lru_cache``). Built first inside a fake
# trace, every value read would be an assumed 0, and the cached table would then quantize a real run's
# states after the estimate in the same process to garbage. They are filled here, for real, outside
# every mode; exact, since they depend on no input.
def _real_code_maps() -> None:
    """Fill torchao's cached code maps for real, outside every mode (NOTE [ torchao's code maps are
    computed for real ])."""
    from torch.utils._python_dispatch import _disable_current_modes
    from torchao.optim import subclass_4bit, subclass_8bit
    with _disable_current_modes():
        for module in (subclass_8bit, subclass_4bit):
            module.get_qmap_signed()
            module.get_qmap_unsigned()


def _routed_step(step):
    def routed_step(self, closure=None):
        with _compile_routed():
            return step(self, closure)
    routed_step.__doc__ = step.__doc__
    return routed_step


@contextlib.contextmanager
def _compile_routed():
    from torchao.optim import adam
    with _ROUTE_LOCK:
        real = torch.compile
        if getattr(real, "_memfit_route", False):  # (a nested step: already routed)
            yield
            return

        def route(model=None, **options):
            if model is adam.single_param_adam:
                torch.compile = real  # (memfit's compiled() compiles it with torch's own)
                try:
                    return _compiled_update(model, options)
                finally:
                    torch.compile = route
            return real(model, **options) if model is not None else real(**options)
        route._memfit_route = True
        torch.compile = route
        try:
            yield
        finally:
            torch.compile = real


def _compiled_update(fn, options: dict):
    from memfit.techniques.compiled import compiled
    key = (fn, tuple(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = compiled(fn, name="torchao optimizer update", fullgraph=options.get("fullgraph", True),
                                  dynamic=options.get("dynamic"), recompile_limit=sys.maxsize)
    return _COMPILED[key]
