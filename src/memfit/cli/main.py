"""memfit: predict, plan and prove the memory of PyTorch training.

User errors print one line naming the problem and the fix and exit with status 2; ``--debug``
shows the traceback.
"""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import os
import sys
import warnings

from memfit import __version__
from memfit.cli import foreign_flags
from memfit.quiet import quiet_library_loggers


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other error (the usage itself is in --help)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    from memfit.cli import demo, estimate, fit, info, plan, profile, train
    parser = _Parser(prog="memfit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (estimate, profile, plan, fit, train, info, demo):
        module.register(sub)
    return parser


_NOT_THE_USERS = ("Triton is not supported on current platform",)
"""Warnings about this machine that are not about what memfit answers: flash-linear-attention's import
notice on a machine without a GPU (a GPU preset's prediction traces its kernels' allocations, and the
report says so: NOTE [ Triton kernels on fake tensors ])."""


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line ('memfit: warning: ...'), without Python's source line (``--debug``
    keeps Python's format)."""
    text = str(message).strip().splitlines()[0] if str(message).strip() else category.__name__
    if text.startswith(_NOT_THE_USERS):
        return
    try:
        (file or sys.stderr).write(f"memfit: warning: {text}\n")
    except OSError:
        pass


def _no_meta_kernel_failures(record: logging.LogRecord) -> bool:
    """Drop torch's log (with traceback) of an op that failed on fake tensors; the error follows."""
    return not str(record.msg).startswith("failed while attempting to run meta")


# NOTE [ Exit without the final collections ]
# Called as the program (``argv`` None: the ``memfit`` script, ``python -m memfit.cli.main``), the
# process ends right after; the interpreter's shutdown would run several full garbage collections over
# the million objects torch and transformers made (0.5-0.8 s here). The heap is frozen instead
# (``gc.freeze``), so shutdown frees objects by reference count only; files are closed and streams
# flushed as usual.
def main(argv: list[str] | None = None) -> int:
    """Run memfit with ``argv`` (default: the command line) and return the exit status; run as the
    program, it exits without the interpreter's final collections (NOTE [ Exit without the final
    collections ])."""
    from memfit.secrets import redacting
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = redacting(sys.stdout), redacting(sys.stderr)  # (memfit.secrets: no token is shown)
    if argv is not None:
        try:
            return _run(argv)
        finally:
            sys.stdout, sys.stderr = streams
    try:  # (the program: its streams stay redacting, for the traceback of --debug too)
        return _run(sys.argv[1:])
    finally:
        gc.freeze()


def _run(argv: list[str]) -> int:
    debug = "--debug" in argv
    if not debug:
        quiet_library_loggers()
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's own logging is noise here
    if not debug:  # a workload's failing op is reported in one line below, not as torch's log of it
        logging.getLogger("torch._subclasses.fake_tensor").addFilter(_no_meta_kernel_failures)
    parser = build_parser()
    try:
        theirs = foreign_flags.answer(argv)
        if theirs:  # (said by the subcommand's parser, as below)
            command = next((a for a in argv if not a.startswith("-")), None)
            parser._subparsers._group_actions[0].choices.get(command, parser).error(theirs)
        args, extra = parser.parse_known_args(argv)
        if extra:  # said by the subcommand's parser, so the line names the subcommand
            sub = parser._subparsers._group_actions[0].choices.get(getattr(args, "command", None), parser)
            sub.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # argparse: usage errors exit 2 already
        return int(e.code or 0)
    args.argv = list(argv)  # (memfit train --nproc runs the same command in each rank)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    from memfit.errors import UserError
    shown = warnings.showwarning
    if not debug:
        warnings.showwarning = _one_line_warning
    try:
        code = args.run(args)
        sys.stdout.flush()  # (here, not at exit: a reader that left the pipe gets the quiet exit below)
        return code
    except UserError as e:
        if debug:
            raise
        _say(f"memfit {args.command}: error: {e}", 2)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (memfit plan ... | head): stop quietly, as cat does
        _quiet_stdout()
        return 141
    except Exception as e:  # an unexpected failure: one line unless --debug
        if debug:
            raise
        if isinstance(e, OSError) and e.errno in _DISK_ERRORS:  # the machine's, not memfit's
            from memfit.outputs import write_failed
            _say(f"memfit {args.command}: error: {write_failed(e, e.filename or '.', 'cannot write', _FREE_SPACE)}", 2)
            return 2
        msg = str(e).splitlines()[0] if str(e) else ""
        _say(f"memfit {args.command}: internal error: {type(e).__name__}: {msg} (run with --debug for the "
             "traceback and report it)", 1)
        return 1
    finally:
        warnings.showwarning = shown


_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG}
"""Write errors that are the machine's, not memfit's: a full disk, a quota, an I/O error, a
read-only file system, a file too large. One line, exit 2."""
_FREE_SPACE = "free space there or write elsewhere (--out)"


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit does not fail again on
    the closed pipe (Python's documented recipe for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # (no real stdout: a test's capture)
        pass


def _say(line: str, code: int) -> None:
    """The one line of an error: on stderr, or, in a rank that ``memfit train --nproc`` launched,
    to the launcher, which prints one line for all ranks."""
    if os.environ.get("MEMFIT_RANK_ERRORS"):
        from memfit.training.distributed import record_error
        if record_error(line, code):
            return
    print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
