"""DCP checkpoints (memfit.training.sharded_checkpoint) in one process: what several ranks write,
one process reads; a save cut short leaves the last good checkpoints; resume takes the newest
that loads, of either kind."""

import re

import pytest
import torch

from memfit.errors import UserError
from memfit.plans import Plan
from memfit.step import build_step, make_batch
from memfit.target import Target
from memfit.training import checkpoint, sharded_checkpoint
from memfit.training.saver import Saver

SMALL = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=32,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"


class OneRank:
    """The one rank of a process that is its own world (``save``'s collectives are DCP's, which run
    without a process group in one process)."""

    is_main = True

    def barrier(self) -> None:
        pass


def _trained(steps: int, seed: int = 0):
    target = Target.resolve(SMALL, Plan(), 4, "cpu", seq_len=32)
    torch.manual_seed(seed)
    step = build_step(target)
    for _ in range(steps):
        step(make_batch(target))
    return step


def _save(out, step, index: int):
    return checkpoint.save(out, step, step_index=index, samples_seen=4 * index, workload=SMALL,
                           requested_plan=Plan(), ranks=OneRank())


def test_a_dcp_checkpoint_restores_model_optimizer_and_position(tmp_path):
    step = _trained(2)
    _save(tmp_path, step, 2)
    state = checkpoint.read(tmp_path)
    assert state["kind"] == "dcp" and state["step"] == 2 and state["samples_seen"] == 8
    fresh = _trained(0, seed=1)
    assert checkpoint.restore(fresh, state) == (2, 8)
    for (name, a), b in zip(step.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(a, b), name
    saved, loaded = step.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    for i in saved:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved[i][key], loaded[i][key])


def _saver(out, keep: int = 2):
    return Saver(out, keep=keep, workload=SMALL, requested=Plan(), ranks=OneRank())


def test_a_save_cut_short_leaves_the_last_good_checkpoints(tmp_path):
    saver, step = _saver(tmp_path), _trained(1)
    for index in (2, 4, 6):
        saver.save(step, index=index, samples_seen=4 * index)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-dcp-*")) == ["checkpoint-dcp-00000004",
                                                                         "checkpoint-dcp-00000006"]  # the last 2
    # a save of step 8 killed after writing shards, before rank 0 marked it complete
    (tmp_path / "checkpoint-dcp-00000008").mkdir()
    (tmp_path / "checkpoint-dcp-00000008" / "__0_0.distcp").write_bytes(b"partial")
    assert checkpoint.read(tmp_path)["step"] == 6
    # a complete one that does not load: resume takes the one before, and says so
    (tmp_path / "checkpoint-dcp-00000006" / "meta.pt").write_bytes(b"not a checkpoint")
    state = checkpoint.read(tmp_path)
    assert state["step"] == 4
    assert re.fullmatch(r"resume: skipped checkpoint-dcp-00000006 \(corrupt or unreadable: ValueError: [^\n]+\); "
                        r"continuing from checkpoint-dcp-00000004 \(step 4\)", checkpoint.skipped_note(state))
    # a shard cut short (a full disk on one rank) is found before the run starts
    shard = next((tmp_path / "checkpoint-dcp-00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UserError, match=r"no checkpoint in .* loads \(checkpoint-dcp-00000006: corrupt.*"
                                        r"checkpoint-dcp-00000004: shard file __0_0.distcp is missing or cut short"):
        checkpoint.read(tmp_path)


def test_the_later_checkpoint_of_either_kind_is_current(tmp_path):
    step = _trained(1)
    saver = _saver(tmp_path, keep=3)
    saver.save(step, index=2, samples_seen=8)
    whole = Saver(tmp_path, keep=3, workload=SMALL, requested=Plan(), resumed={"step": 2})  # (one process now)
    whole.save(step, index=4, samples_seen=16)
    assert checkpoint.read(tmp_path)["kind"] == "whole"
    assert sharded_checkpoint.read(tmp_path / "checkpoint-dcp-00000002")["step"] == 2  # kept: one of the last 3
    _save(tmp_path, step, 6)
    assert checkpoint.read(tmp_path)["kind"] == "dcp" and checkpoint.read(tmp_path)["step"] == 6
    checkpoint.save(tmp_path, step, step_index=8, samples_seen=32, workload=SMALL, requested_plan=Plan())
    assert checkpoint.read(tmp_path)["kind"] == "whole" and checkpoint.read(tmp_path)["step"] == 8


def test_another_world_size_is_the_same_plan_for_resuming(tmp_path):
    step = _trained(1)
    checkpoint.save(tmp_path, step, step_index=1, samples_seen=4, workload=SMALL,
                    requested_plan=Plan(world_size=2))
    state = checkpoint.read(tmp_path)
    checkpoint.check(state, workload=SMALL, requested_plan=Plan(), batch_size=4)
    assert checkpoint.resumed_plan(state, Plan(world_size=4)) == Plan(world_size=4)
    with pytest.raises(UserError, match="another plan or batch size"):
        checkpoint.check(state, workload=SMALL, requested_plan=Plan(micro_batch_size=2), batch_size=4)


def test_a_failed_collective_is_one_line_that_keeps_the_checkpoint(tmp_path):
    from memfit.training.distributed import out_of_step
    error = torch.distributed.DistBackendError("[gloo] Timed out waiting 600000ms for recv\nmore detail")
    message = str(out_of_step(error, tmp_path))
    assert "\n" not in message and "Timed out waiting 600000ms" in message and "--resume continues" in message
