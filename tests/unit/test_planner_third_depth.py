"""NOTE [ The deep stream checked at a third depth ] (memfit.planner.deep_figures): a chosen plan's figures
from its shallow pair's allocations at full depth, checked by a trace at a third depth in place of its
full trace, equal ``memfit estimate``'s full trace; where the check misses, the full trace decides."""

import pytest

from memfit.devices import get_device
from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate
from memfit.planner import deep_figures
from memfit.planner.search import plan
from memfit.planner.space import SearchSpace
from memfit.quiet import silenced_warnings

LLAMA = ("llama:num_hidden_layers=8,hidden_size=128,intermediate_size=256,num_attention_heads=4,"
         "num_key_value_heads=2,vocab_size=1000")
ARGS = dict(device="rtx4090", batch_size=4, seq_len=128, budget="20GiB")


def _search(fields: dict):
    space = SearchSpace(values={k: [v] for k, v in fields.items()}, micro_batches=[4])
    with silenced_warnings():
        return plan(LLAMA, space=space, **ARGS)


def _truth(result):
    """The chosen plan's (allocator side + managed, allocated peak) by its own full trace."""
    with silenced_warnings():
        report = estimate(LLAMA, result.chosen.plan, batch_size=4, seq_len=128, device="rtx4090")
    return Budget(result.budget_bytes, get_device("rtx4090")).used_bytes(report), report.peak_bytes


@pytest.mark.parametrize("fields", [
    {"precision": "bf16-pure", "checkpointing": "blocks"},
    # (every second block checkpointed: the top block's backward makes the cuBLASLt workspace, NOTE [ A
    # workspace made on first use ] in memfit.memory.stretches)
    {"precision": "bf16-pure", "checkpointing": "blocks:every=2", "adapter": "lora:r=8"},
    # (clipped: the stacked norms grow with the blocks, NOTE [ An allocation sized by the depth ])
    {"precision": "bf16-pure", "checkpointing": "blocks", "adapter": "lora:r=8", "max_grad_norm": 1.0},
])
def test_a_plan_confirmed_at_a_third_depth_has_its_full_traces_figures(fields):
    result = _search(fields)
    kinds = " ".join(result.trace_seconds)
    assert "third depth" in kinds and "full-depth" not in kinds
    assert (result.chosen.used_bytes, result.chosen.peak_bytes) == _truth(result)


def test_a_deep_stream_that_misses_its_third_depth_is_confirmed_by_the_full_trace(monkeypatch):
    true_replay = deep_figures.replay
    monkeypatch.setattr(deep_figures, "replay", lambda s, *a, **k: (lambda p, r: (p, r + 1))(*true_replay(s, *a, **k)))
    result = _search({"precision": "bf16-pure", "checkpointing": "blocks"})
    kinds = " ".join(result.trace_seconds)
    assert "third depth" in kinds and "full-depth" in kinds
    assert (result.chosen.used_bytes, result.chosen.peak_bytes) == _truth(result)


def test_a_third_depth_trace_that_fails_is_a_miss_and_shallow_pairs_go_on(monkeypatch):
    """A failed trace at the third depth sends the plan to its full trace; it does not turn shallow pairs off for
    the search (as a failed shallow trace does)."""
    from memfit.planner.trace_job import Tracer
    traced = Tracer.__call__
    monkeypatch.setattr(Tracer, "__call__", lambda self, job: RuntimeError("boom") if job[1] == 4 else traced(self, job))
    result = _search({"precision": "bf16-pure", "checkpointing": "blocks"})
    full = sum(n for kind, (n, _) in result.trace_seconds.items() if "full-depth" in kind)
    assert full == 1 and any("shallow" in kind for kind in result.trace_seconds)
    assert (result.chosen.used_bytes, result.chosen.peak_bytes) == _truth(result)
