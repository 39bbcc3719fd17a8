"""Ops that wait for others in the op list a shallow pair extrapolates (memfit.planner.op_links): the
full-depth step's prefetches and what waits for them, whatever addresses the allocator gave."""

import pytest

from memfit.memory.budget import Budget
from memfit.planner.op_links import Links, prefetches
from memfit.planner.search import gpu_search
from memfit.planner.shallow import depths, extrapolate_ops
from memfit.planner.space import SearchSpace, model_facts
from memfit.planner.timing import H100, time_from_ops, trace_step
from memfit.plans import Plan
from memfit.target import Target

WIDE8 = ("llama:num_hidden_layers=8,hidden_size=2048,intermediate_size=5504,num_attention_heads=16,"
         "num_key_value_heads=16,vocab_size=500")
"""Blocks whose compute at 2 x 512 tokens on the rtx4090 preset is shorter than their weights' copy over
the link: the step waits for each prefetch."""


def _fresh_keys(ops: list) -> list:
    """``ops`` as an allocator that never hands an address out twice would have recorded them: each
    producer a key of its own, each consumer its producer's, no other keys."""
    links = Links(ops)
    return [op._replace(key=i + 1) if prefetches(op) else
            op._replace(key=links.producer[i] + 1) if i in links.producer else op._replace(key=0)
            for i, op in enumerate(ops)]


@pytest.fixture(scope="module")
def swapped_traces():
    """Every block swapped, selective checkpointing, two micro-batches (Gemma-2-9B's LoRA plan on a 24 GB
    card, at 8 blocks): the full trace's ops and the shallow pair's."""
    plan = Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="selective", swap_blocks=8,
                micro_batch_size=1, loss_chunks=8)
    target = Target.resolve(WIDE8, plan, 2, "rtx4090", seq_len=512)
    _, _, full = trace_step(target)
    space = SearchSpace(values={"precision": ["bf16-pure"]}, micro_batches=[2])
    book, _, _ = gpu_search(target, space, model_facts(target.workload), Budget.resolve(None, target.device))
    try:
        pair = depths(target.plan, 8)
        a, b = book._run([(target.plan, d, None) for d in pair])
    finally:
        book.close()
    return target, full, a.ops, b.ops, pair


def test_the_extrapolated_step_waits_for_the_prefetches_the_full_step_waits_for(swapped_traces):
    """NOTE [ Ops that wait for others, in the extrapolated ops ]: with keys that no address reuse links by
    chance, the extrapolated step is priced as the full trace (within 0.5%, and its time waiting on the
    link too), its ops the same, each waiting for the same prefetch. Before, every copy of the repeated
    stretch kept the deeper trace's keys: here 69 ops waited for a prefetch against the full step's 249,
    and the step waited 31 ms on the link against 58 ms; on Gemma-2-9B's LoRA swapping all its blocks,
    each block waited for the next block's prefetch (4.72 s against 4.14 s)."""
    target, full, a, b, pair = swapped_traces
    ops = extrapolate_ops(_fresh_keys(a), _fresh_keys(b), *pair, 8)
    assert ops is not None and [op._replace(key=0) for op in ops] == [op._replace(key=0) for op in full]
    priced, truth = time_from_ops(ops, target, H100), time_from_ops(full, target, H100)
    assert priced.seconds == pytest.approx(truth.seconds, rel=0.005)
    assert priced.transfers == pytest.approx(truth.transfers, rel=0.005)
    # each op waits for the prefetch it waits for in the full step
    assert Links(ops).producer == Links(full).producer


def test_a_stretch_that_would_separate_a_block_from_its_prefetch_is_not_taken(swapped_traces):
    """The places where the stretch could start include one at block 0's compute (its weights were copied
    before it: it waits for no prefetch) followed by block 2's prefetch; repeated, no block would wait.
    The place taken is a block of the steady state: with the recorder's own keys too, each op waits for
    the prefetch it waits for in the full step."""
    _, full, a, b, pair = swapped_traces
    ops = extrapolate_ops(a, b, *pair, 8)
    assert Links(ops).producer == Links(full).producer
