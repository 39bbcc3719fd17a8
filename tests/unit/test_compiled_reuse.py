"""One compiled graph for every copy of the model: plans that differ outside the compiled regions
(the optimizer, stepping in backward) trace them once per process, and the reused graph predicts
what a fresh compile predicts (NOTE [ Wrapped forwards that torch.compile does not tie to one model ]
in memfit.techniques.forwards)."""

import functools

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from memfit.memory.budget import Budget
from memfit.planner.space import model_facts
from memfit.planner.trace_job import Tracer
from memfit.planner.traces import compiles
from memfit.plans import Plan
from memfit.target import Target
from memfit.techniques.compiled import has_triton
from memfit.techniques.forwards import forward_of

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128"
BASE = {"precision": "bf16-pure", "compile": "full", "loss_chunks": 2}

needs_triton = pytest.mark.skipif(not has_triton(), reason="a GPU preset's compiled regions take Triton's code generator")


def _captures() -> int:
    return sum(counters["frames"].values())


def _tracer(batch: int = 4, seq_len: int = 64):
    target = Target.resolve(SPEC, None, batch, "h100-80gb", seq_len=seq_len)
    return Tracer(target, model_facts(target.workload).model, Budget.resolve("8GiB", target.device))


@needs_triton
@pytest.mark.parametrize("checkpointing", ["blocks", pytest.param("selective", marks=pytest.mark.slow)])
def test_a_checkpointed_whole_model_graph_is_captured_once_for_plans_that_share_it(checkpointing):
    torch._dynamo.reset()
    tracer = _tracer()
    plans = [Plan.from_dict({**BASE, "checkpointing": checkpointing, **extra})
             for extra in ({}, {"optimizer": "adafactor"}, {"optimizer_in_backward": True})]
    assert len({compiles((p, 2, None)) for p in plans}) == 1  # one worker's key: one graph
    before = _captures()
    reused = [tracer((p, 2, None)) for p in plans]
    captured = _captures() - before
    torch._dynamo.reset()  # the last plan again, compiled afresh
    fresh = tracer((plans[-1], 2, None))
    assert captured == _captures() - before - captured > 0  # the plans' three traces captured as often as one
    assert (reused[-1].peak_bytes, reused[-1].used_bytes) == (fresh.peak_bytes, fresh.used_bytes)
    assert [o[:7] for o in reused[-1].ops] == [o[:7] for o in fresh.ops]  # (all but storage keys)
    assert reused[0].peak_bytes != reused[1].peak_bytes  # (the optimizers' states differ: not one trace twice)


def test_a_wrapped_forward_names_no_model_object():
    layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    wrapped = forward_of(layers[0])
    assert isinstance(wrapped, functools.partial) and wrapped.func is nn.Linear.forward and wrapped.args == (layers[0],)
    x = torch.randn(2, 4)
    assert torch.equal(wrapped(x), layers[0](x))
    layers[1].forward = functools.partial(nn.Linear.forward, layers[1])  # an instance-level forward is kept
    assert forward_of(layers[1]) is layers[1].forward


def test_plans_that_differ_outside_the_graph_share_a_workers_key_and_others_do_not():
    plan = Plan.from_dict({**BASE, "checkpointing": "blocks"})
    key = compiles((plan, 2, None))
    assert compiles((plan.replace(optimizer="adamw8bit", offload=["optimizer_states"]), 2, None)) == key
    assert compiles((plan.replace(offload=["activations"]), 2, None)) != key
    assert compiles((plan.replace(loss_chunks=8), 2, None)) != key
    assert compiles((plan, 3, None)) != key  # a whole-model graph per depth
    blocks = plan.replace(compile="blocks")
    assert compiles((blocks, 2, None)) == compiles((blocks, 3, None))  # a block's graph at every depth


@needs_triton
@pytest.mark.slow  # (27 s: keeps the default suite under 10 minutes)
def test_a_shape_predicted_before_leaves_the_next_shapes_prediction_as_a_fresh_process_makes_it():
    torch._dynamo.reset()
    tracer = _tracer(batch=6, seq_len=100)
    plan = Plan.from_dict(BASE)
    tracer((plan.replace(micro_batch_size=3), 2, None))  # (the same region at another shape first)
    after = tracer((plan, 2, None))
    torch._dynamo.reset()
    fresh = tracer((plan, 2, None))
    assert (after.peak_bytes, after.used_bytes) == (fresh.peak_bytes, fresh.used_bytes)
    assert [o[:7] for o in after.ops] == [o[:7] for o in fresh.ops]
