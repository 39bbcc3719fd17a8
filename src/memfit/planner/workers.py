"""Worker processes for independent fake traces: one per CPU core, forked.

A fake trace is single-threaded Python (the fake-tensor dispatch), so the planner's independent
traces (each technique value alone, the two depths of a shallow pair) run in parallel in processes.
They are forked from the planner's process, so each starts with the modules imported and the job
function and its state as they are (nothing is pickled but the jobs and their small results).

Autograd does not survive a fork once the parent has run a backward pass ("Unable to handle
autograd's threading in combination with fork-based multiprocessing"), so once the workers exist
every trace runs in them, the parent runs none, and a new pool first checks, with a tiny backward
in a worker, that autograd works there. Where it does not (the parent ran a backward before: a
test session, a notebook), where the traces use CUDA (``--device cuda``, or a preset traced on a
GPU machine: a forked child cannot initialise CUDA), where ``fork`` is not available (macOS,
Windows), with one core, or with ``MEMFIT_PLAN_WORKERS=1``, the jobs run here in turn, as they do
after a worker died.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

MAX_WORKERS = 8

_job_function: Callable | None = None
"""The function a forked worker runs (set by its initializer; with fork nothing is pickled)."""


def _call(job):
    return _job_function(job)


def _init_worker(fn: Callable) -> None:
    global _job_function
    _job_function = fn
    import torch
    torch.set_num_threads(1)


def worker_count() -> int:
    """Processes for traces: ``MEMFIT_PLAN_WORKERS`` if set, else one per usable CPU core (at most
    ``MAX_WORKERS``); 1 where processes cannot be forked."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    given = os.environ.get("MEMFIT_PLAN_WORKERS", "").strip()
    if given.isdigit() and int(given) >= 1:
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))


def autograd_works() -> bool:
    """A tiny backward pass (run in a forked process: whether autograd survived the fork)."""
    import torch
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()
    return bool(x.grad is not None)


class Workers:
    """Runs ``fn(job)`` for lists of jobs, in forked processes when there are several cores."""

    def __init__(self, fn: Callable, fork: bool = True) -> None:
        """``fork``: False where the jobs use CUDA (a forked child cannot initialise it)."""
        self.fn = fn
        self.count = worker_count() if fork else 1
        self._pool: ProcessPoolExecutor | None = None

    def map(self, jobs: list) -> list:
        if not jobs:
            return []
        if self.count > 1 and self._pool is None:
            self._start()
        if self._pool is None:
            return [self.fn(job) for job in jobs]
        try:
            return list(self._pool.map(_call, jobs))
        except BrokenProcessPool:  # a worker died (killed for memory?): go on here, in turn
            self.close()
            self.count = 1
            return [self.fn(job) for job in jobs]

    def _start(self) -> None:
        import torch
        if torch.cuda.is_initialized():  # a forked child could not use CUDA
            self.count = 1
            return
        pool = ProcessPoolExecutor(self.count, mp_context=multiprocessing.get_context("fork"), initializer=_init_worker,
                                   initargs=(self.fn,))
        try:
            works = pool.submit(autograd_works).result()
        except Exception:  # noqa: BLE001 - autograd after fork, or a worker that died
            works = False
        if works:
            self._pool = pool
        else:
            pool.shutdown(cancel_futures=True)
            self.count = 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
