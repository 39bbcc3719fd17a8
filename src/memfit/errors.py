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
