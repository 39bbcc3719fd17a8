"""User-facing errors, and how memfit tells a user's mistake from its own failures.

A :class:`UserError` is a mistake the user can fix (a malformed size, an unknown device, a
missing file). The CLI prints its message on one line and exits with status 2; ``--debug``
shows the traceback. Internal invariants use ``assert``.

Two kinds of failure raised inside a workload's code are not the workload's fault and must reach
memfit's own handlers: a fake-tensor trace that cannot go on (:func:`is_trace_error`; estimate
explains it or measures a real run instead) and a kernel this machine does not have
(:func:`missing_kernel`; CPUs differ: without AVX-512 bf16, oneDNN has no bf16 LSTM/GRU kernel,
and some ATen kernels exist for fp32 only). torch is imported inside functions: importing this
module stays cheap.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback


class UserError(ValueError):
    """A problem with the user's input. The message names the problem and the fix."""


class WeightsExceedBudget(UserError):
    """The weights every plan keeps on the device exceed the budget: no plan can fit, so none is searched."""

    def __init__(self, message: str, needs_bytes: int):
        super().__init__(message)
        self.needs_bytes = needs_bytes


class CompileFailed(UserError):
    """torch.compile could not capture or compile a region of the step (``what``: the cause, without the fix;
    ``region``: the region's name, as memfit.techniques.compiled names it)."""

    def __init__(self, message: str, what: str = "", region: str = ""):
        super().__init__(message)
        self.what, self.region = what or message, region

    def __reduce__(self):  # (a trace worker sends it back to the planner's process)
        return CompileFailed, (str(self), self.what, self.region)


class TraceError(UserError):
    """A workload could not be traced on fake tensors (e.g. a data-dependent op)."""

    def __init__(self, message: str, op: str | None = None, *, library: bool = False):
        super().__init__(message)
        self.op = op
        self.library = library
        """The failure is in memfit's model of a library's code (NOTE [ Whose failure ]), not the workload's."""


class KernelUnavailable(UserError):
    """A kernel the step needs does not exist on this machine for the dtype it runs in."""


def is_trace_error(exc: BaseException) -> bool:
    """Did fake-tensor tracing fail (rather than the workload itself)?"""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)):
        return True
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
        if isinstance(exc, GuardOnDataDependentSymNode):
            return True
    except ImportError:  # pragma: no cover - older torch
        pass
    msg = str(exc)
    if not ("FakeTensor" in msg or "fake tensor" in msg.lower() or "meta tensor" in msg.lower()):
        return False
    # (a model's own check that prints a fake tensor in its message is the model's, not the trace's: Qwen-VL's
    # "Image features and image tokens do not match, tokens: FakeTensor(...)" through ``torch._check_with``, its
    # values known to the trace, raised by a config whose vision tower's width is not its language model's)
    return not (isinstance(exc, ValueError) and _a_library_check(exc))


def _a_library_check(exc: BaseException) -> bool:
    """Was ``exc`` raised by a library's own check: its innermost frame outside torch, or in the ``torch._check``
    helpers it asserts with?"""
    code = _innermost_code(exc)
    return code is not None and (f"{os.sep}torch{os.sep}" not in code.co_filename or code.co_name.startswith("_check"))


def fake_kernel_failure(exc: BaseException) -> bool:
    """Did ``exc`` come out of an op's fake or meta implementation while memfit's fake trace ran
    (a fake-tensor mode active on this thread)? Errors raised by the model's own Python code (a
    config that cannot build, a check of sizes) are not."""
    import torch
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
        return False
    return any(f"{os.sep}torch{os.sep}{part}" in fr.filename for fr in traceback.extract_tb(exc.__traceback__)
               for part in _FAKE_MACHINERY)


_FAKE_MACHINERY = ("_subclasses", "_meta_registrations.py", "_refs", "_prims", "_decomp")


def untraced(source: str, what: str, exc: BaseException) -> TraceError:
    """NOTE [ Whose failure ]: a library's model built from its config (a model folder, a hub id, a
    built-in) whose step fails inside an op's fake or meta implementation during memfit's trace
    (:func:`fake_kernel_failure`: a meta kernel that refuses what the real kernel runs) fails in
    memfit's model of that library's code, not in the config: the error says what was not
    modelled and where, and estimate may still measure a real run (a TraceError). Building the
    model and the batch, and any failure of a real run, stay the config's (or the overrides'), and
    so does an op that refuses its operands' sizes (:func:`shapes_refused`: a shape contract the
    device's kernel checks too; a DeepSeek-V3 config whose ``head_dim`` is not its rope and nope
    dims' sum failed a broadcast on the ``rtx4090`` preset, and was blamed on memfit), and one that refuses
    its operands' dtypes in a model cast to 16 bits whole (:func:`dtypes_refused`)."""
    at, op = where_raised(exc), _op_of(exc)
    return TraceError(f"{source}: memfit's fake-tensor trace of {what} failed{' ' + at if at else ''}: "
                      f"{type(exc).__name__}: {brief(exc, 200)}; memfit does not model this yet (the model is not at "
                      "fault): report it to memfit; memfit profile measures a real run where the model fits",
                      op=op or trace_error_op(exc), library=True)


# Shape contracts every kernel checks before it computes, real and meta alike: an op that refuses its
# operands' sizes with one of these refuses them on the device too (NOTE [ Whose failure ]).
_SHAPE_CONTRACTS = re.compile(
    r"Attempting to broadcast a dimension|must match the size of tensor|shapes cannot be multiplied|"
    r"is invalid for input of size|selected index k out of range|size mismatch|"
    r"Sizes of tensors must match except in dimension|expected .{0,40}to have .{0,40} channels")


def shapes_refused(exc: BaseException) -> bool:
    """Did an op refuse its operands' sizes (a shape contract the real kernel checks too), rather
    than fail in what memfit's fake kernels model? Then the sizes (a config, the overrides) are at
    fault, unless the trace assumed a data-dependent value before (:func:`_values_assumed`): sizes made
    from a value assumed 0 (JetMoE's expert counts, read with ``tolist``) are memfit's."""
    return isinstance(exc, RuntimeError) and _SHAPE_CONTRACTS.search(str(exc)) is not None and not _values_assumed()


# An op handed float32 beside 16-bit operands refuses them on the device too, where the model was cast to
# 16 bits whole (bf16-pure, fp16-pure) and its own code makes float32 tensors (xLSTM's gates: its matmul of
# a float32 and a bf16 tensor failed in memfit's trace and in the real step alike, and the trace's error
# blamed memfit). Under autocast memfit's model of the CUDA cast lists is in play, so there it stays memfit's.
_DTYPE_CONTRACTS = re.compile(r"expected scalar type [\w.]+ but found [\w.]+|expected (?:m1 and m2|mat1 and mat2|"
                              r"query, key, and value|both vectors) to have (?:the )?same dtype|"
                              r"input tensors must have the same dtype")


def dtypes_refused(exc: BaseException, model) -> str | None:
    """Did an op refuse its operands' dtypes in the step of ``model`` cast to 16 bits whole (every floating
    parameter bf16, or every one fp16)? Then the model's own float32 is at fault (see :data:`_DTYPE_CONTRACTS`),
    and this is the fix: the same precision under autocast. None: not such a failure."""
    import torch
    if not (isinstance(exc, RuntimeError) and _DTYPE_CONTRACTS.search(str(exc))) or \
            not isinstance(model, torch.nn.Module):
        return None
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if floats not in ({torch.bfloat16}, {torch.float16}) or _autocast_on():
        return None
    precision = "bf16" if floats == {torch.bfloat16} else "fp16"
    return f"the model makes float32 tensors of its own: train it under autocast (--precision {precision}) instead"


def _autocast_on() -> bool:
    """Is autocast on where the step failed (a GPU preset's trace autocasts on the CPU, with CUDA's lists)?"""
    import torch
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


ASSUMED_ZERO = "a data-dependent scalar read (.item()/bool()) assumed 0"
"""How memfit.memory.tracker lists a value it assumed 0 (one that may size tensors)."""


def _values_assumed() -> bool:
    """Has a dispatch mode active on this thread (memfit's tracker) assumed 0 for a value fake mode could
    not know (NOTE [ Assumed scalars ] in memfit.memory.tracker)? (The checks it assumes pass, such as a
    mask's ``.all()`` that many attention masks read, make no sizes.)"""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return any(getattr(mode, "assume_scalars", False) and
               any(what == ASSUMED_ZERO for what, _ in getattr(mode, "approximations", {}))
               for mode in _get_current_dispatch_mode_stack())


def where_raised(exc: BaseException) -> str:
    """"at OP in module M (package/file.py:LINE)", the parts known, or ""."""
    where, module, op = library_location(exc), _module_of(exc), _op_of(exc)
    return " ".join(x for x in (f"at {op}" if op else "", f"in module {module}" if module else "",
                                f"({where})" if where else "") if x)


def _op_of(exc: BaseException) -> str | None:
    """The ATen op being dispatched when ``exc`` was raised (innermost ``OpOverload`` on the stack)."""
    import torch
    tb, found = exc.__traceback__, None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch._ops.OpOverload):
            found = str(owner)
        tb = tb.tb_next
    return found


def library_location(exc: BaseException) -> str | None:
    """``package/file.py:LINE`` of the innermost frame of ``exc`` outside torch and memfit: the library
    code (e.g. transformers) that made the call which failed."""
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        path = fr.filename.replace(os.sep, "/")
        if "/torch/" not in path and "/memfit/" not in path and not path.startswith("<"):
            short = path.split("-packages/")[-1] if "-packages/" in path else "/".join(path.split("/")[-2:])
            return f"{short}:{fr.lineno}"
    return None


def trace_error_op(exc: BaseException) -> str:
    """The ATen op a fake-tensor failure names, if any."""
    func = getattr(exc, "func", None)
    if func is not None:
        return str(func)
    m = re.search(r"aten\.[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)?", str(exc))
    return m.group(0) if m else type(exc).__name__


_ONEDNN = re.compile(r"could not create a primitive descriptor for (?:the |an? )?(?P<what>.+?) primitive")
_ATEN = re.compile(r"\"(?P<what>\w+)\" not implemented for '(?P<dtype>\w+)'")
# oneDNN primitives and the ATen ops that reach them (for the message)
_ONEDNN_OPS = {"LSTM": "aten.mkldnn_rnn_layer", "GRU": "aten.mkldnn_rnn_layer", "RNN": "aten.mkldnn_rnn_layer",
               "convolution": "aten.convolution", "matmul": "aten.mm", "inner product": "aten.linear"}


def missing_kernel(exc: BaseException, precision: str) -> KernelUnavailable | None:
    """One line naming the kernel this machine lacks, the module and the fix; None if ``exc`` is
    something else. A fake-tensor estimate still predicts such a step (meta kernels exist for
    every dtype), but a real step (``profile``, ``train``) cannot run."""
    import torch
    if not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError):
        return None
    text = str(exc)
    m = _ONEDNN.search(text)
    if m:
        what = m.group("what")
        op = next((v for k, v in _ONEDNN_OPS.items() if what.lower().startswith(k.lower())), "a oneDNN op")
        kernel = f"{op} ({what}, oneDNN)"
    else:
        m = _ATEN.search(text)
        if not m:
            return None
        kernel = f"aten.{m.group('what')} for {m.group('dtype')}"
    where = _module_of(exc)
    place = f"in module {where}" if where else "in backward"
    cpu = torch.backends.cpu.get_cpu_capability()
    return KernelUnavailable(
        f"this machine has no kernel for {kernel} {place} at precision {precision} (CPU capability {cpu}); "
        f"keep that module in fp32 (run its forward under torch.autocast(device_type, enabled=False)) "
        f"or use --precision fp32")


def _module_of(exc: BaseException) -> str | None:
    """The innermost nn.Module whose forward was running when ``exc`` was raised."""
    import torch
    tb, found = exc.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and isinstance(owner, torch.nn.Module):
            found = type(owner).__name__
        tb = tb.tb_next
    return found


def passes_through(exc: BaseException) -> bool:
    """Exceptions from a workload's code that must reach memfit's own handlers unchanged rather
    than be reported as the workload's fault: out of memory (training adapts to it), fake-tensor
    trace failures (estimate explains them or falls back to a real run) and kernels this machine
    lacks (the step names them)."""
    import torch
    return (isinstance(exc, (UserError, torch.OutOfMemoryError, MemoryError)) or is_trace_error(exc)
            or missing_kernel(exc, "") is not None)


def raised_in_memfit(exc: BaseException) -> bool:
    """Did memfit's own code (not a built-in workload) raise ``exc``? Then it is memfit's bug."""
    root = os.path.dirname(os.path.abspath(__file__))
    path = _innermost_file(exc)
    return path is not None and path.startswith(root + os.sep) and \
        not path.startswith(os.path.join(root, "workloads") + os.sep)


def raised_in_package(exc: BaseException, package: str) -> bool:
    """Did ``package`` (an installed library: ``peft``) raise ``exc``, in its innermost frame?"""
    path = _innermost_file(exc)
    return path is not None and f"{os.sep}{package}{os.sep}" in path


def _innermost_file(exc: BaseException) -> str | None:
    """The file of the innermost frame of ``exc``'s traceback (None: it has none)."""
    code = _innermost_code(exc)
    return None if code is None else os.path.abspath(code.co_filename)


def _innermost_code(exc: BaseException):
    """The code object of the innermost frame of ``exc``'s traceback (None: it has none)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return None if tb is None else tb.tb_frame.f_code


def user_location(exc: BaseException, fn=None) -> str | None:
    """``file.py:LINE`` of the innermost frame of ``exc`` in the user's code: the file that defines
    ``fn`` if it is on the stack, else the innermost frame outside Python's and the installed
    libraries' folders and memfit's own."""
    frames = traceback.extract_tb(exc.__traceback__)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    home = os.path.abspath(code.co_filename) if code is not None else None
    for fr in reversed(frames):
        if home and os.path.abspath(fr.filename) == home:
            return f"{os.path.basename(fr.filename)}:{fr.lineno}"
    paths = sysconfig.get_paths()
    libs = tuple(os.path.abspath(paths[k]) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    libs += (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
    for fr in reversed(frames):
        path = os.path.abspath(fr.filename)
        if not path.startswith(libs) and not fr.filename.startswith("<frozen"):
            return f"{os.path.basename(fr.filename)}:{fr.lineno}"
    return None


def brief(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line for a user error: whitespace folded, PyTorch's C++
    context ("Exception raised from ... frame #0 ...") dropped, cut at ``limit`` characters."""
    text = " ".join(str(exc).split())
    text = text.split(" Exception raised from ")[0].rstrip(" .")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parse_problem(exc: BaseException) -> str:
    """Where and what a YAML (or JSON) parser found wrong, on one line: ``line 65, column 16: expected <block end>,
    but found '<scalar>'`` (PyYAML's first line alone, ``while parsing a block mapping``, says neither)."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    if isinstance(getattr(exc, "lineno", None), int) and getattr(exc, "msg", None):  # json.JSONDecodeError
        return f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
    return brief(exc, 200)
