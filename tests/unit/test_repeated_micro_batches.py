"""NOTE [ Repeated micro-batches, traced once ] (memfit.step): a planner's trace (shallow or full) of a plan
split into more than three micro-batches runs the first two and the last, and gives what the whole
step's trace gives: peak, reserved bytes, ops (so its time), and a stream that replays at full depth."""

import pytest

from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.deep_stream import deepen, replay
from memfit.planner import trace_job
from memfit.planner.ops import BACKWARD, FORWARD, OPTIMIZER, Op, repeat_micro_batch
from memfit.planner.shallow import depths
from memfit.planner.space import model_facts
from memfit.planner.stacks import depth_of
from memfit.planner.timing import time_from_ops
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.step import micro_batches_run, repeats_skipped
from memfit.target import Target

LLAMA = "llama:num_hidden_layers=6,hidden_size=256,intermediate_size=512,num_attention_heads=4,num_key_value_heads=4,vocab_size=1000"


def test_only_the_first_two_and_the_last_micro_batches_run_when_repeats_are_skipped():
    assert micro_batches_run(8) == tuple(range(8))
    with repeats_skipped():
        assert micro_batches_run(8) == (0, 1, 7)
        assert micro_batches_run(3) == (0, 1, 2)
    assert micro_batches_run(8) == tuple(range(8))


def test_the_second_micro_batchs_ops_stand_for_each_skipped_one():
    def op(phase, i):
        return Op(kind=i, phase=phase, flops=0.0, nbytes=0, dtype="half", tensors=0, flags=0)

    ops = [op(FORWARD - 1, 0), *(op(p, 10 * m + p) for m in range(3) for p in (FORWARD, BACKWARD)), op(OPTIMIZER, 99)]
    out = repeat_micro_batch(ops, 6)
    middle = ops[3:5]
    assert out == ops[:5] + middle * 3 + ops[5:]
    assert repeat_micro_batch(ops[:5] + ops[7:], 6) is None  # (two micro-batches in the ops: not skipped)


@pytest.mark.parametrize("fields,shallow_whole", [
    ({"precision": "bf16", "offload": ("optimizer_states",)}, False),
    pytest.param({"precision": "bf16", "offload": ("optimizer_states",)}, True, marks=pytest.mark.slow),
    pytest.param({"precision": "bf16-pure", "checkpointing": "selective", "loss_chunks": 4}, True, marks=pytest.mark.slow),
])
def test_a_trace_skipping_repeated_micro_batches_gives_the_whole_steps_figures(fields, shallow_whole):
    """The full trace, skipping, against the whole one; the skipped shallow pair carried to full depth
    against the full trace (``shallow_whole``: and each shallow trace against its whole one). (Swapped
    blocks: ``python -m bench.deep_stream_check llama:num_hidden_layers=8 --swap 0,4,8 -b 8
    --micro-batch-size 1 --seq-len 1024`` replays each pair of skipped traces to its full trace, to the byte.)"""
    target = Target.resolve(LLAMA, Plan(**fields), 5, "rtx4090", seq_len=128)
    with silenced_warnings():
        facts = model_facts(target.workload)
    tracer = trace_job.Tracer(target, facts.model, Budget.resolve(None, target.device))
    plan = Plan(**fields, micro_batch_size=1)  # (five micro-batches: two skipped)
    pair = depths(plan, depth_of(facts.model))
    jobs = [(plan, d, None) for d in pair] + [(plan, None, None)]
    with silenced_warnings():
        skipped = [tracer(job) for job in jobs]
        whole_has_repeats, trace_job.has_repeats = trace_job.has_repeats, lambda n: False
        try:
            whole = [tracer(job) for job in (jobs if shallow_whole else jobs[2:])]
        finally:
            trace_job.has_repeats = whole_has_repeats
    at = target.with_plan(plan)
    for s, w in zip(skipped[-len(whole):], whole):
        assert (s.peak_bytes, s.used_bytes, s.expandable_used_bytes) == (w.peak_bytes, w.used_bytes, w.expandable_used_bytes)
        assert len(s.ops) == len(w.ops)
        assert time_from_ops(s.ops, at).seconds == pytest.approx(time_from_ops(w.ops, at).seconds, rel=1e-9)
    full = skipped[2]
    deep = deepen(skipped[0].stream, skipped[1].stream, *pair, depth_of(facts.model))
    assert replay(deep, STEADY_STEP)[:2] == (full.peak_bytes, full.used_bytes - full.context_bytes)
