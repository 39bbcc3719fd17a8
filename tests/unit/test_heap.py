"""Garbage collection around traces (NOTE [ Frozen heap ]) and at the program's exit."""

import gc
import weakref

import torch

from memfit.cli.main import main
from memfit.memory.heap import frozen_heap


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
