"""DCP checkpoints (memfit.training.sharded_checkpoint) in one process: what several ranks write,
one process reads; a save cut short leaves the last good checkpoint current; the current
checkpoint of a folder is the later one of either kind."""

import pytest
import torch

from memfit.errors import UserError
from memfit.plans import Plan
from memfit.step import build_step, make_batch
from memfit.target import Target
from memfit.training import checkpoint, sharded_checkpoint

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


def test_a_save_cut_short_leaves_the_last_good_checkpoint(tmp_path):
    _save(tmp_path, _trained(1), 2)
    _save(tmp_path, _trained(1), 4)
    assert [p.name for p in tmp_path.glob("checkpoint-dcp-*")] == ["checkpoint-dcp-00000004"]  # older removed
    # a save of step 6 killed after writing shards, before the pointer moved
    (tmp_path / "checkpoint-dcp-00000006").mkdir()
    (tmp_path / "checkpoint-dcp-00000006" / "__0_0.distcp").write_bytes(b"partial")
    assert checkpoint.read(tmp_path)["step"] == 4
    (tmp_path / "checkpoint-dcp.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt or unreadable"):
        checkpoint.read(tmp_path)


def test_the_later_checkpoint_of_either_kind_is_current(tmp_path):
    step = _trained(1)
    _save(tmp_path, step, 2)
    checkpoint.save(tmp_path, step, step_index=4, samples_seen=16, workload=SMALL, requested_plan=Plan())
    assert not sharded_checkpoint.exists(tmp_path)  # the one-process save replaced it
    assert checkpoint.read(tmp_path)["kind"] == "whole"
    _save(tmp_path, step, 6)
    assert not (tmp_path / checkpoint.NAME).exists()
    assert checkpoint.read(tmp_path)["step"] == 6
    # both present (a run killed between writing one and removing the other): the later step wins
    other = tmp_path / "other"
    other.mkdir()
    for index, kind in ((8, "whole"), (4, "dcp")):
        checkpoint.save(other, step, step_index=index, samples_seen=4 * index, workload=SMALL, requested_plan=Plan())
        (other / checkpoint.NAME).replace(tmp_path / checkpoint.NAME)
        assert checkpoint.read(tmp_path)["kind"] == kind


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
