"""Garbage collection around traces (NOTE [ Frozen heap ]) and at the program's exit."""

import gc
import threading
import weakref

import torch

from memfit.cli.main import main
from memfit.memory.heap import frozen_heap, without_collections

THAWED_HEAP = True  # (these tests freeze and thaw it themselves: NOTE [ A frozen heap per test ] in conftest)


class _Cycle:
    def __init__(self, tensor):
        self.tensor = tensor
        self.me = self


def test_frozen_heap_freezes_only_inside_and_collects_what_the_block_made():
    old = _Cycle(torch.zeros(4))
    old_ref = weakref.ref(old.tensor)
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        new = _Cycle(torch.zeros(4))
        new_ref = weakref.ref(new.tensor)
        del new
        gc.collect()
        assert new_ref() is None  # a cycle made inside the block is collected inside it
        del old
        gc.collect()
        assert old_ref() is not None  # frozen: waits for a collection after the block
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None


def test_frozen_heap_leaves_a_callers_freeze_alone(monkeypatch):
    # The freeze count is no witness: frozen objects freed by reference counting leave the
    # permanent generation and lower it. What matters is that the block neither freezes nor thaws.
    calls = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 1000)  # the caller froze its heap
    with frozen_heap():
        pass
    assert calls == []


def test_a_caller_that_says_it_froze_the_heap_spares_the_count_of_frozen_objects(monkeypatch):
    """``gc.get_freeze_count`` walks every frozen object (64 ms at 800,000, at each trace): a caller that
    says it froze the heap (``heap.CALLER_FROZE``) is believed, and the block neither freezes nor thaws."""
    from memfit.memory import heap
    calls = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append("count") or 1000)
    monkeypatch.setattr(heap, "CALLER_FROZE", True)
    with frozen_heap():
        pass
    assert calls == []
    monkeypatch.setattr(heap, "CALLER_FROZE", None)  # (not said: counted)
    with frozen_heap():
        pass
    assert calls == ["count"]


def test_a_measured_run_collects_the_heap_once_before_its_model_is_built(monkeypatch):
    # Each full collection walks every object torch and transformers made (~0.25 s in a process that
    # imported them): ``profile`` leaves the one before the run to run_tracked's frozen heap.
    import memfit.memory.faketrace as faketrace
    from memfit.memory.measure import profile
    collects, predicted, before_build = [], [], []
    real_collect, real_run = gc.collect, faketrace._run_tracked
    monkeypatch.setattr(gc, "collect", lambda *a: collects.append(1) or real_collect(*a))

    def run(target, **kw):
        if not kw["fake"]:  # (collections since the prediction's trace ended)
            before_build.append(len(collects) - predicted[-1])
        out = real_run(target, **kw)
        predicted.append(len(collects))
        return out

    monkeypatch.setattr(faketrace, "_run_tracked", run)
    result = profile("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=16", batch_size=1, seq_len=8,
                     device="cpu", repeats=0)
    assert result.measured.peak_bytes > 0
    assert before_build == [1]


def test_main_freezes_the_heap_only_when_run_as_the_program(monkeypatch, capsys):
    assert main(["--version"]) == 0
    assert gc.get_freeze_count() == 0  # called as a library (tests): nothing frozen
    monkeypatch.setattr("sys.argv", ["memfit", "--version"])
    try:
        assert main() == 0
        assert gc.get_freeze_count() > 0  # NOTE [ Exit without the final collections ]
    finally:
        gc.unfreeze()
    assert "memfit" in capsys.readouterr().out


def test_stream_computations_run_without_automatic_collections_and_leave_them_as_they_were():
    # NOTE [ Streams make no cycles ]: off inside, nested and from two threads at once; on after the last
    seen = []
    inner_started, outer_may_end = threading.Event(), threading.Event()

    @without_collections
    def computation(depth: int) -> int:
        seen.append(gc.isenabled())
        return computation(depth - 1) + 1 if depth else 0

    @without_collections
    def held():  # another thread's computation, still running when the first ends
        seen.append(gc.isenabled())
        inner_started.set()
        outer_may_end.wait(5)

    assert gc.isenabled()
    assert computation(3) == 3
    assert gc.isenabled() and seen == [False] * 4
    other = threading.Thread(target=held)
    other.start()
    inner_started.wait(5)
    assert computation(0) == 0
    assert not gc.isenabled()  # (the other thread's computation still runs)
    outer_may_end.set()
    other.join()
    assert gc.isenabled() and seen == [False] * 6
    gc.disable()  # a caller that turned them off keeps them off
    try:
        computation(1)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_computation_that_raises_turns_collections_back_on():
    @without_collections
    def fails():
        raise ValueError("no")

    try:
        fails()
    except ValueError:
        pass
    assert gc.isenabled()
