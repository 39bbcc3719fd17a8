"""Worker processes for independent fake traces: one per CPU core, forked.

A fake trace is single-threaded Python (the fake-tensor dispatch), so the planner's independent
traces (each technique value alone, the two depths of a shallow pair) run in parallel in processes.
They are forked from the planner's process, so each starts with the modules imported and the job
function and its state as they are (nothing is pickled but the jobs and their small results).

Autograd does not survive a fork once the parent has run a backward pass ("Unable to handle
autograd's threading in combination with fork-based multiprocessing"), so once the workers exist
every trace runs in them, the parent runs none, and a new pool first checks, with a tiny backward
in each worker, that autograd works there. Where it does not (the parent ran a backward before: a
test session, a notebook), where the traces use CUDA (``--device cuda``, or a preset traced on a
GPU machine: a forked child cannot initialise CUDA), where ``fork`` is not available (macOS,
Windows), with one core, or with ``MEMFIT_PLAN_WORKERS=1``, the jobs run here in turn, as they do
after a worker died.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

from memfit.planner.processes import ForkedProcesses
from memfit.planner.turns import current as current_turns

MAX_WORKERS = 8


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


# NOTE [ A compile's traces in the process that compiled it ]
# A process that compiled a graph (torchao's update) traces it again fast: the graphs are in its
# memory, where another process loads them from Inductor's disk cache, several times slower. So the
# workers are plain forked processes that memfit hands each job to (memfit.planner.processes), and a
# job with an affinity key (what it compiles: ``memfit.planner.traces.compiles``) runs in a process
# that was given a job of its key, waiting for it where it is busy; a key no process has had goes to
# any. Two plans of one key then run in turn in one process. Measured: docs/planner-notes.md.
class Workers:
    """Runs ``fn(job)`` for lists of jobs, in forked processes when there are several cores.

    ``affinity(job)``: a key naming what the job compiles (None: nothing); a job runs in a process
    that ran a job of its key before, waiting for it where it is busy (NOTE [ A compile's traces in
    the process that compiled it ])."""

    def __init__(self, fn: Callable, fork: bool = True, affinity: Callable | None = None) -> None:
        """``fork``: False where the jobs use CUDA (a forked child cannot initialise it)."""
        self.fn = fn
        self.affinity = affinity
        self.count = worker_count() if fork else 1
        self._pool: ForkedProcesses | None = None
        self._warm: list[set] = []
        """Per process, the affinity keys of the jobs it was given."""
        self._queued: list = []
        """Background jobs (:meth:`start`) not handed to a worker yet, in order."""
        self._background: dict = {}
        """Background job -> its future, once handed to a worker, until a :meth:`map` takes it."""
        self._inflight: dict = {}
        """Job -> its future, while the :meth:`map` that handed it out waits: a map of another planner
        thread that asks it takes that future (NOTE [ Searches in turns ] in memfit.planner.turns)."""

    # NOTE [ Jobs in the background, and after the compile they share ]
    # Two things would keep a core idle or busy for nothing while the planner measures before its walk:
    #
    # - **A compile done twice.** Both traces of a shallow pair that compiles (torchao's update) would
    #   compile it at once, one per worker, where the deeper one, run after the shallower, loads the
    #   graphs from Inductor's cache. :meth:`Workers.map` takes ``after``: a job starts only once the job
    #   it names has ended (and ``skip``: a job the result of that one makes needless does not run).
    # - **A wait between two batches.** The values that only add work are measured after the others,
    #   and only where the others leave the question open (NOTE [ Work-adding values when the default
    #   plan fits ] in memfit.planner.baseline). :meth:`Workers.start` queues them behind the others
    #   at once, so the worker the compile leaves free traces them; :meth:`Workers.cancel` drops those
    #   not started where they are not needed. Here (one process) they run only when asked for.
    #
    # Measured: docs/planner-notes.md.
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
            new = [job for job in dict.fromkeys(jobs)
                   if job not in self._background and job not in self._queued and job not in self._inflight]
            self._queued += new

    def cancel(self, which: Callable | None = None) -> list:
        """Drop the background jobs not handed to a worker yet (those running finish; no one waits);
        returns them, in order. ``which(job)``: those to drop (default: all)."""
        dropped = [job for job in self._queued if which is None or which(job)]
        self._queued = [job for job in self._queued if job not in dropped]
        return dropped

    def _map_on_pool(self, jobs: list, after: dict, skip: Callable | None) -> list:
        mine: list = []  # (the jobs this map hands out or takes from the background: in flight while it waits)
        try:
            return self._run_on_pool(jobs, after, skip, mine)
        finally:
            for job in mine:
                self._inflight.pop(job, None)

    def _run_on_pool(self, jobs: list, after: dict, skip: Callable | None, mine: list) -> list:
        own = list(dict.fromkeys(jobs))
        self._queued = [job for job in self._queued if job not in own]
        futures: dict = {}
        todo = list(own)
        while True:
            # (handed out already: from the background, or by another planner thread's map)
            for job in [j for j in todo if j in self._inflight or j in self._background]:
                todo.remove(job)
                if job in self._inflight:
                    futures[job] = self._inflight[job]
                else:
                    futures[job] = self._inflight[job] = self._background.pop(job)
                    mine.append(job)
            ready = [j for j in todo if after.get(j) not in own or (after[j] in futures and futures[after[j]].done())]
            for job in sorted(ready, key=lambda j: not self._is_warm(j)):  # (a warm process to its key's job first)
                if skip and after.get(job) in futures and skip(job, futures[after[job]].result()):
                    todo.remove(job)
                    futures[job] = _done(SKIPPED)
                    continue
                worker = self._worker_for(job)
                if worker is not None:
                    todo.remove(job)
                    futures[job] = self._inflight[job] = self._submit(worker, job)
                    mine.append(job)
            self._hand_background()
            if not todo and all(f.done() for f in futures.values()):
                return [futures[job].result() for job in jobs]
            self._wait()

    def _wait(self) -> None:
        """Until a process answers (any job's: it may free a process for a job waiting for one); in turns with
        the other planner threads where there are (NOTE [ Searches in turns ] in memfit.planner.turns)."""
        turns, pool = current_turns(), self._pool
        if turns is None:
            pool.wait_any()
            return
        seen = pool.answers
        turns.wait(lambda: self._pool is not pool or pool.answers != seen, pool.wait_any)
        if self._pool is not pool:  # (another thread found a worker dead: go on here, in turn)
            raise BrokenProcessPool("the trace workers were closed")

    def _hand_background(self) -> None:
        """The background's next jobs to the processes idle now (a worker the jobs leave idle)."""
        for job in list(self._queued):
            worker = self._worker_for(job)
            if worker is not None:
                self._queued.remove(job)
                self._background[job] = self._submit(worker, job)

    def pump(self) -> None:
        """Take the answers already there and hand the background's next jobs to the processes idle now,
        without waiting: the planner calls it between its own computations (replaying allocations at
        full depth), so that the processes trace the background while it computes (NOTE [ One pool for
        many books ])."""
        if self._pool is not None and (self._queued or self._background):
            try:
                self._pool.wait_any(timeout=0)
                self._hand_background()
            except BrokenProcessPool:  # (the next map finds it broken, and goes on here)
                pass

    def _is_warm(self, job) -> bool:
        """Some process ran a job of ``job``'s affinity key: it waits for that one, which the jobs
        without a key leave to it (two jobs given at once, a full trace and a 4-bit plan's whose
        process compiled the update, ran in turn in that process while the other idled)."""
        key = self.affinity(job) if self.affinity else None
        return key is not None and any(key in keys for keys in self._warm)

    def _worker_for(self, job) -> int | None:
        """An idle process for ``job``: one that ran its affinity key, else, where none did, any (None:
        none is idle, or those that ran its key are busy)."""
        idle = self._pool.idle()
        key = self.affinity(job) if self.affinity else None
        if not idle or key is None:
            return idle[0] if idle else None
        warm = [i for i, keys in enumerate(self._warm) if key in keys]
        return next((i for i in idle if i in warm), None) if warm else idle[0]

    def _submit(self, worker: int, job) -> Future:
        key = self.affinity(job) if self.affinity else None
        if key is not None:
            self._warm[worker].add(key)
        return self._pool.submit(worker, job)

    def _start(self) -> None:
        import torch
        if torch.cuda.is_initialized():  # a forked child could not use CUDA
            self.count = 1
            return
        try:
            pool = ForkedProcesses(self.count, self.fn, autograd_works)
        except OSError:  # no process could be forked
            self.count = 1
            return
        if all(pool.firsts):
            self._pool, self._warm = pool, [set() for _ in range(pool.count)]
        else:  # autograd after fork, or a worker that died
            pool.close()
            self.count = 1

    def close(self) -> None:
        self._queued.clear()
        self._background.clear()
        self._inflight.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None


# NOTE [ One pool for many books ]
# ``memfit fit`` asks one trace book per card architecture (memfit.planner.fit_books), and each card's
# search is a chain: a shallow pair, then the planner's own work on its figures (its allocations
# replayed at full depth, through the caching-allocator model, for every card that asks), then the next
# pair. With a pool per book, the processes idled while the planner computed: on Llama-2-7B, 27 of the
# 98 s no trace ran. So the books share one pool (a :class:`Lane` each, its jobs tagged with the book's
# function), the architectures after the first queue their first traces in its background at once, and
# the planner hands them out while it computes (:meth:`Workers.pump`). The processes are forked once,
# with every book's function: a lane is opened before the first job.
class SharedWorkers(Workers):
    """One pool of processes for several job functions, each asked through its :class:`Lane`."""

    def __init__(self) -> None:
        self._lanes: list[tuple[Callable, Callable | None]] = []
        super().__init__(self._run_tagged, affinity=self._tagged_affinity)

    def lane(self, fn: Callable, affinity: Callable | None = None) -> Lane | Workers:
        """A lane running ``fn`` on its jobs; once the processes are forked (they hold the lanes opened
        before), processes of its own."""
        if self._pool is not None:
            return Workers(fn, affinity=affinity)
        self._lanes.append((fn, affinity))
        return Lane(self, len(self._lanes) - 1)

    def _run_tagged(self, job):
        tag, own = job
        return self._lanes[tag][0](own)

    def _tagged_affinity(self, job):
        tag, own = job
        affinity = self._lanes[tag][1]
        key = affinity(own) if affinity else None
        return None if key is None else (tag, key)


class Lane:
    """One job function's view of a :class:`SharedWorkers` (as a :class:`Workers` of its own); closing it
    leaves the pool to its owner."""

    def __init__(self, shared: SharedWorkers, tag: int) -> None:
        self.shared, self.tag = shared, tag

    @property
    def count(self) -> int:
        return self.shared.count

    def map(self, jobs: list, after: dict | None = None, behind: list = (), skip: Callable | None = None) -> list:
        tag = self.tag
        tagged_skip = (lambda job, result: skip(job[1], result)) if skip else None
        return self.shared.map([(tag, j) for j in jobs], after={(tag, k): (tag, v) for k, v in (after or {}).items()},
                               behind=[(tag, j) for j in behind], skip=tagged_skip)

    def start(self, jobs: list) -> None:
        self.shared.start([(self.tag, j) for j in jobs])

    def cancel(self) -> list:
        return [j for _, j in self.shared.cancel(lambda job: job[0] == self.tag)]

    def pump(self) -> None:
        self.shared.pump()

    def close(self) -> None:
        pass
