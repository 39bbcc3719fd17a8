"""Host placement: moving tensors between the training device and host memory.

Offloading (optimizer states, activations, EMA weights) copies tensors to host memory and back.
On CUDA the host copy is pinned and the copies are asynchronous. On a CPU-only machine the
training device *is* host memory, so an offload cannot lower the process's memory; memfit still
makes the copy and tells the memory tracker (the step's observer) that the copy lives on the
host, so the device-side saving is accounted per device and the mechanics (exact round trips)
can be tested anywhere.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from memfit.observer import NullObserver


class HostPlacement:
    """Copies to and from host memory, reported to the step's observer."""

    def __init__(self) -> None:
        self.observer = NullObserver()
        self.out_stream = None
        """CUDA: the side stream copies to the host run on (:meth:`copy_out`)."""

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            host = t.detach().clone()
        else:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t.detach(), non_blocking=True)
        self.observer.host(host)
        return host

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return host.clone()
        return host.to(device, non_blocking=True)

    def copy_out(self, t: torch.Tensor, into: torch.Tensor | None = None):
        """Copy ``t`` to the host without holding up the compute stream: on CUDA on
        :attr:`out_stream`, after what the compute stream has queued. Into ``into``, or a pinned
        buffer made now (:meth:`to_host`). Returns (the host copy, the copy's CUDA event; None where
        the copy is done when this returns). The planner's op recorder sees it as ``"out"``
        (:func:`running`). ``t``'s memory must not be reused before the event: the caller keeps
        ``t``, or records it on :attr:`out_stream`."""
        cuda = t.device.type == "cuda"
        with doing("out"):
            if cuda:
                if self.out_stream is None:
                    self.out_stream = torch.cuda.Stream(device=t.device)
                self.out_stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.out_stream) if cuda else contextlib.nullcontext():
                host = self.to_host(t) if into is None else into.copy_(t.detach(), non_blocking=True)
                if not cuda:
                    return host, None
                event = torch.cuda.Event()
                event.record(self.out_stream)
        return host, event

    def mark_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` was made on the host (e.g. a CPU shadow copy); account it there."""
        self.observer.host(t)
        return t

    def on_host(self):
        """What is made inside the block is host memory (a step's work on the host), accounted there."""
        return self.observer.on_host()

    def mark_managed(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` is CUDA managed memory (a paged optimizer's state), or stands for it in a trace."""
        self.observer.managed(t)
        return t


_WHERE = threading.local()


def running() -> str | None:
    """What a host-memory technique is doing on this thread, for the planner's op recorder (its
    time model): ``"out"`` while gradients are copied out on a stream of their own, ``"host"`` while
    the offloaded optimizer updates on the host and copies parameters back (a worker thread),
    ``"background"`` while the EMA copies and averages beside the next step, ``"in"`` while weights
    are copied to the device ahead of their use on a side stream (swap_blocks); None otherwise."""
    return getattr(_WHERE, "now", None)


@contextlib.contextmanager
def doing(what: str):
    """Mark the work inside as :func:`running` ``what``."""
    before = running()
    _WHERE.now = what
    try:
        yield
    finally:
        _WHERE.now = before
