"""Forked worker processes that the planner hands jobs to one by one, each to a process it picks.

``concurrent.futures.ProcessPoolExecutor`` hands a job to whichever worker takes it first. A fake
trace of torchao's update compiles a graph per parameter shape: 15 s of the process that compiles
them on a cold cache, 0.5 s for that process to trace the same update again (the graphs are in its
memory), and 3 s for another process (it loads the 9 graphs of GPT-2 from Inductor's disk cache).
So memfit.planner.workers picks the process: these are plain forked processes, one pipe each, and
a job goes to the process it names (NOTE [ A compile's traces in the process that compiled it ] in
memfit.planner.workers).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait


# NOTE [ A worker outlives no one ]
# A worker waits for its next job on its pipe, and stops at the pipe's end of file. Forked, it held
# its own copy of the pipe's other end (the one its parent sends on), so that end of file never came:
# when the planner's process was killed (an OOM kill of one search of ``memfit plan --methods``), its
# idle workers waited for ever, holding the pipes and process sentinels of their parent's parent, which
# then waited for them too. So a worker closes its copy first; a worker whose parent is gone while it
# traces stops when it tries to answer.
def _serve(conn, ours, fn: Callable, first: Callable) -> None:
    """A worker's loop: answer ``first()`` once, then ``fn(job)`` for each job until told to stop, or
    until the process that forked it is gone (NOTE [ A worker outlives no one ])."""
    ours.close()
    import torch
    torch.set_num_threads(1)
    try:
        conn.send((True, first()))
    except Exception as e:  # noqa: BLE001 - told to the parent, which runs the jobs itself
        conn.send((False, RuntimeError(repr(e))))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            answer = (True, fn(job))
        except BaseException as e:  # noqa: BLE001 - raised in the parent, as the executor does
            answer = (False, e)
        try:
            conn.send(answer)
        except OSError:  # the process that forked it is gone
            return
        except Exception as e:  # noqa: BLE001 - an answer that does not pickle: say what it was
            conn.send((False, RuntimeError(_unpicklable(answer, e))))


def _unpicklable(answer: tuple, error: Exception) -> str:
    """What a worker says in place of an answer that does not pickle: an exception's own type, message
    and traceback (Dynamo's errors hold closures), else why the result did not pickle."""
    ok, value = answer
    if ok:
        return f"a trace's result does not pickle ({type(error).__name__}: {error})"
    import traceback
    where = "".join(traceback.format_exception(value)[-6:]).rstrip()
    return f"{type(value).__name__}: {value}\n(in a worker process:)\n{where}"


class ForkedProcesses:
    """``count`` processes forked from this one, each running ``fn`` on the jobs sent to it.

    ``first()`` runs in each process before any job; :attr:`firsts` holds what each answered (None
    where it raised)."""

    def __init__(self, count: int, fn: Callable, first: Callable) -> None:
        context = multiprocessing.get_context("fork")
        self._conns, self._procs = [], []
        for _ in range(count):
            parent, child = context.Pipe()
            proc = context.Process(target=_serve, args=(child, parent, fn, first), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._busy: dict[int, Future] = {}
        self.answers = 0
        """How many jobs have answered (a waiter in turns goes on once it moves: memfit.planner.turns)."""
        self.firsts = []
        for conn in self._conns:
            try:
                ok, answer = conn.recv()
            except EOFError:
                ok, answer = False, None
            self.firsts.append(answer if ok else None)

    @property
    def count(self) -> int:
        return len(self._procs)

    def idle(self) -> list[int]:
        return [i for i in range(self.count) if i not in self._busy]

    def submit(self, i: int, job) -> Future:
        """Send ``job`` to process ``i`` (idle); its future is set by :meth:`wait_any`."""
        assert i not in self._busy, i
        future: Future = Future()
        try:
            self._conns[i].send(job)
        except (BrokenPipeError, OSError) as e:
            raise BrokenProcessPool(f"worker {i} is gone: {e}") from e
        self._busy[i] = future
        return future

    def wait_any(self, timeout: float | None = None) -> None:
        """Block until a busy process answers (at most ``timeout`` seconds; 0: take only the answers
        already there); set the future of each that has."""
        if not self._busy:
            return
        ready = wait([self._conns[i] for i in self._busy], timeout)
        for i in [i for i in list(self._busy) if self._conns[i] in ready]:
            future = self._busy.pop(i)
            self.answers += 1
            try:
                ok, answer = self._conns[i].recv()
            except (EOFError, OSError) as e:  # the process died (killed for memory?)
                broken = BrokenProcessPool(f"worker {i} died")
                future.set_exception(broken)  # (whoever waits for it learns it, not only this caller)
                raise broken from e
            if ok:
                future.set_result(answer)
            else:
                future.set_exception(answer)

    def close(self) -> None:
        """Stop the processes: those idle when told, those running a job at once (no one waits)."""
        for i, (conn, proc) in enumerate(zip(self._conns, self._procs)):
            if i in self._busy:
                proc.terminate()
            else:
                try:
                    conn.send(None)
                except OSError:
                    proc.terminate()
        for conn, proc in zip(self._conns, self._procs):
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        self._busy.clear()
