"""A full disk or an I/O error while saving (ENOSPC, EIO), injected at each write of a save, one at a
time: one line naming the path and the free space, no temporary file left, the previous checkpoint
intact and resumed from. Writes are the calls that reach the disk: each ``write`` and ``flush`` of
a file opened for writing under --out, each ``fsync``, each rename.

On main before this change, a failing save raised the bare OSError (an internal error, exit 1)."""

import errno
import io
import json
import os

import pytest
import torch

from memfit.cli.main import main
from memfit.errors import UserError
from memfit.plans import Plan
from memfit.step import build_step, make_batch
from memfit.target import Target
from memfit.training import checkpoint, retention
from memfit.training.saver import Saver

SMALL = "mha:vocab=256,dim=32,heads=2,layers=1,seq_len=16"


class _Writing:
    """A file opened for writing whose writes go through :class:`Faults`."""

    def __init__(self, file, faults, name):
        self._file, self._faults, self._name = file, faults, name

    def write(self, data):
        self._faults.tick(f"write {self._name}", self._name)
        return self._file.write(data)

    def flush(self):
        self._faults.tick(f"flush {self._name}", self._name)
        return self._file.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()
        return False

    def __getattr__(self, name):
        return getattr(self._file, name)


class Faults:
    """Counts the writes under ``root`` and fails the ``fail_at``-th and every later one with
    OSError(``code``)."""

    def __init__(self, monkeypatch, root, only=None):
        self.root, self.only = str(root), only
        self.count, self.fail_at, self.code, self.calls = 0, None, errno.ENOSPC, []
        real_open, real_fsync, real_replace, real_rename = io.open, os.fsync, os.replace, os.rename

        def opening(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            name = os.fspath(file) if isinstance(file, (str, os.PathLike)) else ""
            if self._mine(name) and any(c in mode for c in "wax+"):
                return _Writing(f, self, name)
            return f

        def fsync(fd):
            self.tick("fsync", "")
            return real_fsync(fd)

        def moving(real, what):
            def move(src, dst, *args, **kwargs):
                if self._mine(os.fspath(dst)):
                    self.tick(f"{what} {os.fspath(dst)}", os.fspath(dst))
                return real(src, dst, *args, **kwargs)
            return move

        for module in (io, __import__("builtins")):
            monkeypatch.setattr(module, "open", opening)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", moving(real_replace, "replace"))
        monkeypatch.setattr(os, "rename", moving(real_rename, "rename"))

    def _mine(self, name: str) -> bool:
        return name.startswith(self.root) and (self.only is None or self.only in name)

    def tick(self, what: str, name: str) -> None:
        if self.fail_at is None:
            return
        self.count += 1
        self.calls.append(what)
        if self.count >= self.fail_at:  # (a full or failing disk stays so)
            raise OSError(self.code, os.strerror(self.code), name or None)

    def arm(self, fail_at: int | None, code: int = errno.ENOSPC) -> None:
        self.count, self.fail_at, self.code, self.calls = 0, fail_at, code, []


class OneRank:
    is_main = True

    def barrier(self) -> None:
        pass


def _step():
    target = Target.resolve(SMALL, Plan(), 2, "cpu")
    torch.manual_seed(0)
    step = build_step(target)
    step(make_batch(target))
    return step


def _some(calls: list[str], limit: int | None) -> list[int]:
    """Write numbers (from 1) to fail at: all of them, or, within ``limit``, every fsync and rename,
    the first and last write to each file, and evenly spaced others."""
    if limit is None:
        return list(range(1, len(calls) + 1))
    chosen = {i for i, c in enumerate(calls) if not c.startswith(("write", "flush"))}
    for name in {c.split(" ", 1)[1] for c in calls if " " in c}:
        mine = [i for i, c in enumerate(calls) if c.endswith(name)]
        chosen |= {mine[0], mine[-1]}
    rest = sorted(set(range(len(calls))) - chosen)
    spare = max(0, limit - len(chosen))
    chosen |= set(rest[::max(1, len(rest) // spare)][:spare] if spare else [])
    return sorted(i + 1 for i in chosen)


@pytest.mark.parametrize("sharded, limit", [
    (False, 40), (True, 40),
    pytest.param(False, None, marks=pytest.mark.slow), pytest.param(True, None, marks=pytest.mark.slow),
], ids=["one-process", "dcp", "one-process-every-write", "dcp-every-write"])
def test_each_write_of_a_save_failing_leaves_the_previous_checkpoint(tmp_path, monkeypatch, sharded, limit):
    step, ranks = _step(), OneRank() if sharded else None
    out = tmp_path / "out"
    out.mkdir()
    faults = Faults(monkeypatch, tmp_path)

    def saver():
        return Saver(out, keep=2, workload=SMALL, requested=Plan(), ranks=ranks, resumed={"step": 1})

    Saver(out, keep=2, workload=SMALL, requested=Plan(), ranks=ranks).save(step, index=1, samples_seen=2)
    before = sorted(p.name for p in out.rglob("*"))
    dry = tmp_path / "dry"
    dry.mkdir()
    faults.arm(10**9)  # count the writes of a clean save
    Saver(dry, keep=2, workload=SMALL, requested=Plan(), ranks=ranks).save(step, index=2, samples_seen=4)
    writes = faults.count
    assert writes >= 5 and any(c.startswith("fsync") for c in faults.calls)
    for code in (errno.ENOSPC, errno.EIO):
        for k in _some(list(faults.calls), limit):
            faults.arm(k, code)
            with pytest.raises(UserError) as caught:
                saver().save(step, index=2, samples_seen=4)
            faults.arm(None)
            message = str(caught.value)
            assert "\n" not in message and os.strerror(code) in message and str(out) in message, (k, message)
            assert "free there" in message and "the checkpoint of step 1 is intact" in message, message
            assert sorted(p.name for p in out.rglob("*")) == before, (code, k, faults.calls[-1])
            state = checkpoint.read(out)
            assert state["step"] == 1 and state["skipped"] == []


def _metrics(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_full_disk_stops_the_command_in_one_line_and_resume_continues_exactly(tmp_path, monkeypatch, capsys):
    args = ["train", SMALL, "-b", "2", "--checkpoint-every", "1", "--no-report", "--seed", "3", "--json"]  # (no progress)
    assert main([*args, "--steps", "3", "--out", str(tmp_path / "straight")]) == 0
    out = tmp_path / "out"
    assert main([*args, "--steps", "1", "--out", str(out)]) == 0
    faults = Faults(monkeypatch, out, only="checkpoint")
    faults.arm(1)  # the first write of step 2's checkpoint
    capsys.readouterr()
    assert main([*args, "--steps", "3", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memfit train: error: cannot save the checkpoint of step 2: No space "
                                               f"left on device writing '{out}/.checkpoint-00000002.pt.tmp-"), err
    assert "free there" in err[0] and "the checkpoint of step 1 is intact" in err[0]
    assert [e.name for e in retention.entries(out)] == ["checkpoint-00000001.pt"]
    faults.arm(None)
    assert main([*args, "--steps", "3", "--out", str(out), "--resume"]) == 0
    assert _metrics(out) == _metrics(tmp_path / "straight")
    # a full disk while logging metrics: the same one line, exit 2
    Faults(monkeypatch, out, only="metrics.jsonl").arm(2)
    assert main([*args, "--steps", "5", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device writing" in err[0] and "metrics.jsonl" in err[0], err
