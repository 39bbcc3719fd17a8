"""Adapters that make a fake-tensor trace take the code path a real run takes.

NOTE [ Libraries that branch on fake tensors ]
Hugging Face transformers treats a ``FakeTensor`` as "tracing" (``is_tracing`` ->
``is_fake_tensor``) and then takes the export-safe path, e.g. it materialises a [B, 1, T, T]
attention mask that a real run skips. memfit's fake trace exists to predict the real run, so
while it runs, transformers' fake-tensor detection answers False; data-dependent reads it then
makes are answered by fake mode (constants) or listed as approximations. The patch is undone on
exit and only touches transformers if it is already imported. A test fails loudly if the
function moves.
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def real_code_paths():
    module = sys.modules.get("transformers.utils.import_utils")
    if module is None or not hasattr(module, "is_fake_tensor"):
        yield
        return
    original = module.is_fake_tensor
    module.is_fake_tensor = lambda x: False
    try:
        yield
    finally:
        module.is_fake_tensor = original
