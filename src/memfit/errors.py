"""User-facing errors.

A :class:`UserError` is a mistake the user can fix (a malformed size, an unknown device, a
missing file). The CLI prints its message on one line and exits with status 2; ``--debug``
shows the traceback. Internal invariants use ``assert``.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with the user's input. The message names the problem and the fix."""


class TraceError(UserError):
    """A workload could not be traced on fake tensors (e.g. a data-dependent op)."""

    def __init__(self, message: str, op: str | None = None):
        super().__init__(message)
        self.op = op


def passes_through(exc: BaseException) -> bool:
    """Exceptions from a workload's code that must reach memfit's own handlers unchanged rather
    than be reported as the workload's fault: out of memory (training adapts to it), fake-tensor
    trace failures (estimate explains them or falls back to a real run) and kernels this machine
    lacks (the step names them)."""
    import torch

    from memfit.kernel_errors import explain
    from memfit.memory.faketrace import is_trace_error
    return (isinstance(exc, (UserError, torch.OutOfMemoryError, MemoryError)) or is_trace_error(exc)
            or explain(exc, "") is not None)


def raised_in_memfit(exc: BaseException) -> bool:
    """Did memfit's own code (not a built-in workload) raise ``exc``? Then it is memfit's bug."""
    import os
    root = os.path.dirname(os.path.abspath(__file__))
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    return path.startswith(root + os.sep) and not path.startswith(os.path.join(root, "workloads") + os.sep)


def user_location(exc: BaseException, fn=None) -> str | None:
    """``file.py:LINE`` of the innermost frame of ``exc`` in the user's code: the file that defines
    ``fn`` if it is on the stack, else the innermost frame outside Python's and the installed
    libraries' folders and memfit's own."""
    import os
    import sysconfig
    import traceback
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
