"""Kernel libraries a model would use where they are installed, and which this machine lacks.

NOTE [ Kernel libraries missing here ]
transformers writes the fast path of its linear-attention, Mamba and hybrid models (Qwen3-Next, Qwen3.5,
Mamba, Mamba-2, Jamba, Bamba, Falcon-H1, LFM2, Nemotron-H, Zamba, ...: 22 families in 5.23) as a
module-level function decorated with ``use_kernel_func_from_hub_with_fallback(name, package)``: where the
package imports (flash-linear-attention, causal-conv1d, mamba-ssm: GPU libraries), its kernel runs;
elsewhere transformers' PyTorch reference does, "correct but much slower", and with other memory: Qwen3.5's
gated delta rule holds 1.03 GiB a layer at 4,096 tokens in the reference against 146 MiB in fla's kernels
(NOTE [ Triton kernels on fake tensors ]). A plan made on a laptop without them, for a GPU machine with
them, predicts the reference, and said nothing of it (transformers' own warning about it is filtered from
memfit's output as not the user's to act on in a run). While a fake trace runs, each such function of the
model's modules that falls back here is wrapped to count its calls: the report lists it, with its library,
as an approximation. A library that is installed runs as it would (traced through its Python), and is not
listed.
"""

from __future__ import annotations

import contextlib
import functools
import sys

FELL_BACK = ("ran transformers' PyTorch reference: its kernel library is not installed here; where it is (a GPU "
             "machine's fast path) its kernels run instead, with other memory and time: install it here to predict them")
"""The approximation each function that fell back is listed under, at ``name (library)``."""


def _fallback_of(fn) -> tuple[str, str] | None:
    """(function name, package) of a transformers kernel function that falls back to its PyTorch
    reference here; None for anything else. (Looks through wrappers put around it: hub kernels.)"""
    for _ in range(3):
        closure, code = getattr(fn, "__closure__", None), getattr(fn, "__code__", None)
        if closure and code:
            try:
                free = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))
            except ValueError:  # (a cell not filled yet)
                free = {}
            if "torch_function" in free and isinstance(free.get("package"), str):
                if free.get("is_new_implementation") is False:
                    return str(free.get("func_name", fn.__name__)), free["package"]
                return None
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


_DISTRIBUTIONS = {"causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}
"""pip's names of the kernel packages whose import name differs (transformers names fla's itself)."""


def _distribution(package: str) -> str:
    if package in _DISTRIBUTIONS:
        return _DISTRIBUTIONS[package]
    try:
        from transformers.integrations.hub_kernels import _PACKAGE_TO_DISTRIBUTION
    except Exception:  # noqa: BLE001 - another transformers: the import name is what it says
        return package
    return _PACKAGE_TO_DISTRIBUTION.get(package, package)


def _fallbacks(model):
    """(module, attribute, function, its name, its library) of each fallback function of ``model``'s modules."""
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        if module is None or name.startswith("torch."):
            continue
        for attr, fn in list(vars(module).items()):
            found = _fallback_of(fn) if callable(fn) else None
            if found is not None:
                yield module, attr, fn, found[0], _distribution(found[1])


def missing_libraries_note(model) -> list[str]:
    """A planner's note of the kernel libraries ``model``'s code would run where installed and which this
    machine lacks (NOTE [ Kernel libraries missing here ]), read from its modules, not from a trace; none: []."""
    missing = sorted({library for *_, library in _fallbacks(model)})
    if not missing:
        return []
    return [f"the model's transformers code runs {', '.join(missing)} where installed (a GPU machine's fast path); "
            "not installed here, so these plans are of its PyTorch reference, with other memory and time: install "
            "them here to plan the fast path"]


@contextlib.contextmanager
def kernel_fallbacks_listed(tracker, model):
    """While the block runs, each fallback function of ``model``'s modules notes its calls on ``tracker``
    (NOTE [ Kernel libraries missing here ])."""
    patched = []
    for module, attr, fn, name, library in list(_fallbacks(model)):
        @functools.wraps(fn)
        def counted(*args, _fn=fn, _where=f"{name} ({library})", **kwargs):
            tracker.approximate(FELL_BACK, _where)
            return _fn(*args, **kwargs)
        setattr(module, attr, counted)
        patched.append((module, attr, fn))
    try:
        yield
    finally:
        for module, attr, fn in patched:
            setattr(module, attr, fn)
