"""Shallow traces of a model whose stacks of repeated blocks have two depths (FLUX.1: 19 double-stream
blocks, then 38 single-stream ones): NOTE [ Stacks of two depths ] in memfit.planner.shallow."""

import pytest

from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.deep_stream import deepen, replay
from memfit.planner.shallow import depths, extrapolate, extrapolate_ops, shallow_workload
from memfit.planner.space import model_facts
from memfit.planner.stacks import depth_of
from memfit.planner.timing import time_from_ops
from memfit.planner.trace_job import Tracer
from memfit.plans import Plan
from memfit.target import Target
from memfit.techniques.swap_blocks import model_blocks
from memfit.workloads import load_workload

FLUX6 = ("dit-flux:num_layers=6,num_single_layers=12,attention_head_dim=64,num_attention_heads=4,"
         "joint_attention_dim=32,pooled_projection_dim=16,in_channels=16,axes_dims_rope=8/28/28")
"""FLUX.1's two stacks at a third of their depth (6 and 12 blocks: a unit of 1 + 2, 6 units deep)."""


def test_stacks_of_two_depths_are_cut_in_units_of_both():
    workload = load_workload(FLUX6, resolution=256)
    facts = model_facts(workload)
    assert depth_of(facts.model) == 6
    model = shallow_workload(workload, 2, meta=facts.model).model()
    assert (len(model.transformer_blocks), len(model.single_transformer_blocks)) == (2, 4)
    assert depths(Plan(swap_blocks=6), 6) == (2, 3) and depths(Plan(swap_blocks=4), 6) is None  # (4 of 18: 4/3 a unit)


@pytest.mark.slow  # (21 s and 23 s: the suite under 10 minutes; test_planner_gpu's swapped plans of one stack, two
@pytest.mark.parametrize("swapped", [0, 18])  # containers when some blocks are swapped, stay in the default suite)
def test_flux_plans_from_their_shallow_pairs_are_their_full_traces(swapped):
    """A LoRA with blocks checkpointed, none or every block swapped, traced as the planner's workers trace it: the
    peak on the line through 2 + 4 and 3 + 6 blocks is the full trace's (within 0.5%), and so is the step
    time (within 2%). Every block swapped, the peak moves: at 2 and 3 units it is in the double blocks'
    backward (their transients), at full depth where backward starts (every block's saved input); the
    line through the pair is then low (2.5% here, 27% for FLUX.1-dev at 1024 px), never high: each
    moment's bytes are on a line in the depth, and their maximum is convex. It is a lower bound, as the
    planner uses it, and the chosen plan is confirmed by a full trace. Before, each plan of such a model
    was traced at full depth. Unswapped, the pair's allocations at full depth (memfit.memory.deep_stream)
    replay to the full trace's allocated peak and reserved bytes, to the byte (NOTE [ Stretches at the
    seam of two stacks ]), and so do every block swapped's (NOTE [ A block's first fetches two ]), whose
    peak the line missed; before, there was none, and each batch of a plan was a full trace."""
    plan = Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="blocks", swap_blocks=swapped)
    target = Target.resolve(FLUX6, plan, 1, "rtx4090", resolution=256)
    facts = model_facts(target.workload)
    assert sum(len(b) for b in [model_blocks(facts.model)]) == 18
    tracer = Tracer(target, facts.model, Budget.resolve(None, target.device))  # (what the book's workers run)
    a, b = (tracer((plan, d, None)) for d in depths(plan, 6))
    full = tracer((plan, None, None))
    peak = extrapolate(a.peak_bytes, b.peak_bytes, 2, 3, 6)
    ops = extrapolate_ops(a.ops, b.ops, 2, 3, 6)  # (as the book prices it: NOTE [ Stacks of two depths ])
    seconds = time_from_ops(ops, target).seconds if ops is not None else \
        extrapolate(*(time_from_ops(t.ops, target).seconds for t in (a, b)), 2, 3, 6)
    if not plan.swap_blocks:
        assert peak == pytest.approx(full.peak_bytes, rel=0.005)
    else:
        assert 0.95 * full.peak_bytes < peak <= full.peak_bytes
    deep = deepen(a.stream, b.stream, 2, 3, 6)
    assert deep is not None
    assert replay(deep, STEADY_STEP) == (full.peak_bytes, full.used_bytes - full.context_bytes)
    assert seconds == pytest.approx(time_from_ops(full.ops, target).seconds, rel=0.02)


@pytest.mark.slow  # (16 s; test_planner_gpu swaps some blocks of one stack in the default suite)
def test_flux_with_some_single_blocks_swapped_replays_its_full_trace():
    """A third of FLUX.1's blocks swapped (6 of 18: at 2 and 3 units, 2 and 3 of the single-stream blocks): three
    kinds of block, the double ones, the resident single ones and the swapped single ones, each inserted in its
    own stretch (NOTE [ Two kinds of block, as two containers ]). The pair's allocations at full depth replay
    to the full trace's allocated peak and reserved bytes to the byte (FLUX.1-dev at 1024 px, 19 of 57
    swapped: the same, once a block the diff split is joined: NOTE [ A block split by the diff ]). Before,
    such a plan kept no stream, and each batch of it was a full trace."""
    plan = Plan(adapter="lora:r=4", precision="bf16-pure", swap_blocks=6)
    target = Target.resolve(FLUX6, plan, 1, "rtx4090", resolution=256)
    facts = model_facts(target.workload)
    tracer = Tracer(target, facts.model, Budget.resolve(None, target.device))
    pair = depths(plan, 6)
    assert pair == (2, 3)
    a, b = (tracer((plan, d, None)) for d in pair)
    full = tracer((plan, None, None))
    deep = deepen(a.stream, b.stream, *pair, 6)
    assert deep is not None
    assert replay(deep, STEADY_STEP) == (full.peak_bytes, full.used_bytes - full.context_bytes)


def test_a_model_with_plain_tensors_is_traced_shallow_as_built_at_that_depth():
    """Qwen-Image keeps its rotary tables as plain attributes (NOTE [ Plain tensors of a meta build ]). Cut
    from the planner's meta model, each shallow trace failed to copy them ("__deepcopy__() for wrapper
    subclasses"), and every plan of it was traced at full depth (21 of 33 traces, 19 minutes for
    Qwen-Image at 1024 px). Now the shallow model is built with its record, and a trace at 2 of 4 blocks
    is the trace of the model built with 2, to the byte."""
    spec = "dit-qwenimage:attention_head_dim=16,num_attention_heads=2,joint_attention_dim=32,axes_dims_rope=4/6/6"
    plan = Plan(adapter="lora:r=4", precision="bf16", checkpointing="blocks")  # (weights built at the default dtype)
    target = Target.resolve(f"{spec},num_layers=4", plan, 1, "rtx4090", resolution=128)
    facts = model_facts(target.workload)
    shallow = Tracer(target, facts.model, Budget.resolve(None, target.device))((plan, 2, None))
    assert not isinstance(shallow, Exception), shallow
    at_two = Target.resolve(f"{spec},num_layers=2", plan, 1, "rtx4090", resolution=128)
    built = Tracer(at_two, model_facts(at_two.workload).model, Budget.resolve(None, at_two.device))((plan, None, None))
    assert shallow.peak_bytes == built.peak_bytes and shallow.used_bytes == built.used_bytes
