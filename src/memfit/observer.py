"""The step's observer: who watches a TrainStep run.

A TrainStep announces its phases (``zero_grad``, ``forward``, ``backward``, ``optimizer``) through
``observer.phase(name)``, and techniques that copy tensors to host memory report the copies
through ``observer.host(tensors)``; a paged optimizer reports the states it keeps in CUDA managed
memory through ``observer.managed(tensors)``. memfit's memory tracker and the CPU budget guard are
observers; by default nobody watches (:class:`NullObserver`).
"""

from __future__ import annotations

import contextlib


class NullObserver:
    """Watches nothing."""

    thread_local = False
    """Whether it sees only the thread that runs the step (a dispatch mode, as memfit's tracker and
    budget guard are): then a technique runs on that thread what it would hand to a worker."""

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def host(self, tensors) -> None:
        pass

    def on_host(self) -> contextlib.AbstractContextManager:
        """What the step makes inside the block is host memory (work done on the host)."""
        return contextlib.nullcontext()

    def managed(self, tensors) -> None:
        """These tensors are CUDA managed (unified) memory, outside PyTorch's caching allocator
        (memfit.techniques.optimizers_paged)."""
