"""Several chains of planner work in one process, taking turns while the trace workers run.

NOTE [ Searches in turns ]
``memfit fit`` searches each card architecture's cells in a chain: a shallow pair of traces, then the
planner's own figures from them (allocations deepened to full depth and replayed through the
caching-allocator model, the ops' times), then the next pair. One chain at a time, the two worker
processes waited for the planner, and the planner for them: on Llama-2-7B, after every group's first
traces, 76 traces (52 s of worker CPU) and ~20 s of the planner's own CPU took 55 s on two cores. The
chains of different architectures depend on nothing of each other's, so :func:`in_turns` runs them
together: each in a thread, one running at a time. A thread hands its turn on only where it would
otherwise block, waiting for traces (memfit.planner.workers.Workers.map) or for the threads it started,
and the next to run is the first, in the order they stopped, that can go on. So while one chain waits
for its pair, another computes its figures or hands out its own pair.

These are turns, not parallel Python: a thread runs from one wait to the next with no other planner
thread running, so the books, caches and pool are used as by one thread, in an order that depends on
the traces' timing. Every figure is the same in any order (a trace, a replay, a drawn line confirmed by
a third traced batch are functions of their plan and batch), so the table is the same; only which
thread traced a shared job first differs, and a job two threads ask at once is traced once
(``Workers`` keeps the jobs in flight). Where the traces run here, in turn (one core, no fork, CUDA
traces), the chains run one after another, as before.

What a thread must keep across a turn is its own: its warning filters (``warnings.catch_warnings``
swaps the module's list, and blocks of threads in turns end out of order) are put back when it
resumes. A waiter for traces goes on once any job answers, as a single map waits. An error in one
chain, or an interrupt, cancels the turns: every thread raises :class:`Cancelled` at its next wait,
and the first real error is raised where they were gathered, once they have stopped.

On two cores this buys no time: the planner and its two workers keep both busy (on Llama-2-7B, 143 s
of CPU in an ~80 s ``fit``); the time in which no process traced fell from 23 to 14 s. Where there are
more cores than two, one chain at a time would bound the time: that is where turns should pay
(not measured here).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

_state = threading.local()
CANCEL_WAIT = 5.0
"""Seconds an interrupted gather waits for each thread to reach its next wait and stop."""


class _Parked:
    """A thread waiting for its turn: ``ready()`` (None: it can go on at once), and ``poll`` (a blocking
    wait on the trace workers, which it runs when no one can go on)."""

    def __init__(self, ready: Callable[[], bool] | None, poll: Callable[[], None] | None) -> None:
        self.ready, self.poll = ready, poll
        self.event = threading.Event()

    def can_go(self) -> bool:
        return self.ready is None or self.ready()


class Cancelled(BaseException):
    """Raised at a thread's next wait once the turns are cancelled (the command was interrupted)."""


def _warnings_state() -> tuple:
    return warnings.filters, warnings.showwarning


def _restore_warnings(state: tuple) -> None:
    """A thread's warning filters as it left them (``warnings.catch_warnings`` swaps the module's list: the
    blocks of threads in turns would otherwise end out of order)."""
    if (warnings.filters, warnings.showwarning) != state:
        warnings.filters, warnings.showwarning = state
        warnings._filters_mutated()


class Turns:
    """Threads that run one at a time (NOTE [ Searches in turns ])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: list[_Parked] = []
        self.cancelled = False

    def wait(self, done: Callable[[], bool], poll: Callable[[], None] | None = None) -> None:
        """Until ``done()``: where another thread can go on, hand it the turn and wait to be given it back;
        where none can, ``poll()`` (block on the trace workers: some thread's trace ends); where no thread
        can poll either, a parked one that can. Call only in a thread that has the turn."""
        while not done():
            if self.cancelled:
                raise Cancelled()
            with self._lock:
                nxt = self._next()
                if nxt is None and poll is None:
                    nxt = next((p for p in self._parked if p.poll is not None), None)
                    if nxt is None:
                        raise RuntimeError("planner turns: every thread waits, and none for the trace workers")
                    self._parked.remove(nxt)
                if nxt is not None:
                    me = _Parked(done, poll)
                    self._parked.append(me)
                    nxt.event.set()
            if nxt is None:
                poll()
            else:
                state = _warnings_state()
                try:
                    me.event.wait()
                finally:  # (interrupted too)
                    _restore_warnings(state)

    def _cancel(self) -> None:
        """Every parked thread wakes and raises :class:`Cancelled`; the running one does at its next wait."""
        with self._lock:
            self.cancelled = True
            for p in self._parked:
                p.event.set()
            self._parked.clear()

    def _next(self) -> _Parked | None:
        """The first parked thread that can go on, taken off the list (under the lock)."""
        for p in self._parked:
            if p.can_go():
                self._parked.remove(p)
                return p
        return None

    def _hand_on(self) -> None:
        """A thread ends: the turn to the first that can go on, else to one that polls, else to the first
        (which finds no one to poll for it, and raises: an error, not a hang)."""
        with self._lock:
            nxt = self._next() or next((p for p in self._parked if p.poll is not None), None) or \
                (self._parked[0] if self._parked else None)
            if nxt is not None:
                if nxt in self._parked:
                    self._parked.remove(nxt)
                nxt.event.set()

    def gather(self, fns: list[Callable[[], object]]) -> list:
        """Each ``fn()`` in a thread of its own, in turns with the others; their results, in order (the
        first exception raised, once all have ended). Call only in a thread that has the turn."""
        results: list = [None] * len(fns)
        errors: list[BaseException | None] = [None] * len(fns)
        ended = [False] * len(fns)
        state = _warnings_state()

        def run(i: int, fn: Callable, parked: _Parked) -> None:
            parked.event.wait()
            _state.turns = self
            _restore_warnings(state)
            try:
                if self.cancelled:
                    raise Cancelled()
                results[i] = fn()
            except BaseException as e:  # (re-raised where they were gathered; the others stop at their next wait)
                errors[i] = e
                self._cancel()
            finally:
                ended[i] = True
                self._hand_on()

        threads = []
        for i, fn in enumerate(fns):
            parked = _Parked(None, None)
            with self._lock:
                self._parked.append(parked)
            thread = threading.Thread(target=run, args=(i, fn, parked), name=f"memfit-turn-{i}", daemon=True)
            thread.start()
            threads.append(thread)
        try:
            self.wait(lambda: all(ended))
        except BaseException as e:  # (interrupted, here or in a thread: every thread stops at its next wait)
            self._cancel()
            for thread in threads:
                thread.join(timeout=CANCEL_WAIT)
            first = _first_error(errors)
            if isinstance(e, Cancelled) and first is not None:
                raise first from None
            raise
        for thread in threads:
            thread.join()
        first = _first_error(errors) or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


def _first_error(errors: list) -> BaseException | None:
    """The first error a thread raised of its own (not :class:`Cancelled` by another's)."""
    return next((e for e in errors if e is not None and not isinstance(e, Cancelled)), None)


def in_turns(fns: list[Callable[[], object]], together: bool = True) -> list:
    """Each ``fn()``, in turns (NOTE [ Searches in turns ]) where ``together``, else one after another; their
    results, in order."""
    if not together or len(fns) < 2:
        return [fn() for fn in fns]
    turns = getattr(_state, "turns", None)
    if turns is None:
        turns = _state.turns = Turns()
        try:
            return turns.gather(fns)
        finally:
            _state.turns = None
    return turns.gather(fns)


def current() -> Turns | None:
    """The turns this thread takes part in (None: it runs alone)."""
    return getattr(_state, "turns", None)
