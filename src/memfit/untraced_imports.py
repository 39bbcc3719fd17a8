"""Modules first imported while a step is traced load outside the trace.

NOTE [ Modules loaded during a trace ]
Much of what a step runs is imported lazily, the first time a process builds such a step: transformers imports a
model's ``modeling_*`` file (and, through it, torchao's integration) when the model is first made, memfit imports
peft, bitsandbytes, LyCORIS or galore-torch when a plan first needs them, and peft imports bitsandbytes in turn.
Some of those modules make tensors as they load: peft's LoHa layers default ``scale=torch.tensor(1)``,
bitsandbytes builds its 4-bit quantization tables. Loaded under a trace's modes, those tensors were made by them:
booked as the step's allocations on the traced device (four of them, 2 KiB once rounded, in the first trace of
a process and in none after it), and kept in the module for good as fake tensors of a mode that is gone (or as
meta tensors, where the model was being built on the meta device): wrong for the rest of the process.

A real run imports them long before its first step, on the host. So while a trace runs, each module imported for
the first time executes with the trace's dispatch modes (the fake-tensor mode, the tracker, the CUDA kernel
model) and its function modes (a device context) set aside, as it would in a process that imported it first:
its tensors are real host tensors, the trace books none of them, and a plan traces the same in a fresh process
as after others (the planner compares traces made in different worker processes: memfit.planner.fit_books).
This replaced a list of what each technique imports lazily (``Config.before_trace``), which had missed the
precision's check for peft's layers and transformers' own model files.

How: a finder first on ``sys.meta_path`` while a trace runs asks the others for the module's spec and wraps its
loader's ``exec_module`` for that one import (the loader keeps its type: ``pkg_resources`` and others look it
up by type).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading

import torch

# (what setting the dispatch modes aside imports: loaded now, not half-loaded by an import it wraps)
import torch._subclasses.functional_tensor  # noqa: F401
import torch._subclasses.schema_check_mode  # noqa: F401
import torch.fx.experimental.proxy_tensor  # noqa: F401
from torch.utils._python_dispatch import _disable_current_modes

_lock = threading.Lock()
_depth = 0
_aside = threading.local()


@contextlib.contextmanager
def modes_set_aside():
    """No dispatch mode and no function mode while inside (those of the calling thread, restored after)."""
    if getattr(_aside, "on", False):  # (an import within an import: already set aside)
        yield
        return
    with _disable_current_modes():
        popped = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
        _aside.on = True
        try:
            yield
        finally:
            _aside.on = False
            for mode in reversed(popped):
                torch._C._push_on_torch_function_stack(mode)


class _OutsideTheTrace(importlib.abc.MetaPathFinder):
    """Finds a module as the other finders do; its loader executes it with the modes set aside."""

    def find_spec(self, name, path, target=None):
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        own = getattr(loader, "__dict__", None)
        if own is None or isinstance(loader, type) or "exec_module" in own or not hasattr(loader, "exec_module"):
            return spec  # (a loader that is a class serves every module: built-in and frozen ones make no tensors)
        execute = loader.exec_module

        def exec_module(module):
            try:
                with modes_set_aside():
                    execute(module)
            finally:
                own.pop("exec_module", None)
        own["exec_module"] = exec_module
        return spec


_FINDER = _OutsideTheTrace()


class _WhileTracing:
    """The finder first on ``sys.meta_path`` from the first entry to the last exit (entries nest, from any thread)."""

    def __enter__(self) -> None:
        global _depth
        with _lock:
            if _depth == 0:
                sys.meta_path.insert(0, _FINDER)
            _depth += 1

    def __exit__(self, *exc) -> None:
        global _depth
        with _lock:
            _depth -= 1
            if _depth == 0 and _FINDER in sys.meta_path:
                sys.meta_path.remove(_FINDER)


_WHILE_TRACING = _WhileTracing()


def imports_outside_the_trace() -> _WhileTracing:
    """While inside, a module imported for the first time loads outside the trace's modes (the module's NOTE).
    The same reentrant context manager each time: a mode entered again within itself enters it again."""
    return _WHILE_TRACING
