"""bitsandbytes' paged AdamW: optimizer states in CUDA unified memory, outside PyTorch's allocator.

Memory/compute trade-off, per parameter of N bytes in fp32:

- ``adamw8bit-paged`` (:class:`PagedAdamW8bit`): ``bitsandbytes.optim.PagedAdamW8bit``, the two
  moments block-quantised to 8 bits (N/2 plus a scale per 256 values), as ``adamw8bit``.
- ``adamw-paged`` (:class:`PagedAdamW`): ``bitsandbytes.optim.PagedAdamW``, two fp32 moments (2N),
  updated by bitsandbytes' fused 32-bit AdamW kernel. ``PagedAdamW32bit`` is the same class with
  the same arguments (both pass ``optim_bits=32``): memfit has one value for the two.

The states of every tensor of at least 1e5 elements (:data:`MANAGED_MIN_ELEMENTS`) are allocated
with ``cudaMallocManaged`` (``bitsandbytes.functional.get_paged``), the smaller ones by PyTorch as
usual. Managed memory is the driver's, not the caching allocator's: it is in neither
``torch.cuda.memory_allocated()`` nor ``torch.cuda.max_memory_reserved()``, and
``set_per_process_memory_fraction`` does not cap it. While the card has room it behaves as device
memory (each update prefetches its states first); when it has not, the driver evicts pages to host
memory and faults them back in, and the step pays the host link for them
(memfit.memory.managed). The saving is therefore not in the bytes, which still need the card, but
in the allocator: no caching-allocator segment holds the states, and a spike above the card's
memory pages states out instead of raising an out-of-memory error.

memfit predicts the two kinds apart (NOTE [ Managed states ]): the allocator's bytes through its
replay, the managed bytes as their own device (``managed`` in the tracker), reported beside the
reserved bytes and counted against the card by :class:`memfit.memory.budget.Budget`. On the ``cpu``
device there is nothing to page: bitsandbytes keeps plain tensors, and so does memfit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.errors import UserError
from memfit.techniques import bnb_optim
from memfit.techniques.optimizer_variant import OptimizerVariant, hyperparameters, regroup

MANAGED_MIN_ELEMENTS = 100_000
"""bitsandbytes pages the states of tensors with at least this many elements (``get_state_buffer``:
``p.numel() < 1e5`` stays with PyTorch)."""
INSTALL = "pip install bitsandbytes"


class PagedVariant(OptimizerVariant):
    """A bitsandbytes paged AdamW with the workload's hyperparameters, group by group."""

    bnb_class = ""
    """The ``bitsandbytes.optim`` class."""
    hf_name = ""
    kohya_name = ""
    """sd-scripts' ``optimizer_type``."""
    """Hugging Face ``TrainingArguments.optim`` for the same optimizer."""

    def check(self, plan) -> None:
        if not _bitsandbytes_ready():
            raise UserError(f"plan: optimizer {self.name} needs bitsandbytes, which is not installed here; {INSTALL}")
        refused = _refused_with(plan)
        if refused:
            raise UserError(f"plan: optimizer {self.name} cannot be combined with {refused}")

    def apply(self, parts) -> None:
        params = [p for p in parts.model.parameters() if p.requires_grad]
        if params:
            like = parts.optimizer_factory(params)
            cls = paged_class(self.bnb_class)
            defaults = hyperparameters(like.defaults)
            gpu, placement = parts.device.is_gpu, parts.placement
            parts.optimizer_factory = lambda ps: cls(regroup(ps, like, hyperparameters), gpu=gpu, placement=placement,
                                                     **defaults)

    def label(self, batch_size):
        return self.name

    def notes(self) -> list[str]:
        return [f"{self.name}: states of tensors of {MANAGED_MIN_ELEMENTS:,} elements or more are CUDA managed (unified) "
                "memory on a GPU, outside the caching allocator (predicted apart, as 'managed')"]

    def trace_context(self):
        return bnb_optim.real_quantization_tables()

    def export(self, into) -> None:
        into.hf["optim"] = into.axolotl["optimizer"] = self.hf_name
        into.kohya["optimizer_type"] = self.kohya_name
        into.not_carried(self, hf=False, kohya=False, ai_toolkit=True, axolotl=False)


@dataclass(frozen=True)
class PagedAdamW8bit(PagedVariant):
    """bitsandbytes' PagedAdamW8bit: 8-bit moments in managed memory."""

    name = "adamw8bit-paged"
    rank = 1
    state_bytes_at_least = 2.0  # two 8-bit moments (and a scale per 256), managed or not
    numerics = "8-bit AdamW states"
    bnb_class = "PagedAdamW8bit"
    hf_name = "paged_adamw_8bit"
    kohya_name = "PagedAdamW8bit"


@dataclass(frozen=True)
class PagedAdamW(PagedVariant):
    """bitsandbytes' PagedAdamW (= PagedAdamW32bit): fp32 moments in managed memory."""

    name = "adamw-paged"
    rank = 0
    bnb_class = "PagedAdamW"
    hf_name = "paged_adamw_32bit"
    kohya_name = "PagedAdamW"


VARIANTS = {cls.name: cls for cls in (PagedAdamW8bit, PagedAdamW)}


def _refused_with(plan) -> str | None:
    """The technique in ``plan`` a paged optimizer cannot run with, and why (None: none)."""
    if plan.config("shard").fsdp2:
        return "shard (FSDP2): bitsandbytes' states do not take DTensor parameters; use shard: none"
    if plan.config("offload").states is not None:
        return (f"offload: [{plan.config('offload').states}]: offloaded states live in host memory, where nothing is "
                "paged; use adamw8bit (or adamw) with the offload, or the paged optimizer without it")
    return None


def _bitsandbytes_ready() -> bool:
    return bnb_optim.bitsandbytes_available()


# NOTE [ Managed states ]
# bitsandbytes decides where each state lives in ``Optimizer8bit.get_state_buffer``: on a CUDA
# parameter of 1e5 elements or more, ``F.get_paged`` (cudaMallocManaged, wrapped by
# ``torch.frombuffer`` as a CPU-typed tensor no ATen op made); else ``torch.zeros_like``. memfit's
# subclass keeps that decision and tells the step's observer which buffers are managed
# (``observer.managed``): the tracker books them on a device of their own, ``managed``, which the
# caching-allocator replay never sees. A fake trace, and a GPU preset traced on CPU tensors, must not
# call ``get_paged`` (it would allocate real managed memory, or fail without a driver): there the
# buffer is ``zeros_like`` of the same shape and dtype, booked as managed. The bitsandbytes update
# then runs on plain tensors (no ``is_paged``: nothing to prefetch), the same kernels the non-paged
# optimizer traces. On the ``cpu`` device bitsandbytes itself falls back to plain tensors (with a
# warning memfit does not repeat): nothing is managed.
#
# NOTE [ Loaded states are paged again ]
# bitsandbytes' ``load_state_dict`` casts every state to its parameter's device: a paged optimizer
# resumed from a checkpoint (or rebuilt by OOM adaptation, which moves states through state dicts)
# would hold its large states in the caching allocator from then on, a different memory than the one
# predicted. memfit's subclass copies each loaded moment of a tensor it pages into a new managed
# buffer (booked as managed, as at the first step).
_CLASSES: dict[str, type] = {}


def paged_class(name: str) -> type:
    """bitsandbytes' ``name`` with its state buffers reported as managed (NOTE [ Managed states ])."""
    if name not in _CLASSES:
        import bitsandbytes.optim as bnb_optim
        base = getattr(bnb_optim, name)

        def __init__(self, params, *, gpu: bool, placement, **defaults):
            base.__init__(self, params, **defaults)
            self.memfit_gpu, self.memfit_placement = gpu, placement

        def get_state_buffer(self, p: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
            from torch._subclasses.fake_tensor import FakeTensor
            if not self.memfit_gpu or p.numel() < MANAGED_MIN_ELEMENTS:
                return torch.zeros_like(p, dtype=dtype, device=p.device)
            if p.device.type == "cuda" and not isinstance(p, FakeTensor):
                buffer = base.get_state_buffer(self, p, dtype)  # bitsandbytes' own: cudaMallocManaged
            else:
                buffer = torch.zeros_like(p, dtype=dtype, device=p.device)
            self.memfit_placement.mark_managed(buffer)
            return buffer

        def load_state_dict(self, state_dict, *args, **kwargs):
            base.load_state_dict(self, state_dict, *args, **kwargs)
            if not self.memfit_gpu:
                return
            for p, state in self.state.items():  # NOTE [ Loaded states are paged again ]
                for key in ("state1", "state2") if p.numel() >= MANAGED_MIN_ELEMENTS else ():
                    value = state.get(key)
                    if isinstance(value, torch.Tensor) and not getattr(value, "is_paged", False):
                        state[key] = get_state_buffer(self, p, value.dtype).copy_(value.reshape(p.shape))

        _CLASSES[name] = type(name, (base,), {"__init__": __init__, "get_state_buffer": get_state_buffer,
                                              "load_state_dict": load_state_dict, "__module__": __name__})
    return _CLASSES[name]
