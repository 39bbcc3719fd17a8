"""bitsandbytes' optimizers: whether they run here, and what a fake trace of them needs.

Shared by the variants that build on bitsandbytes (``adamw8bit`` in memfit.techniques.optimizers,
the paged AdamW in memfit.techniques.optimizers_paged, GaLore's 8-bit AdamW in
memfit.techniques.optimizers_lowrank) and by bitsandbytes' quantized base weights.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from memfit.quiet import errors_only


@functools.cache
def bitsandbytes_available() -> bool:
    """Can ``adamw8bit`` run in this environment (bitsandbytes and its 8-bit AdamW import)?

    A missing or broken install counts as unavailable: the planner then leaves adamw8bit out and
    an explicit adamw8bit plan runs, and is estimated, as its fallback (fp32 AdamW). Asked once a
    process (a search asks for each plan: each ``setLevel`` clears every logger's cache, 0.4 ms)."""
    # bitsandbytes warns at import about a 4-bit CPU matmul kernel memfit does not use
    errors_only("bitsandbytes.backends.cpu.ops")
    try:
        with _compile_deferred():
            import bitsandbytes  # noqa: F401
            from bitsandbytes.optim import AdamW8bit as _  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken install
        return False
    return True


# NOTE [ bitsandbytes without Inductor ]
# Bitsandbytes' default (CPU) backend wraps some kernels in ``torch.compile`` when it is imported, and
# ``torch.compile`` imports Inductor at once: 1.7 s of the planner's 2.2 s import of bitsandbytes, for
# kernels a fake trace never runs. ``torch.compile`` compiles nothing before the first call anyway, so
# while bitsandbytes is imported it is replaced by a wrapper that calls it at the first call: the same
# kernels, the same fallback on a compile error (bitsandbytes' wrapper catches the error at the call),
# and Inductor imported only if one of them runs.
@contextlib.contextmanager
def _compile_deferred():
    """``torch.compile`` deferred to the first call while bitsandbytes is imported (NOTE [ bitsandbytes
    without Inductor ])."""
    real = torch.compile
    if "bitsandbytes" in sys.modules:
        yield
        return

    def deferred(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: deferred(fn, **kwargs)
        compiled = []

        @functools.wraps(model)
        def call(*args, **kw):
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)
        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


_TABLES: dict = {}


# NOTE [ bitsandbytes tables on fake tensors ]
# Bitsandbytes builds each 8-bit optimizer's quantization map (a constant 256-value table) with Python
# loops of ``.tolist()``; on fake tensors every read is data-dependent, which made tracing
# optimizer-in-backward (one optimizer per parameter) 30 s slower on a 7B model. The table is computed
# once for real, outside fake mode and every dispatch mode (the tracker too: the table is host data in
# a real run, and a trace that counted it would differ from the next one in the process, which finds
# it made: the planner's two shallow traces then differ by more than the inserted blocks), and reused:
# exact, since it depends on no input.
@contextlib.contextmanager
def real_quantization_tables():
    """bitsandbytes' 8-bit quantization maps computed once, for real, and reused (NOTE [ bitsandbytes
    tables on fake tensors ])."""
    if not bitsandbytes_available():
        yield
        return
    import bitsandbytes.functional as bnb_functional
    original = getattr(bnb_functional, "create_dynamic_map", None)
    if original is None:
        yield
        return

    def real_table(*args, **kwargs):
        key = (original, args, tuple(sorted(kwargs.items())))
        if key not in _TABLES:
            from torch.utils._python_dispatch import _disable_current_modes
            with _disable_current_modes():
                _TABLES[key] = original(*args, **kwargs)
        return _TABLES[key]
    bnb_functional.create_dynamic_map = real_table
    try:
        yield
    finally:
        bnb_functional.create_dynamic_map = original
