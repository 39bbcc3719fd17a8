"""Adapters that make a fake-tensor trace take the code path a real run takes.

NOTE [ Libraries that branch on fake tensors ]
Hugging Face transformers treats a ``FakeTensor`` as "tracing" (``is_tracing`` ->
``is_fake_tensor``) and then takes the export-safe path, e.g. it materialises a [B, 1, T, T]
attention mask that a real run skips. memfit's fake trace exists to predict the real run, so
while it runs, transformers' fake-tensor detection answers False; data-dependent reads it then
makes are answered by fake mode (constants) or listed as approximations. The patch is undone on
exit and only touches transformers if it is already imported. A test fails loudly if the
function moves.

bitsandbytes builds each 8-bit optimizer's quantization map (a constant 256-value table) with
Python loops of ``.tolist()``; on fake tensors every read is data-dependent, which made tracing
optimizer-in-backward (one optimizer per parameter) 30 s slower on a 7B model. The table is
computed once for real, outside fake mode, and reused: exact, since it depends on no input.
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def real_code_paths(bitsandbytes: bool = False):
    with contextlib.ExitStack() as stack:
        module = sys.modules.get("transformers.utils.import_utils")
        if module is not None and hasattr(module, "is_fake_tensor"):
            stack.enter_context(_patched(module, "is_fake_tensor", lambda x: False))
        if bitsandbytes:
            bnb = _import_bitsandbytes_functional()
            if bnb is not None and hasattr(bnb, "create_dynamic_map"):
                stack.enter_context(_patched(bnb, "create_dynamic_map", _real_table(bnb.create_dynamic_map)))
        yield


@contextlib.contextmanager
def _patched(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


_TABLES: dict = {}


def _real_table(fn):
    def make(*args, **kwargs):
        key = (fn, args, tuple(sorted(kwargs.items())))
        if key not in _TABLES:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            with unset_fake_temporarily():
                _TABLES[key] = fn(*args, **kwargs)
        return _TABLES[key]
    return make


def _import_bitsandbytes_functional():
    import logging
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes.functional as bnb_functional
    except Exception:  # noqa: BLE001 - not installed or broken: the optimizer falls back anyway
        return None
    return bnb_functional
