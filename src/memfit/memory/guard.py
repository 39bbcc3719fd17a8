"""BudgetGuard: a device-memory limit you choose, enforced with CUDA's own out-of-memory error.

On a GPU, an allocation that does not fit raises ``torch.OutOfMemoryError`` and the training
loop can recover (``memfit.training.adapt``). A CPU has no such limit: the OS swaps, or kills the
process. So that training under ``--budget`` behaves the same everywhere, ``memfit train`` on a
CPU runs the step under this guard: a ``TorchDispatchMode`` that sees every storage an ATen op
creates (forward, backward, recomputation, optimizer), holds only weak references to them
(``memfit.memory.storages.LiveStorages``, which reports the frees), and raises
``torch.OutOfMemoryError`` as soon as the live device bytes pass the budget. Tensors placed on the host (offloaded optimizer states and activations,
EMA weights on the host) are not device memory and are not counted, as on a GPU.

Cost: one Python call per ATen op (a few microseconds), so the guard is on only when a budget is
given. What it cannot see: scratch memory inside a kernel (it never reaches Python; the
estimate adds it from probes, so the planner's plans keep a margin for it) and tensors made
outside ATen (``torch.load``; :meth:`watch` adds those).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit import rng_ops
from memfit.memory.storages import LiveStorages
from memfit.units import fmt_bytes


class BudgetGuard(TorchDispatchMode):
    """Raise ``torch.OutOfMemoryError`` when live device memory would pass ``budget_bytes``.

    Enter it before the model is built so that every storage is seen; :meth:`watch` adds tensors
    that were made outside ATen ops (e.g. loaded from a checkpoint). It is also a TrainStep
    observer: techniques report host-placed tensors through :meth:`host`.
    """

    thread_local = True  # (a dispatch mode sees only its own thread: memfit.observer)

    def __init__(self, budget_bytes: int):
        super().__init__()
        self.budget_bytes = int(budget_bytes)
        self.live_bytes = 0
        self.peak_bytes = 0
        """Peak of live device bytes since :meth:`reset_peak`."""
        self.armed = True
        self._paused = False
        self._storages = LiveStorages(self._allocated, self._freed, self._hosted)  # tokens: bytes counted

    # -- observer protocol (memfit.observer.NullObserver) ----------------------------------------------
    def phase(self, name: str):
        return contextlib.nullcontext()

    def host(self, tensors) -> None:
        """These tensors live in host memory: stop counting them (and never count them again)."""
        self._storages.host(tensors)

    def managed(self, tensors) -> None:
        """CUDA managed memory (a paged optimizer's states) is not the allocator's: not counted either."""
        self._storages.host(tensors)

    def on_host(self):
        """Storages made inside the block are host memory: not counted."""
        return self._storages.on_host()

    @property
    def storages(self) -> LiveStorages:
        """The storages counted (memfit.memory.adapters.fsdp_resizes shows it FSDP2's resizes)."""
        return self._storages

    # -- counting -------------------------------------------------------------------------------
    def watch(self, tensors) -> None:
        """Count tensors made outside ATen ops (no error is raised here)."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._storages.see(t)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    @contextlib.contextmanager
    def paused(self):
        """Neither count nor enforce (e.g. while memfit traces a plan on fake tensors)."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        self._storages.see_outputs(out, func)
        if self.armed and self.live_bytes > self.budget_bytes:
            live = self.live_bytes
            del out  # freed as the error unwinds, like an allocation that failed
            raise torch.OutOfMemoryError(
                f"memfit budget guard: {func.overloadpacket.__name__} would raise live device memory to "
                f"{fmt_bytes(live)}, over the budget of {fmt_bytes(self.budget_bytes)}")
        return out

    # -- LiveStorages hooks: a storage's token is the number of bytes it counts for ---------------
    def _allocated(self, t: torch.Tensor, nbytes: int, func, on_host: bool) -> int:
        if on_host:
            return 0
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return nbytes

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def _hosted(self, nbytes: int) -> int:
        self.live_bytes -= nbytes
        return 0


rng_ops.register(BudgetGuard)  # (memfit.rng_ops)
