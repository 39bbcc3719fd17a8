"""Sharding plans (memfit.techniques.sharding): what a plan refuses, and one rank's prediction on a
fake process group (the 2-process tests are tests/integration/test_sharding.py)."""

import pytest

from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.target import Target

SMALL = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=32"


@pytest.mark.parametrize("fields, batch, message", [
    ({"world_size": 4}, 2, "world_size 4 is larger than the batch (2)"),
    ({"world_size": 4}, 6, "does not split evenly over world_size 4"),
    ({"shard": "none", "world_size": 2}, 8, "world_size 2 needs shard: fsdp"),
    ({"shard_offload": True}, 8, "are FSDP2 options; add shard: fsdp"),
    ({"world_size": 0}, 8, "world_size must be a whole number >= 1"),
    ({"world_size": 2, "optimizer": "adamw8bit"}, 8, "shard: fsdp with optimizer: adamw8bit"),
    ({"world_size": 2, "compile": "full"}, 8, "shard: fsdp with compile: full"),
    ({"world_size": 2, "offload": ["optimizer_states"]}, 8, "use shard_offload: true"),
    ({"world_size": 2, "precision": "bf16", "shard_param_dtype": "bf16"}, 8, "both cast the compute"),
    ({"shard": "zero3"}, 8, "shard 'zero3' is not valid"),
    ({"world_size": 2, "precision": "fp16"}, 8, "shard: fsdp with precision: fp16"),
])
def test_bad_sharded_plans_are_refused_with_the_fix(fields, batch, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Target.resolve(SMALL, Plan(**fields), batch, "cpu", seq_len=32)


def test_world_size_alone_shards_and_each_rank_runs_its_share():
    target = Target.resolve(SMALL, Plan(world_size=4), 8, "cpu", seq_len=32)
    assert target.plan.shard == "fsdp" and target.rank_batch_size == 2
    assert Plan(world_size=4, micro_batch_size=1).micro_batches(8) == (1, 2)


def test_a_rank_holds_its_share_of_the_model_states_and_the_buffers_in_flight():
    """Against one process: parameters and optimizer states halve over 2 ranks (up to FSDP2's
    padding), each rank's batch halves, and gathered parameters show as communication."""
    one = estimate(SMALL, Plan(), batch_size=8, device="cpu", seq_len=32)
    two = estimate(SMALL, Plan(world_size=2), batch_size=8, device="cpu", seq_len=32)
    for category in ("parameters", "optimizer_states"):
        assert one.breakdown[category] / 2 <= two.breakdown[category] <= one.breakdown[category] / 2 * 1.01
    assert two.breakdown["inputs"] == one.breakdown["inputs"] / 2
    assert two.breakdown["communication"] > 0 and one.breakdown["communication"] == 0
    assert two.peak_bytes < one.peak_bytes


def test_a_gpu_preset_rank_is_predicted_without_a_gpu():
    """FSDP2 on fake CUDA tensors with no GPU here: the same sharded states as on the CPU, the
    gathered parameters as communication, and CUDA's own figures (reserved bytes, context)."""
    cpu = estimate(SMALL, Plan(world_size=2), batch_size=8, device="cpu", seq_len=32)
    gpu = estimate(SMALL, Plan(world_size=2), batch_size=8, device="h100-80gb", seq_len=32)
    assert gpu.breakdown["optimizer_states"] >= cpu.breakdown["optimizer_states"] > 0
    assert gpu.breakdown["communication"] > 0 and gpu.reserved_bytes >= gpu.peak_bytes


def test_the_fsdp2_internals_memfit_hooks_into_are_there():
    """NOTE [ FSDP2's buffers ] and the device handle without a GPU patch these by name: fail loudly
    if a PyTorch release moves them."""
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_collectives,
        _fsdp_init,
        _fsdp_param,
        _fsdp_param_group,
        _fsdp_state,
    )

    from memfit.memory.adapters import FSDP_BUFFER_METHODS
    for name in FSDP_BUFFER_METHODS:
        assert callable(getattr(_fsdp_param_group.FSDPParamGroup, name))
    assert callable(_fsdp_param.alloc_storage) and callable(_fsdp_param.free_storage)
    assert callable(_fsdp_param_group.alloc_storage)
    for module in (_fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state):
        assert callable(module._get_device_handle)


@pytest.mark.slow  # (keeps the default suite under 10 minutes)
def test_the_planner_searches_the_other_techniques_at_a_fixed_world_size():
    """``plan --world-size 2`` on a GPU preset: every candidate is sharded over 2 ranks, the chosen
    plan's figures are one rank's (its full trace), below what one rank of the unsharded plan needs."""
    from memfit.planner.search import plan
    from memfit.planner.space import SearchSpace
    deep = "gpt2:n_layer=6,n_embd=256,n_head=4,vocab_size=2000,n_positions=128"
    space = SearchSpace(values={"precision": ["fp32", "bf16"], "checkpointing": ["none", "blocks"]}, micro_batches=[4])
    r = plan(deep, device="h100-80gb", batch_size=8, seq_len=128, space=space, fixed={"world_size": 2})
    assert r.chosen.plan.world_size == 2 and r.chosen.plan.shard == "fsdp"
    assert all(c.plan.world_size == 2 for c in r.candidates)
    one = estimate(deep, r.chosen.plan.replace(world_size=1, shard="none"), batch_size=8, device="h100-80gb",
                   seq_len=128)
    assert r.chosen.peak_bytes < one.peak_bytes


def test_fsdp2_buffers_go_to_their_streams_pools_on_a_gpu_preset():
    """What FSDP2 allocates on its all-gather and reduce-scatter streams is booked to those streams
    in the caching-allocator model (memfit.memory.allocator), not to the compute stream's pool."""
    from memfit.memory.faketrace import run_tracked
    from memfit.techniques.sharding import FSDP_STREAMS
    run = run_tracked(Target.resolve(SMALL, Plan(world_size=2), 8, "h100-80gb", seq_len=32), fake=True)
    on_streams = {run.tracker.state.records[s].label for s, n in run.tracker.side_streams.items() if n >= FSDP_STREAMS}
    assert "communication" in on_streams
    assert len({n for n in run.tracker.side_streams.values() if n >= FSDP_STREAMS}) >= 2  # gather and reduce
