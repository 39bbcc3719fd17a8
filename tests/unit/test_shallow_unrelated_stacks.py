"""Shallow pairs of a model whose stacks' lengths share no divisor worth cutting by (a vision-language
model: a vision tower, then a language model): NOTE [ Stacks of unrelated depths ] in memfit.planner.shallow."""

import json
from types import SimpleNamespace

import pytest
import torch

from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.deep_stream import deepen, replay
from memfit.planner.shallow import depths, extrapolate, extrapolate_ops, shallow_workload
from memfit.planner.space import model_facts
from memfit.planner.stacks import Stacks, stacks_of
from memfit.planner.timing import time_from_ops
from memfit.planner.trace_job import Tracer
from memfit.planner.traces import TraceBook
from memfit.plans import Plan
from memfit.target import Target


class _Stacks(torch.nn.Module):
    def __init__(self, *lengths):
        super().__init__()
        for i, n in enumerate(lengths):
            setattr(self, f"stack{i}", torch.nn.ModuleList(  # (blocks of two layers: NOTE [ A list of single layers ])
                torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)) for _ in range(n)))


@pytest.mark.parametrize("lengths,full,unit", [
    ((32, 28), 28, (1, 1)),   # Qwen2.5-VL-7B: 4 + t vision blocks and t text ones
    ((27, 34), 27, (1, 1)),   # Gemma-3-4B: t and 7 + t
    ((24, 32), 8, (3, 4)),    # LLaVA-1.5-7B: a common divisor of 8, cut in units of it as before
    ((19, 38), 19, (1, 2)),   # FLUX.1
    ((40, 3), 40, (1, 0)),    # a stack shorter than the depth is kept whole
    ((4, 5), 1, (4, 5)),      # too shallow to cut: traced at full depth (depths() is None)
])
def test_the_depth_cut_traces_the_fewest_blocks_and_reaches_the_whole_model(lengths, full, unit):
    stacks = stacks_of(_Stacks(*lengths))
    assert (stacks.full, stacks.unit) == (full, unit)
    assert stacks.at(full) == lengths and all(o >= 0 for o in stacks.offsets)
    assert Stacks((32, 28), (1, 1), 28).describe() == "28 blocks (stacks of 32 and 28 cut to 4 + t and t)"


QWEN = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 400, "max_position_embeddings": 512, "vision_start_token_id": 390, "vision_end_token_id": 391,
        "image_token_id": 392, "video_token_id": 393, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {"depth": 8, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                          "fullatt_block_indexes": []}}
"""A Qwen2.5-VL of 8 vision blocks and 6 text ones (cut to 2 + t and t; every vision block windowed: a
configured full-attention block at an index past the cut is not in the pair, NOTE [ Stacks of unrelated depths ])."""


@pytest.mark.parametrize("plan", [pytest.param(Plan(precision="bf16"), marks=pytest.mark.slow),  # (12 s)
                                  Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="blocks:every=2")],
                         ids=["bf16", "lora-every-2"])
def test_a_vision_language_models_pair_gives_its_full_traces_peak_and_time(tmp_path, plan):
    """The pair's peak on its line is the full trace's, and its ops, a stretch of vision blocks and one of text
    blocks inserted apart in each phase, line up (:func:`memfit.planner.shallow._with_stretches`): the step time
    is the full trace's; and the pair's allocations at full depth replay to the full trace's allocated peak and
    reserved bytes, to the byte. Before, the model's stacks (8 and 6: a divisor of 2) gave no pair, and each plan was
    traced at full depth (Qwen2.5-VL-7B's: 43 s a trace)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN))
    target = Target.resolve(str(tmp_path), plan, 2, "rtx4090", seq_len=96, resolution=112)
    facts = model_facts(target.workload)
    stacks = stacks_of(facts.model)
    assert (stacks.full, stacks.offsets) == (6, (2, 0))
    model = shallow_workload(target.workload, 2, meta=facts.model).model()
    assert (len(model.model.visual.blocks), len(model.model.language_model.layers)) == (4, 2)
    tracer = Tracer(target, facts.model, Budget.resolve(None, target.device))
    pair = depths(plan, 6)
    a, b = (tracer((plan, d, None)) for d in pair)
    full = tracer((plan, None, None))
    assert extrapolate(a.peak_bytes, b.peak_bytes, *pair, 6) == pytest.approx(full.peak_bytes, rel=1e-4)
    ops = extrapolate_ops(a.ops, b.ops, *pair, 6)
    assert ops is not None
    assert time_from_ops(ops, target).seconds == pytest.approx(time_from_ops(full.ops, target).seconds, rel=0.005)
    deep = deepen(a.stream, b.stream, *pair, 6)  # (NOTE [ What the trace frees after its end ])
    assert deep is not None
    assert replay(deep, STEADY_STEP) == (full.peak_bytes, full.used_bytes - full.context_bytes)


def _op(kind, nbytes=8, phase="forward"):
    from memfit.planner.opcost import Op
    return Op(kind=kind, phase=phase, flops=nbytes, nbytes=nbytes, dtype="bf16", tensors=1, flags=0, key=0,
              host_bytes=0, is_causal=False, elements=nbytes)


def test_a_run_with_a_stretch_at_each_stack_repeats_both_and_puts_grown_ops_on_their_line():
    """The ops diff (:func:`memfit.planner.shallow._with_stretches`): a stretch inserted at the start, one in the
    middle and one at the end each repeat ``copies`` times; an op of one kind grown in place (a foreach over
    more tensors) is on the line through its two sizes; a run that lost ops does not line up."""
    from memfit.planner.shallow import _with_stretches
    vision, text, head = [_op("v1"), _op("v2")], [_op("t1")], [_op("h", 8)]
    ra = [_op("embed"), *vision, _op("merge"), *text, *head]
    rb = [_op("embed"), *vision, *vision, _op("merge"), *text, *text, _op("h", 12)]
    out = _with_stretches(ra, rb, 3)
    assert [o.kind for o in out] == ["embed", "v1", "v2"] + ["v1", "v2"] * 3 + ["merge", "t1"] + ["t1"] * 3 + ["h"]
    assert out[-1].nbytes == 8 + 3 * 4  # (8 at d, 12 at d + 1: 20 three steps on)
    assert [o.kind for o in _with_stretches(text, [_op("x"), *text, _op("y")], 2)] == ["x", "x", "t1", "y", "y"]
    assert _with_stretches(ra, ra[1:], 2) is None


class _Unequal(torch.nn.Module):
    """Two frozen stacks of small blocks (a text encoder's), then two trained stacks of larger ones (a DiT's)."""

    def __init__(self, *lengths):
        super().__init__()
        for i, n in enumerate(lengths):
            width = 2 if i < 2 else 12  # (a frozen block of two layers: NOTE [ A list of single layers ])
            stack = torch.nn.ModuleList(torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(width)))
                                        for _ in range(n))
            stack.requires_grad_(i >= 2)
            setattr(self, f"stack{i}", stack)


def test_frozen_stacks_weigh_what_their_blocks_cost_to_trace():
    """NOTE [ Stacks of unequal blocks ]: FLUX.1 with CLIP-L and T5 in the step (12, 24, 19 and 38 blocks) was cut
    to t, 2t, 7 + t and 2 + 3t (9 double blocks in the shallower trace); weighed, CLIP-L is whole in every trace
    and the DiT's stacks are cut as without encoders."""
    stacks = stacks_of(_Unequal(12, 24, 19, 38))
    assert (stacks.full, stacks.unit, stacks.offsets) == (19, (0, 1, 1, 2), (12, 5, 0, 0))
    assert stacks_of(_Stacks(12, 24, 19, 38)).full == 12  # (blocks of one cost: the fewest blocks, as before)


FLUX_TEXT = ("dit-flux:num_layers=6,num_single_layers=12,attention_head_dim=16,num_attention_heads=2,"
             "joint_attention_dim=32,pooled_projection_dim=24,axes_dims_rope=4/6/6,text_encoders=frozen,text_layers=4")
"""A FLUX.1 of 6 + 12 blocks with CLIP-L and T5 of 4 layers each, frozen in the step: cut to 4, 4, t and 2t."""


@pytest.mark.parametrize("swapped", [pytest.param(0, marks=pytest.mark.slow), 12],  # (14 s each; the swapped pair
                         ids=["resident", "singles-swapped"])                     # holds the whole stacks too)
def test_text_encoders_kept_whole_in_the_pair_give_the_full_traces_peak_and_time(swapped):
    """The encoders' stacks are whole at both depths (a constant); the DiT's grow on their line: the pair's peak,
    step time and allocations at full depth are the full trace's; with the DiT's last blocks swapped too (its
    single-stream blocks, behind the encoders' stacks: :attr:`Stacks.tail`)."""
    pytest.importorskip("diffusers")
    plan = Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="blocks", swap_blocks=swapped)
    target = Target.resolve(FLUX_TEXT, plan, 1, "rtx4090", resolution=128)
    facts = model_facts(target.workload)
    stacks = stacks_of(facts.model)
    assert (stacks.full, stacks.unit, stacks.offsets) == (6, (0, 0, 1, 2), (4, 4, 0, 0))
    assert stacks.tail == (6, 12)
    tracer = Tracer(target, facts.model, Budget.resolve(None, target.device))
    book = SimpleNamespace(depth=stacks.full, stacks=stacks, shallow_failed=None)  # (what TraceBook.depths reads)
    pair = TraceBook.depths(book, plan)
    assert pair == (2, 3)
    a, b = (tracer((plan, d, None)) for d in pair)
    full = tracer((plan, None, None))
    assert extrapolate(a.peak_bytes, b.peak_bytes, *pair, 6) == pytest.approx(full.peak_bytes, rel=1e-4)
    ops = extrapolate_ops(a.ops, b.ops, *pair, 6)
    seconds = time_from_ops(ops, target).seconds if ops is not None else \
        extrapolate(time_from_ops(a.ops, target).seconds, time_from_ops(b.ops, target).seconds, *pair, 6)
    assert seconds == pytest.approx(time_from_ops(full.ops, target).seconds, rel=0.005)
    deep = deepen(a.stream, b.stream, *pair, 6)
    assert deep is not None and replay(deep, STEADY_STEP) == (full.peak_bytes, full.used_bytes - full.context_bytes)
