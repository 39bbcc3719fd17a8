"""Several plan searches at once, each in a forked process of its own (``memfit plan --methods``).

NOTE [ Methods planned side by side ]
The searches of ``--methods`` are independent: each method is planned on its own (NOTE [ Methods
are the user's ]). Run in turn, each leaves cores idle: a full trace confirming its plan on one
worker while the other waits, its prepare stage's one long compile (torchao's 4-bit AdamW) while
the other worker has finished. Llama-2-7B's full, LoRA and QLoRA plans for the rtx4090 preset
took 40 + 18 + 16 s in turn on this 2-core machine, cold. So each search runs in a process forked
from this one (the arguments are not pickled; the results come back pickled), with its own
workers, and the searches fill each other's idle time. A search run so does not trace the next
plans' full traces alongside the one it confirms (``plan(alongside=False)``): the other searches
use those cores. The search expected to take longest (the caller says which: for ``--methods``, full
fine-tuning, whose optimizer choices the adapters' searches leave out) keeps this process's
priority and the others run at a lower one, so they take the cores it leaves idle rather than
slow it down: the three took 60.0 s at one priority, the longest 56.3 s of it. Each search's
progress reaches the bar through a queue, a line per search.

The searches run in turn here, as before, where fork is not available, with one core, where CUDA
is initialised in this process, or where autograd would not survive a fork (this process ran a
backward pass: a test session, a notebook). A search whose process dies (killed for memory) runs
again here; a user error in one is raised here.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queues
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from memfit.errors import UserError
from memfit.planner.progress import NoProgress
from memfit.planner.workers import autograd_works, worker_count

LOWER = 10
"""Niceness of the searches other than the longest (NOTE [ Methods planned side by side ])."""


def plan_side_by_side(searches: list[tuple[str, dict]], progress=None, then: Callable | None = None,
                      plan: Callable | None = None, longest: int = 0) -> list[tuple]:
    """``(result, then(result))`` of ``plan(**kwargs)`` for each ``(label, kwargs)`` of ``searches``, in
    order (``then``: what to work out from each result in its own process too; None: nothing).
    ``progress``: a memfit.planner.progress.PlanProgress (a line per search) or None. ``longest``:
    the index of the search expected to take longest: it keeps this process's priority, the others
    run below it and take the cores it leaves idle."""
    if plan is None:
        from memfit.planner.search import plan
    lines = [progress.line(label) if progress is not None else NoProgress() for label, _ in searches]
    if len(searches) < 2 or not can_fork_searches():
        results = []
        for line, (_, kwargs) in zip(lines, searches):
            result = plan(**kwargs, progress=line)
            results.append((result, then(result) if then else None))
            line.done("done")
        return results
    return _forked(searches, lines, plan, then, longest)


def can_fork_searches() -> bool:
    """Whether searches can run in forked processes here (see the module docstring)."""
    if "fork" not in multiprocessing.get_all_start_methods() or worker_count() < 2:
        return False
    import torch
    if torch.cuda.is_initialized():
        return False
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
            return bool(pool.submit(autograd_works).result(timeout=120))
    except Exception:  # noqa: BLE001 - autograd after fork, or a process that died
        return False


class _Relay:
    """A search's progress, sent to the parent's bar."""

    def __init__(self, queue, index: int) -> None:
        self.queue, self.index = queue, index

    def stage(self, text: str) -> None:
        self.queue.put(("stage", self.index, text))

    def walk(self, traced: int, limit: int, open_plans: int) -> None:
        self.queue.put(("walk", self.index, (traced, limit, open_plans)))


def _search_in_child(plan: Callable, then: Callable | None, index: int, kwargs: dict, queue, nice: int) -> None:
    """One search, in its forked process: its result (or error) goes to ``queue``; then the process
    ends at once, its own workers with it (they may still be winding down, and waiting for them at
    exit left them orphaned, holding the terminal's pipes)."""
    try:
        if nice:
            os.nice(nice)
        result = plan(**kwargs, progress=_Relay(queue, index), alongside=False)
        queue.put(("result", index, (result, then(result) if then else None)))
    except UserError as e:
        queue.put(("user error", index, str(e)))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        queue.put(("error", index, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        queue.close()
        queue.join_thread()  # (the result is in the pipe)
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(0)


def _forked(searches: list[tuple[str, dict]], lines: list, plan: Callable, then: Callable | None,
            longest: int) -> list:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_search_in_child, args=(plan, then, i, kwargs, queue, 0 if i == longest else LOWER), name=f"memfit-plan-{label}")
             for i, (label, kwargs) in enumerate(searches)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple] = {}
    try:
        while len(outcome) < len(procs):
            try:
                kind, i, value = queue.get(timeout=0.5)
            except queues.Empty:
                for i, p in enumerate(procs):
                    if i not in outcome and not p.is_alive():
                        _drain(queue, outcome, lines)  # (a process that ended may have sent its result last)
                        if i not in outcome:
                            outcome[i] = ("died", i, p.exitcode)
                continue
            _take(kind, i, value, outcome, lines)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    results = []
    for i, (_, kwargs) in enumerate(searches):
        kind, _, value = outcome[i]
        if kind == "user error":
            raise UserError(value)
        if kind == "error":
            raise RuntimeError(f"the search for {searches[i][0]} failed in its process: {value}")
        if kind == "died":  # (killed for memory?) run it again here, in turn
            result = plan(**kwargs, progress=lines[i])
            value = (result, then(result) if then else None)
        results.append(value)
        lines[i].done("done")
    return results


def _take(kind: str, i: int, value, outcome: dict, lines: list) -> None:
    if kind == "stage":
        lines[i].stage(value)
    elif kind == "walk":
        lines[i].walk(*value)
    else:
        outcome[i] = (kind, i, value)
        lines[i].done("done")


def _drain(queue, outcome: dict, lines: list) -> None:
    """Take every message still queued."""
    while True:
        try:
            kind, i, value = queue.get(timeout=0.2)
        except queues.Empty:
            return
        _take(kind, i, value, outcome, lines)
