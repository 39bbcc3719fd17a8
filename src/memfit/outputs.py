"""Output paths checked before the work that fills them.

``--out``, ``--timeline`` and ``--pareto`` are written after seconds to minutes of tracing,
planning or training; a path that cannot be written should fail first, in one line that says
why: the folder is missing, the path is a folder, or writing is not allowed there.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from memfit.errors import UserError

IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def check_output_file(path: str | Path, flag: str, *, example: str = "out.yaml",
                      suffixes: tuple[str, ...] | None = None) -> Path:
    """Check that file ``path`` (given as ``flag``) can be written; returns it as a Path.

    The check writes: the file is opened for appending (an existing file is left unchanged; a new
    one is removed again), so permissions, read-only file systems and pseudo file systems such
    as /proc are caught, for root too.
    """
    text = str(path)
    if not text.strip():
        raise UserError(f"{flag} is empty; give a file name, e.g. {flag} {example}")
    p = Path(text)
    if p.is_dir():
        raise UserError(f"{flag} {text!r} is a folder; give a file name, e.g. {flag} {p / example}")
    if suffixes and p.suffix and p.suffix.lower() not in suffixes:
        raise UserError(f"{flag} {text!r}: cannot write a {p.suffix} file; give a name ending in "
                        f"{', '.join(suffixes)}")
    _check_parent(p, flag, text)
    existed = p.exists()
    try:
        with open(p, "ab"):
            pass
    except OSError as e:
        raise UserError(_cannot(flag, text, e)) from None
    if not existed:
        p.unlink(missing_ok=True)
    return p


def check_output_dir(path: str | Path, flag: str) -> Path:
    """Check that folder ``path`` exists or can be created, and that files can be written in it.
    Nothing is created here; the nearest existing ancestor is the one written to."""
    text = str(path)
    if not text.strip():
        raise UserError(f"{flag} is empty; give a folder, e.g. {flag} memfit-out")
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {text!r} is a file, not a folder; give a folder name, e.g. {flag} memfit-out")
    base = p
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise UserError(f"{flag} {text!r}: {str(base)!r} is a file, not a folder; choose another path")
    probe = base / f".memfit-write-test-{os.getpid()}"  # (several processes may check one folder at once)
    try:
        with open(probe, "ab"):
            pass
        probe.unlink(missing_ok=True)
    except OSError as e:
        raise UserError(_cannot(flag, text, e)) from None
    return p


def _check_parent(p: Path, flag: str, text: str) -> None:
    parent = p.parent
    if not parent.exists():
        raise UserError(f"{flag} {text!r}: folder {str(parent)!r} does not exist; create it first or choose "
                        "another path")
    if not parent.is_dir():
        raise UserError(f"{flag} {text!r}: {str(parent)!r} is a file, not a folder; choose another path")


def _cannot(flag: str, text: str, e: OSError) -> str:
    if isinstance(e, PermissionError) or e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why = "read-only file system" if e.errno == errno.EROFS else "permission denied"
        return f"cannot write {flag} {text!r}: {why}; choose a folder you can write to"
    return f"cannot write {flag} {text!r} ({e.strerror or type(e).__name__}); choose a writable path"


def write_synced(path: Path, write) -> None:
    """``write(f)`` into file ``path``, flushed and fsync'ed before it returns (an atomic save
    writes a temporary file so, renames it over the old one, then :func:`sync_dir`)."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def sync_dir(path: Path) -> None:
    """fsync folder ``path``, so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system of ``path`` (its nearest existing folder); None if unknown."""
    import shutil
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def os_error(e: BaseException | None) -> OSError | None:
    """The OSError that ``e`` is or was raised from (``torch.save`` reports a failed ``write`` of its
    file object as a RuntimeError raised while the OSError was being handled)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def write_failed(e: OSError, path: Path, what: str, fix: str) -> UserError:
    """A write that failed (a full disk, a quota, an I/O error) as one line: ``what`` could not be
    written to ``path``, why, the free space there, and ``fix``."""
    from memfit.units import fmt_bytes
    free = free_bytes(path)
    space = f"{fmt_bytes(free)} free there" if free is not None else "free space unknown"
    why = e.strerror or (str(e) or type(e).__name__)
    return UserError(f"{what}: {why} writing {str(path)!r} ({space}); {fix}")
