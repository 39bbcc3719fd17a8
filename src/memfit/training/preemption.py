"""Preemption: SIGTERM or SIGUSR1 ends a run cleanly, after the step it is in, with a checkpoint.

On SLURM, Kubernetes and spot instances a job is told to stop with SIGTERM and given some seconds
(Kubernetes' grace period, 30 s by default; SLURM's KillWait); SLURM also sends SIGUSR1 ahead of
time when asked (``#SBATCH --signal=USR1@120``). Without a handler the process dies at once and the
steps since the last checkpoint are lost.

With :func:`catching` around the loop, the first such signal only raises a flag. The loop finishes
the step it is in (a step cut in its middle could not be saved: its parameter update may be half
applied), saves its checkpoint, and returns; ``memfit train`` then exits 0 and prints the command
that resumes. Ranks agree on the flag with the collective that averages the step's loss (one
all-reduce of two numbers), so every rank stops after the same step and the DCP save, which is
collective, finds them all.

A second signal exits at once (status 128 + the signal's number): what is on disk is the last
complete checkpoint (saves are atomic). NOTE [ One event, several deliveries ]: the same stop can
reach a process twice within milliseconds: SLURM and systemd signal every process of a job, and
torchrun's agent, signalled too, passes the signal on to its workers. A second signal within
:data:`SAME_EVENT_SECONDS` of the first is the same event, not a second request.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

SIGNALS = ("SIGTERM", "SIGUSR1")
SAME_EVENT_SECONDS = 1.0


class Stop:
    """The flag a signal raises: which signal, and when."""

    def __init__(self):
        self.signal: str | None = None
        self._at = 0.0

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.signal is None:
            self.signal, self._at = name, now
            return
        if now - self._at < SAME_EVENT_SECONDS:
            return  # NOTE [ One event, several deliveries ]
        os.write(2, f"memfit train: {name} again: exiting now; the last complete checkpoint stays\n".encode())
        os._exit(128 + signum)


@contextlib.contextmanager
def catching():
    """Within the block, SIGTERM and SIGUSR1 set the :class:`Stop` it yields instead of ending the
    process (in the main thread; elsewhere signals cannot be caught, and the flag stays down)."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {}
    for name in SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, stop._handle)
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
