"""Garbage collection around a trace: collect only what the trace made."""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


CALLER_FROZE: bool | None = None
"""Whether the caller froze the heap itself before calling memfit (None: count the frozen objects to know).
``gc.get_freeze_count`` walks every frozen object (CPython keeps no count of them): 64 ms at 800,000, at
every trace. A caller that freezes before each call (a test runner: NOTE [ A frozen heap per test ] in
tests/conftest.py) says so here instead."""


def _caller_froze() -> bool:
    return gc.get_freeze_count() > 0 if CALLER_FROZE is None else CALLER_FROZE


# NOTE [ Frozen heap ]
# A step is traced with ``gc.collect()`` before each step, so that cycles left by the last step
# free their storages at a known point. With torch and transformers imported the heap holds about
# a million objects, and every full collection walks all of them (~0.15 s here); the automatic
# collections that the trace's own allocations trigger walk them too. None of those objects can be
# garbage the trace needs freed: the trace's storages are made after the trace starts. So the heap
# is frozen (``gc.freeze``: moved to a generation collections skip) once, after one full collection,
# and unfrozen when the trace ends; collections inside the trace then walk only the objects the
# trace made. What a collection frees is unchanged, except a cycle through an object that existed
# before the trace and became garbage inside it, which waits for the next collection after the
# trace (it holds no tracked storage). If the caller froze the heap already, it is left as it is.
#
# A measured (real) run collects once before freezing: garbage from before may hold real memory
# that the allocator and the process's resident size would still count; it is the one collection
# before the run (``profile`` adds none: in a test process each walks ~550,000 objects, 0.25 s, and
# doubled they were 16% of the suite's CPU time). A fake trace skips that
# collection (another ~0.15 s): it tracks only storages made inside it, and the garbage it freezes
# is collected after the trace.
@contextlib.contextmanager
def frozen_heap(*, collect: bool = True):
    """Collect once (if ``collect``), then freeze the heap until the block ends (NOTE [ Frozen heap ])."""
    if collect:
        gc.collect()
    if _caller_froze():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# NOTE [ Streams make no cycles ]
# Outside its traces the planner computes on allocation streams in Python: pairs them, draws them at
# another batch, deepens them to the full depth (~10^5 events), replays them through the allocator
# models. That makes millions of tuples, lists and dicts, and no reference cycle; but each 700 objects
# made start an automatic collection, and every tenth of those a full one over the million objects
# torch and transformers hold (the heap is frozen only inside a trace): 5-6% of ``memfit fit``'s CPU
# time went to collections that found nothing. So such a computation runs with automatic collections
# off (``gc.disable``; ``gc.collect`` still works), counted across threads and nested calls, and they
# are on again when the last one ends, unless they were off before the first began.
_computing = 0
_were_enabled = False
_lock = threading.Lock()


def without_collections(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` (a computation that makes no reference cycles) with automatic garbage collections off
    while it runs (NOTE [ Streams make no cycles ])."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        global _computing, _were_enabled
        with _lock:
            if _computing == 0:
                _were_enabled = gc.isenabled()
                gc.disable()
            _computing += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _computing -= 1
                if _computing == 0 and _were_enabled:
                    gc.enable()
    return wrapper
