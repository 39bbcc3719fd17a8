"""A run's checkpoints in its --out folder: which exist, which are complete, which are kept.

A checkpoint that is complete can still be unreadable: a disk error, a bad copy, a file cut short
by a full disk on another machine. Keeping one checkpoint loses the run then; torchtitan
(``keep_latest_k``) and the Hugging Face Trainer (``save_total_limit``) keep the last K, and so does
memfit (``memfit train --keep-checkpoints K``, default 2): resume takes the newest that loads.

The folder holds, by step (eight digits, so names sort as steps):

- ``checkpoint-<step>.pt``: a one-process checkpoint, complete once renamed from its temporary
  file ``.checkpoint-<step>.pt.tmp-<pid>`` (memfit.training.checkpoint);
- ``checkpoint-dcp-<step>/``: a sharded run's DCP checkpoint, complete once rank 0 has put
  ``meta.pt`` in it, which it does only after every rank has written its shards
  (memfit.training.sharded_checkpoint); a folder without ``meta.pt`` is a save that was cut short;
- ``checkpoint.pt``: a checkpoint of memfit before this layout (read, and removed like the others).

NOTE [ The last good checkpoint stays ]: checkpoints are removed only after a newer one is
complete (renamed into place and its folder fsync'ed), and only by the run that wrote that newer
one: it keeps its newest K (the new one among them) and removes the rest, including the
checkpoints of an earlier run in the folder (``--overwrite``), unfinished saves, and checkpoints
of later steps that a resumed run passed over because they did not load.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import UserError, brief
from memfit.training import safe_load

LEGACY = "checkpoint.pt"
LEGACY_POINTER = "checkpoint-dcp.json"
"""Where memfit before this layout pointed at its DCP checkpoint (ignored; removed when pruning)."""
WHOLE = re.compile(r"^checkpoint-(\d{8,})\.pt$")
DCP = re.compile(r"^checkpoint-dcp-(\d{8,})$")
DCP_MARK = "meta.pt"
"""The file rank 0 writes last in a DCP checkpoint's folder: the save is complete."""


class Unreadable(Exception):
    """A complete checkpoint that does not load (corrupt, cut short, another version): resume
    skips it for an older one."""


def load_record(path: Path, version: int, *more):
    """A checkpoint's record (a one-process checkpoint, or a DCP checkpoint's ``meta.pt``) loaded by
    the allowlist of memfit.training.safe_load, with ``more(...)`` (other loads of the same
    checkpoint): a failure is :class:`Unreadable`, but for a refusal (a UserError: a type memfit
    never writes, a package missing), which stops the resume."""
    try:
        record = safe_load.load_file(path)
        loaded = [load() for load in more]
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any other failure is a corrupt checkpoint
        raise Unreadable(f"corrupt or unreadable: {type(e).__name__}: {brief(e, 120)}") from None
    if not well_formed(record, version):
        raise Unreadable("not a memfit checkpoint of this version")
    return (record, *loaded) if more else record


_FIELDS = {"workload": str, "step": int, "samples_seen": int, "plan": dict, "adapted_plan": dict, "batch_size": int,
           "shapes": dict, "rng": dict}


def well_formed(state, version: int) -> bool:
    """Whether ``state`` (loaded from a file that may have been changed) has the fields of a
    checkpoint of this version, each of its type."""
    return (isinstance(state, dict) and state.get("format") == version
            and all(isinstance(state.get(k), t) for k, t in _FIELDS.items()))


def whole_name(step: int) -> str:
    return f"checkpoint-{step:08d}.pt"


def dcp_name(step: int) -> str:
    return f"checkpoint-dcp-{step:08d}"


@dataclass(frozen=True)
class Entry:
    """One checkpoint in the folder."""

    path: Path
    kind: str
    """``whole`` (one process) or ``dcp`` (sharded)."""
    step: int
    """Its step (-1 for a legacy ``checkpoint.pt``, whose step is inside it: the oldest)."""
    complete: bool

    @property
    def name(self) -> str:
        return self.path.name


def entries(out_dir: Path) -> list[Entry]:
    """Every checkpoint in ``out_dir``, complete or not, newest first (by step; at one step, the
    later-written first)."""
    found = []
    if not out_dir.is_dir():
        return found
    for p in out_dir.iterdir():
        if (m := WHOLE.match(p.name)) and p.is_file():
            found.append(Entry(p, "whole", int(m.group(1)), True))
        elif (m := DCP.match(p.name)) and p.is_dir():
            found.append(Entry(p, "dcp", int(m.group(1)), (p / DCP_MARK).is_file()))
        elif p.name == LEGACY and p.is_file():
            found.append(Entry(p, "whole", -1, True))
    return sorted(found, key=lambda e: (e.step, _mtime(e)), reverse=True)


def complete(out_dir: Path) -> list[Entry]:
    """The complete checkpoints of ``out_dir``, newest first: what a resume tries, in order."""
    return [e for e in entries(out_dir) if e.complete]


def _mtime(e: Entry) -> float:
    try:
        return (e.path / DCP_MARK if e.kind == "dcp" else e.path).stat().st_mtime
    except OSError:
        return 0.0


def prune(out_dir: Path, kept: list[Path]) -> list[Path]:
    """Remove every checkpoint of ``out_dir`` but ``kept`` (NOTE [ The last good checkpoint stays ]:
    call once the newest of ``kept`` is complete). Returns what was removed."""
    keep = {p.name for p in kept}
    removed = []
    (out_dir / LEGACY_POINTER).unlink(missing_ok=True)
    for e in entries(out_dir):
        if e.name in keep:
            continue
        if e.kind == "dcp":
            (e.path / DCP_MARK).unlink(missing_ok=True)  # (incomplete first: a removal cut short is not resumed from)
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            e.path.unlink(missing_ok=True)
        removed.append(e.path)
    return removed
