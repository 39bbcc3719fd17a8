"""Adapters that make a fake-tensor trace take the code path a real run takes.

NOTE [ Libraries that branch on fake tensors ]
Hugging Face transformers treats a ``FakeTensor`` as "tracing" (``is_tracing`` ->
``is_fake_tensor``) and then takes the export-safe path, e.g. it materialises a [B, 1, T, T]
attention mask that a real run skips. memfit's fake trace exists to predict the real run, so
while it runs, transformers' fake-tensor detection answers False; data-dependent reads it then
makes are answered by fake mode (constants) or listed as approximations. The patch is undone on
exit and only touches transformers if it is already imported. A test fails loudly if the
function moves.

What a technique's own library needs on fake tensors is the technique's business
(``Config.trace_context``, e.g. NOTE [ bitsandbytes tables on fake tensors ]).
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def real_code_paths():
    with contextlib.ExitStack() as stack:
        module = sys.modules.get("transformers.utils.import_utils")
        if module is not None and hasattr(module, "is_fake_tensor"):
            stack.enter_context(_patched(module, "is_fake_tensor", lambda x: False))
        yield


@contextlib.contextmanager
def _patched(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
