"""Several plan searches at once, each in a forked process of its own (``memfit plan --methods``)."""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.connection import wait

from memfit.errors import UserError
from memfit.planner.progress import NoProgress
from memfit.planner.workers import autograd_works, worker_count

# NOTE [ Methods planned side by side ]
# The searches of ``--methods`` are independent: each method is planned on its own (NOTE [ Methods
# are the user's ]). Run in turn, each leaves cores idle (a full trace confirming its plan on one
# worker while the other waits, a long compile while the other worker has finished). So each search
# runs in a process forked from this one (the arguments are not pickled; the results come back
# pickled), with its own workers, and the searches fill each other's idle time. A search run so does
# not trace the next plans' full traces alongside the one it confirms (``plan(alongside=False)``):
# the other searches use those cores. The search expected to take longest (the caller says which: for
# ``--methods``, full fine-tuning, whose optimizer choices the adapters' searches leave out) keeps
# this process's priority and the others run at a lower one, so they take the cores it leaves idle
# rather than slow it down. Each search's progress reaches the bar through a pipe of its own (NOTE [ A
# pipe per search ]), a line per search.
#
# The searches run in turn here where fork is not available, with one core, where CUDA is initialised
# in this process, or where autograd would not survive a fork (this process ran a backward pass: a
# test session, a notebook). A search whose process dies (killed for memory) runs again here; a user
# error in one is raised here. Measured: docs/planner-notes.md.
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

    def __init__(self, conn) -> None:
        self.conn = conn

    def stage(self, text: str) -> None:
        self.conn.send(("stage", text))

    def walk(self, traced: int, limit: int, open_plans: int) -> None:
        self.conn.send(("walk", (traced, limit, open_plans)))

    def rung(self, text: str) -> None:
        self.conn.send(("rung", text))


def _search_in_child(plan: Callable, then: Callable | None, kwargs: dict, conn, nice: int) -> None:
    """One search, in its forked process: its progress, then its result (or error), go down ``conn``,
    its own pipe (NOTE [ A pipe per search ]); then the process ends at once, its own
    workers with it (they may still be winding down, and waiting for them at exit left them
    orphaned, holding the terminal's pipes)."""
    if nice:
        os.nice(nice)

    def search():
        result = plan(**kwargs, progress=_Relay(conn), alongside=False)
        return result, then(result) if then else None
    _call_in_child(search, conn)


def _call_in_child(fn: Callable, conn) -> None:
    """``fn()``'s result (or error) down ``conn``; then the process ends at once, with any workers of its
    own (NOTE [ A pipe per search ])."""
    try:
        conn.send(("result", fn()))
    except UserError as e:
        conn.send(("user error", str(e)))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(0)


# NOTE [ A pipe per search ]
# Each search writes to a pipe of its own. A queue shared by the searches has one lock for its
# writers: a search killed while it wrote (by the kernel, for memory) held that lock forever, and
# every other search then waited for it, and this process for them, without end. A search's own pipe
# breaks with it alone. Its end of file does not say that it ended (the search's own trace workers,
# forked from it, hold the pipe's writing end too), so this process also waits on each search's
# process (its exit status, not its sentinel, which those workers hold too): once it has ended, what
# it wrote before is read, and a search that sent no result runs again here. A message the kill cut
# short is read to the pipe's end, which comes once the search's workers have ended too (NOTE [ A
# worker outlives no one ] in memfit.planner.processes).
def _forked(searches: list[tuple[str, dict]], lines: list, plan: Callable, then: Callable | None,
            longest: int) -> list:
    """Run ``searches`` in forked processes, each writing to a pipe of its own (NOTE [ A pipe per
    search ])."""
    ctx = multiprocessing.get_context("fork")
    procs, conns = [], []
    for i, (label, kwargs) in enumerate(searches):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_search_in_child, args=(plan, then, kwargs, send, 0 if i == longest else LOWER),
                        name=f"memfit-plan-{label}")
        p.start()
        send.close()  # (the searches forked after this one do not inherit its writing end)
        procs.append(p)
        conns.append(recv)
    outcome: dict[int, tuple] = {}
    open_conns = set(range(len(procs)))
    try:
        while len(outcome) < len(procs):
            waiting = [i for i in range(len(procs)) if i not in outcome]
            ready = wait([conns[i] for i in waiting if i in open_conns], timeout=0.5)
            for i in waiting:
                if conns[i] in ready and not _read(conns[i], i, outcome, lines):
                    open_conns.discard(i)
                if not procs[i].is_alive():  # it ended: what it sent is all in the pipe
                    os.set_blocking(conns[i].fileno(), False)  # (a message cut short ends the reading)
                    while i in open_conns and conns[i].poll(0) and _read(conns[i], i, outcome, lines):
                        pass
                    open_conns.discard(i)
                    outcome.setdefault(i, ("died", procs[i].exitcode))
    finally:
        for conn in conns:
            conn.close()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    results = []
    for i, (_, kwargs) in enumerate(searches):
        kind, value = outcome[i]
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


def _read(conn, i: int, outcome: dict, lines: list) -> bool:
    """Take one message of search ``i``; False where its pipe is at its end or cut short."""
    try:
        kind, value = conn.recv()
    except Exception:  # noqa: BLE001 - end of file, a message cut short, or nothing more to read
        return False
    _take(kind, i, value, outcome, lines)
    return True


def _take(kind: str, i: int, value, outcome: dict, lines: list) -> None:
    if kind == "stage":
        lines[i].stage(value)
    elif kind == "walk":
        lines[i].walk(*value)
    elif kind == "rung":
        lines[i].rung(value)
    else:
        outcome[i] = (kind, value)
        lines[i].done("done")


# NOTE [ Traces of one's own in a process of their own ]
# A process that has run a backward pass can no longer fork trace workers (autograd's threads do not
# survive a fork: memfit.planner.workers), and its searches then trace every plan in turn, on one core.
# ``plan --batch-size max`` traces its maximal plans at several values (fake steps, backward included)
# before its searches; done here, each search after them ran on one core: 405 s against 253 s for the
# search at batch 16 of a LoRA of Llama-2-7B on a 12 GB card. So those traces run in a process forked
# for them, and their figures come back pickled. Measured: docs/planner-notes.md.
def in_own_process(fn: Callable):
    """``fn()`` in a forked process, its result pickled back (NOTE [ Traces of one's own in a process of
    their own ]); here where searches cannot fork, or where the process died (killed for memory?)."""
    if not can_fork_searches():
        return fn()
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_call_in_child, args=(fn, send), name="memfit-traces")
    p.start()
    send.close()
    try:
        kind, value = recv.recv()
    except Exception:  # noqa: BLE001 - it died before sending
        kind, value = "died", None
    finally:
        recv.close()
        p.join()
    if kind == "user error":
        raise UserError(value)
    if kind == "error":
        raise RuntimeError(f"traces in a forked process failed: {value}")
    return fn() if kind == "died" else value
