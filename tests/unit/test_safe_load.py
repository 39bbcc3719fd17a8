"""Checkpoints are loaded without running code (memfit.training.safe_load): a pickle payload in a
checkpoint file, in a DCP checkpoint's meta.pt, its .metadata or its non-tensor values is refused
in one line naming it, and never runs; what memfit writes (torchao's subclass states included)
still loads.

On main before this change, ``checkpoint.read`` ran the payload of test 1 (weights_only=False)."""

import os
import pickle

import pytest
import torch

from memfit.cli.main import main
from memfit.errors import UserError
from memfit.plans import Plan
from memfit.step import build_step, make_batch
from memfit.target import Target
from memfit.training import checkpoint, sharded_checkpoint
from memfit.training.safe_load import UnsafeCheckpoint

SMALL = "mha:vocab=256,dim=32,heads=2,layers=1,seq_len=16"  # (no transformers: a quick command)


class Payload:
    """What an attacker adds to a checkpoint: unpickling it runs ``touch MARKER``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class OneRank:
    is_main = True

    def barrier(self) -> None:
        pass


def _step(plan=None):
    target = Target.resolve(SMALL, plan or Plan(), 2, "cpu")
    step = build_step(target)
    step(make_batch(target))
    return step


def _save(out, step, index=1, ranks=None):
    return checkpoint.save(out, step, step_index=index, samples_seen=2 * index, workload=SMALL,
                           requested_plan=step.plan, ranks=ranks)


def test_a_reduce_payload_in_a_checkpoint_is_refused_and_never_runs(tmp_path, capsys):
    out, marker = tmp_path / "out", tmp_path / "ran"
    out.mkdir()
    path = _save(out, _step())
    state = torch.load(path, weights_only=False)
    state["optimizer"]["extra"] = Payload(marker)
    torch.save(state, path)
    with pytest.raises(UnsafeCheckpoint, match=r"names posix\.system, which memfit never writes; refused unread"):
        checkpoint.read(out)
    assert not marker.exists()
    # the command: one line, exit 2, and still nothing ran
    assert main(["train", SMALL, "-b", "2", "--steps", "2", "--out", str(out), "--resume", "--no-report"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names posix.system" in err[0] and not marker.exists()


def test_a_payload_anywhere_in_a_dcp_checkpoint_is_refused(tmp_path):
    marker = tmp_path / "ran"
    folder = _save(tmp_path, _step(), ranks=OneRank())
    # meta.pt (memfit's own record)
    meta = torch.load(folder / "meta.pt", weights_only=False)
    torch.save({**meta, "rng": {**meta["rng"], "x": Payload(marker)}}, folder / "meta.pt")
    with pytest.raises(UnsafeCheckpoint, match="names posix.system"):
        checkpoint.read(tmp_path)
    torch.save(meta, folder / "meta.pt")
    assert checkpoint.read(tmp_path)["step"] == 1
    # DCP's .metadata (a plain pickle): a payload wrapped around the real metadata
    metadata = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(pickle.dumps((Payload(marker), pickle.loads(metadata))))
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata' names posix\.system"):
        checkpoint.read(tmp_path)
    assert not marker.exists()


def test_a_payload_in_a_dcp_value_is_refused_where_dcp_itself_would_run_it(tmp_path):
    """DCP's default planner loads non-tensor values with weights_only=False: it runs the payload;
    memfit's planner refuses it."""
    import torch.distributed.checkpoint as dcp
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "lr": Payload(marker)}, checkpoint_id=str(tmp_path / "c"))
    with pytest.raises(UnsafeCheckpoint, match="names posix.system"):
        sharded_checkpoint.load_folder({"w": torch.zeros(2), "lr": None}, str(tmp_path / "c"))
    assert not marker.exists()
    dcp.load({"w": torch.zeros(2), "lr": None}, checkpoint_id=str(tmp_path / "c"))  # PyTorch's default
    assert marker.exists()


def test_what_memfit_writes_loads_by_the_allowlist(tmp_path):
    """8-bit bitsandbytes states are plain tensors; torchao's are tensor subclasses, allowlisted by
    memfit (torchao registers them itself when imported: that registration is cleared here)."""
    pytest.importorskip("torchao")
    path = _save(tmp_path, _step(Plan(optimizer="adamw8bit-ao")))
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(pickle.UnpicklingError, match="OptimState8bit"):  # PyTorch's default allowlist alone
            torch.load(path, weights_only=True)
        state = checkpoint.read(tmp_path)
    finally:
        torch.serialization.add_safe_globals(registered)
    kinds = {type(v).__name__ for s in state["optimizer"]["state"].values() for v in s.values()}
    assert "OptimState8bit" in kinds


def test_a_checkpoint_missing_its_fields_is_skipped_not_crashed_on(tmp_path):
    _save(tmp_path, _step(), index=1)
    torch.save({"format": checkpoint.FORMAT, "step": 2}, tmp_path / "checkpoint-00000002.pt")  # loads, but is no checkpoint
    state = checkpoint.read(tmp_path)
    assert state["step"] == 1 and state["skipped"] == [("checkpoint-00000002.pt",
                                                        "not a memfit checkpoint of this version")]
    (tmp_path / "checkpoint-00000001.pt").unlink()
    with pytest.raises(UserError, match="no checkpoint in .* loads"):
        checkpoint.read(tmp_path)
