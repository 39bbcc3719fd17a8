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

NOTE [ Jobs in the background, and after the compile they share ]
Two things kept a core idle or busy for nothing while the planner measured before its walk (GPT-2
at 8 x 1024 for 2 GiB on the h100-80gb preset, 2 cores):
- **A compile done twice.** torchao's 4-bit update compiles a graph per parameter shape, 14.6 s of
  a worker on a cold cache. Both traces of its shallow pair compiled it at once, one per worker,
  where the deeper one, run after the shallower, loads all 9 graphs from Inductor's cache (3.4 s).
  :meth:`Workers.map` takes ``after``: a job starts only once the job it names has ended (and
  ``skip``: a job the result of that one makes needless does not run).
- **A wait between two batches.** The values that only add work are measured after the others,
  and only where the others leave the question open (NOTE [ Work-adding values when the default
  plan fits ] in memfit.planner.gpu_time). :meth:`Workers.start` queues them behind the others
  at once, so the worker the compile leaves free traces them; :meth:`Workers.cancel` drops those
  not started where they are not needed. Here (one process) they run only when asked for.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
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


SKIPPED = "skipped"
"""The result of a job that ``skip`` found needless (memfit.planner.workers.Workers.map)."""


def _done(result) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


class Workers:
    """Runs ``fn(job)`` for lists of jobs, in forked processes when there are several cores."""

    def __init__(self, fn: Callable, fork: bool = True) -> None:
        """``fork``: False where the jobs use CUDA (a forked child cannot initialise it)."""
        self.fn = fn
        self.count = worker_count() if fork else 1
        self._pool: ProcessPoolExecutor | None = None
        self._queued: list = []
        """Background jobs (:meth:`start`) not handed to a worker yet, in order."""
        self._background: dict = {}
        """Background job -> its future, once handed to a worker, until a :meth:`map` takes it."""

    def map(self, jobs: list, after: dict | None = None, behind: list = (), skip: Callable | None = None) -> list:
        """The results of ``jobs``, in order. ``after``: job -> a job that must end before it starts;
        ``skip(job, result)``: True where the result of the job it waited for makes it needless
        (its result is then :data:`SKIPPED`); ``behind``: jobs queued after these, in the background
        (:meth:`start`); background jobs are waited for, not run again (NOTE [ Jobs in the
        background, and after the compile they share ])."""
        self.start(behind)
        if not jobs:
            return []
        if self.count > 1 and self._pool is None:
            self._start()
        after = after or {}
        if self._pool is None:
            out: dict = {}
            for job in jobs:
                if job not in out:
                    first = after.get(job)
                    out[job] = SKIPPED if skip and first in out and skip(job, out[first]) else self.fn(job)
            return [out[job] for job in jobs]
        try:
            return self._map_on_pool(jobs, after, skip)
        except BrokenProcessPool:  # a worker died (killed for memory?): go on here, in turn
            self.close()
            self.count = 1
            return [self.fn(job) for job in jobs]

    def start(self, jobs: list) -> None:
        """Queue ``jobs`` behind those queued before: the workers a :meth:`map` leaves idle run them
        while it waits, and a later :meth:`map` takes their results. Here (one process) they run
        only when a :meth:`map` asks for them."""
        if self.count > 1:
            new = [job for job in dict.fromkeys(jobs) if job not in self._background and job not in self._queued]
            self._queued += new

    def cancel(self) -> None:
        """Drop the background jobs not handed to a worker yet (those running finish; no one waits)."""
        self._queued.clear()

    def _map_on_pool(self, jobs: list, after: dict, skip: Callable | None) -> list:
        own = list(dict.fromkeys(jobs))
        futures = {job: self._background.pop(job) for job in own if job in self._background}
        self._queued = [job for job in self._queued if job not in own]
        todo = [job for job in own if job not in futures]
        while True:
            running = [f for f in (*futures.values(), *self._background.values()) if not f.done()]
            free = self.count - len(running)
            for job in [j for j in todo if after.get(j) not in own or (after[j] in futures and futures[after[j]].done())]:
                if skip and after.get(job) in futures and skip(job, futures[after[job]].result()):
                    todo.remove(job)
                    futures[job] = _done(SKIPPED)
                    continue
                if free <= 0:
                    break
                todo.remove(job)
                futures[job] = self._pool.submit(_call, job)
                running.append(futures[job])
                free -= 1
            while free > 0 and self._queued:  # (a worker the jobs leave idle: the background's next)
                job = self._queued.pop(0)
                self._background[job] = self._pool.submit(_call, job)
                running.append(self._background[job])
                free -= 1
            if not todo and all(f.done() for f in futures.values()):
                return [futures[job].result() for job in jobs]
            wait(running, return_when=FIRST_COMPLETED)

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
        self._queued.clear()
        self._background.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

