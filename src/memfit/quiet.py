"""Quiet: warnings memfit expects, and the profiler's C++ chatter.

memfit runs the user's step many times over (fake traces for predictions, the planner's
candidates, a report's ablations); warnings those runs raise (a deprecated argument of the
user's model, autocast on a CPU) were already shown, or belong to the real run, and are silenced
there with :func:`silenced_warnings`. The profiler's kineto writes start/stop messages straight
to file descriptor 2; :class:`QuietProfiler` sends them to /dev/null. Values memfit makes up in
place of a checkpoint's (:func:`stand_in_values`) are not the user's step: what a trace assumes
about them is not listed in its report.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import warnings

LIBRARY_IMPORT_CHATTER = ("bitsandbytes.backends.cpu.ops", "torch.utils._pytree")
"""Loggers that warn at import about what memfit's users cannot act on: bitsandbytes' optional CPU
inference kernel (``kernels`` not installed; training never uses it) and torchao's pytree
registrations (a deprecation inside torchao), both shown when peft imports them."""


def quiet_library_loggers() -> None:
    """The memfit command shows only errors from :data:`LIBRARY_IMPORT_CHATTER` (``--debug`` shows all)."""
    for name in LIBRARY_IMPORT_CHATTER:
        errors_only(name)


def errors_only(logger: str) -> None:
    """Logger ``logger`` shows errors only. (Set only when it does not already: each ``setLevel`` clears
    the cache of every logger in the process, 0.4 ms with torch's, and traces ask thousands of times.)"""
    import logging
    log = logging.getLogger(logger)
    if log.level != logging.ERROR:
        log.setLevel(logging.ERROR)


@contextlib.contextmanager
def logger_errors_only(logger: str):
    """Logger ``logger`` shows errors only inside the block (a library's retries, or its report of each object it
    makes), then its level as it was."""
    import logging
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def silenced_warnings():
    """No warning is shown inside the block (the filters are restored after it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def quiet_fd2():
    """Send file descriptor 2 to /dev/null for the duration (only around profiler start/stop)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (e.g. captured): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class QuietProfiler:
    """A ``torch.profiler.profile`` whose start and stop print nothing."""

    def __init__(self, prof):
        self.prof = prof

    def __enter__(self):
        with quiet_fd2():
            self.prof.start()
        return self.prof

    def __exit__(self, *exc):
        with quiet_fd2():
            self.prof.stop()
        return False


_STAND_IN = contextvars.ContextVar("memfit_stand_in_values", default=False)


@contextlib.contextmanager
def stand_in_values():
    """Inside the block memfit gives a loaded model values a checkpoint would have given it (the
    model's own initialisation: memfit.techniques.loading). A fake trace's assumptions about those
    values (e.g. ``trunc_normal_``'s rejection loop, ``.any()`` assumed False for each weight) are
    about no step the user runs, and :func:`in_stand_in_values` tells the tracker not to list them."""
    token = _STAND_IN.set(True)
    try:
        yield
    finally:
        _STAND_IN.reset(token)


def in_stand_in_values() -> bool:
    return _STAND_IN.get()
