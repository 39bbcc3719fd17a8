"""Checks on the overrides of built-in workloads (``gpt2:n_layer=4``): one line naming the field.

An override's value is checked against the field's type (the dataclass annotation, or for older
configs the type of the default value) before it is set, so ``gpt2:n_layer=abc`` says what
``n_layer`` takes instead of surfacing whatever the config class raises (transformers 5.x
validates fields itself; 4.x does not, and the model build fails later). Values of a valid type
that still cannot build a model (``n_embd`` not divisible by ``n_head``) fail when memfit builds
it; :func:`guarded` turns that failure into the same kind of message.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Callable
from typing import Any, Union, get_args, get_origin

from memfit.errors import UserError

_NAMES = {"int": int, "float": float, "bool": bool, "str": str, "None": type(None), "NoneType": type(None)}
_WORDS = {int: "an int (a whole number)", float: "a float (a number)", bool: "a bool (true or false)",
          str: "a string", type(None): "null"}


def simple_types(annotation: Any) -> tuple[type, ...] | None:
    """The plain types an annotation allows (int, float, bool, str, None), or None when it allows
    anything else too (a dict, a list, a torch.dtype, ...): then the value is not checked here."""
    if annotation in _WORDS:
        return (annotation,)
    if isinstance(annotation, str):
        parts = [p.strip() for p in annotation.split("|")]
        if all(p in _NAMES for p in parts):
            return tuple(_NAMES[p] for p in parts)
        return None
    if get_origin(annotation) in (Union, types.UnionType):
        out: list[type] = []
        for a in get_args(annotation):
            sub = simple_types(a)
            if sub is None:
                return None
            out += sub
        return tuple(out)
    return None


def check_value(arch: str, key: str, value: Any, allowed: tuple[type, ...], example: Any = None) -> Any:
    """``value`` if it is one of ``allowed`` (an int where a float is expected becomes a float, a
    number written as text such as ``1e-5`` is parsed); otherwise a UserError naming the field."""
    if isinstance(value, bool):
        if bool in allowed:
            return value
    elif isinstance(value, int) and int in allowed:
        return value
    elif isinstance(value, (int, float)) and float in allowed:
        return float(value)
    elif isinstance(value, str) and str in allowed:
        return value
    elif value is None and type(None) in allowed:
        return value
    elif isinstance(value, str) and float in allowed:
        try:  # YAML reads 1e-5 (no dot) as text
            return float(value)
        except ValueError:
            pass
    want = " or ".join(_WORDS[t] for t in allowed)
    hint = f"; write e.g. {arch}:{key}={_show(example)}" if example is not None else ""
    raise UserError(f"{arch}: {key} must be {want}, got {value!r}{hint}")


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def describe(overrides: dict) -> str:
    return ",".join(f"{k}={_show(v)}" for k, v in overrides.items())


def guarded(arch: str, overrides: dict, what: str, fn: Callable) -> Callable:
    """Wrap a built-in workload's function (``model``, ``batch``, ``loss``) so that a failure the
    user's overrides cause is one line naming them. Without overrides a failure is memfit's own
    bug and passes through, as do failures raised by memfit's code, out-of-memory errors,
    fake-tensor trace failures and missing kernels (:func:`memfit.errors.passes_through`). A
    failure inside memfit's fake trace is memfit's, overrides or not (NOTE [ Whose failure ])."""
    if not overrides:
        return blamed(arch, None, what, fn)
    return blamed(f"{arch}:{describe(overrides)}", "change the overrides", what, fn)


def blamed(source: str, fix: str | None, what: str, fn: Callable) -> Callable:
    """``fn`` whose failures are the user's ``source`` (overrides, a model folder's config.json):
    one line naming it, ``what`` failed and ``fix`` (None: nothing of the user's is at fault, and a
    failure passes through); what :func:`guarded` lets pass, passes. A failure inside memfit's fake
    trace is memfit's (NOTE [ Whose failure ] in memfit.errors)."""
    in_step = what.startswith("loss")  # (building the model or the batch runs the config's own code)

    def call(*args):
        try:
            return fn(*args)
        except Exception as e:
            from memfit.errors import (
                brief,
                dtypes_refused,
                fake_kernel_failure,
                passes_through,
                raised_in_memfit,
                raised_in_package,
                shapes_refused,
                untraced,
                where_raised,
            )
            if passes_through(e) or raised_in_memfit(e):
                raise
            autocast = dtypes_refused(e, args[0]) if in_step and fix is not None and args else None
            if autocast:
                raise UserError(f"{source}: {what} failed {where_raised(e)}: the op refuses its operands' dtypes, as the "
                                f"device's kernel would: {type(e).__name__}: {brief(e, 160)}; {autocast}") from e
            if in_step and fake_kernel_failure(e):
                if fix is None or not shapes_refused(e):
                    raise untraced(source, what, e) from e
                raise UserError(f"{source}: {what} failed {where_raised(e)}: the op refuses its operands' sizes, "
                                f"as the device's kernel would: {type(e).__name__}: {brief(e, 200)}; {fix}") from e
            if in_step and raised_in_package(e, "triton"):  # (a real run on a machine without a GPU: fla, Liger)
                caller = _launching_package(e)
                raise UserError(f"{source}: {what} launched a Triton kernel{f' of {caller}' if caller else ''}, "
                                f"which needs a GPU ({brief(e, 80)}); `memfit estimate` predicts it here (its launches skipped, its "
                                "allocations traced), `memfit profile` measures it on a GPU") from e
            if in_step and raised_in_package(e, "peft"):  # (PEFT adapted a layer it cannot run: Llama 4's router)
                raise UserError(f"{source}: {what} failed in PEFT's adapter layers with {type(e).__name__}: {brief(e)}; "
                                "name the layers to adapt (e.g. --adapter lora:r=16,targets=q_proj+v_proj)") from e
            if in_step and _in_compile(e):  # (HiDream's experts read their token counts on the host, compiled)
                raise UserError(f"{source}: {what} failed in torch.compile {where_raised(e)} ({type(e).__name__}: "
                                f"{brief(e, 160)}), which memfit's trace of the compiled step cannot follow; plan it "
                                "without compile (--compile none)") from e
            if fix is None:
                raise
            msg = brief(e)
            raise UserError(f"{source}: {what} failed with {type(e).__name__}: {msg}; {fix}") from e
    return call


def _in_compile(exc: BaseException) -> bool:
    """``exc`` is torch.compile's (Dynamo's, tracing data-dependent code), or a host read of a tensor inside a compiled
    region (``.numpy()`` of the subclass AOTAutograd traces with)."""
    return type(exc).__module__.startswith("torch._dynamo") or "numpy() is not supported for tensor subclasses" in str(exc)


def _launching_package(exc: BaseException) -> str | None:
    """The package whose code launched the Triton kernel that raised ``exc`` (``fla``): its innermost frame's
    outside Triton, PyTorch and the standard library's wrappers."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        package = str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0]
        if package and package not in ("triton", "torch", "functools", "contextlib", "memfit"):
            found = package
        tb = tb.tb_next
    return found


def check_seq_len(seq_len: Any) -> None:
    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
        raise UserError(f"--seq-len must be a positive whole number, got {seq_len!r}")


def check_resolution(resolution: Any, text_only: bool = False) -> None:
    """``resolution``: pixels on a side, or ``(width, height)`` (NOTE [ A resolution's width ]);
    ``text_only``: 0 is taken too (a vision-language model's samples without an image)."""
    if isinstance(resolution, tuple) and len(resolution) == 2 and all(_pixels(v, 1) for v in resolution):
        return
    if resolution is not None and not _pixels(resolution, 0 if text_only else 1):
        zero = " (0: text only, for a vision-language model)" if text_only else ""
        raise UserError(f"--resolution must be a positive whole number of pixels{zero}, got {resolution!r}")


def _pixels(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


# NOTE [ A resolution's width ]
# An image or video model's size is its height (``--resolution PX``, square unless a width is given)
# and its width: a ``width=`` override of the workload (``dit-flux:width=1216 --resolution 832``), or
# ``--resolution 1216x832`` (width by height, as screens and kohya's buckets name them), which is
# ``resolution=(1216, 832)`` here. ``--resolution max`` grows the height at a given width.
def split_resolution(resolution: Any, overrides: dict, where: str) -> tuple[Any, dict]:
    """(the height, ``overrides`` with the width) of ``resolution`` given as ``(width, height)``; others
    as they are (NOTE [ A resolution's width ])."""
    if not isinstance(resolution, tuple):
        return resolution, overrides
    width, height = resolution
    if "width" in overrides and overrides["width"] != width:
        raise UserError(f"{where}: width={overrides['width']} and --resolution {width}x{height} give two widths; "
                        "give one")
    return height, {**overrides, "width": width}


@contextlib.contextmanager
def width_said_as_given(resolution: Any, overrides: dict):
    """An error about a width the user gave inside ``--resolution WxH`` names it so, with its fixes, rather
    than as the ``width=`` override it became (:func:`split_resolution`)."""
    if not isinstance(resolution, tuple) or "width" in overrides:
        yield
        return
    high = resolution[1]
    try:
        yield
    except UserError as e:
        text = re.sub(r"use width=(\d+) or (\d+)", rf"use --resolution \1x{high} or \2x{high}", str(e))
        text = re.sub(r"use width=<= (\d+)", rf"use --resolution <= \1x{high}", text)
        raise UserError(re.sub(r"width=(\d+)", rf"--resolution \1x{high}'s width \1", text)) from None
