"""Blocks of several kinds: NOTE [ Blocks of several kinds ] in memfit.planner.stacks. A shallow pair adds
blocks of the kinds of those it stands for, so its figures at full depth are the full trace's."""

import pytest
import torch

from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.deep_stream import deepen, replay
from memfit.planner.shallow import depths, extrapolate, extrapolate_ops
from memfit.planner.space import model_facts
from memfit.planner.stacks import Stacks, block_kinds, cut_by_kinds, stacks_of
from memfit.planner.timing import time_from_ops
from memfit.planner.trace_job import Tracer
from memfit.planner.traces import TraceBook
from memfit.plans import Plan
from memfit.target import Target


class Block(torch.nn.Module):
    def __init__(self, index: int, wide: bool, drop: float):
        super().__init__()
        self.layer_idx, self.drop_rate = index, drop  # (an index, a rate growing with depth: neither a kind)
        self.sliding = not wide
        self.proj = torch.nn.Linear(8, 16 if wide else 8)
        self.norm = torch.nn.LayerNorm(8)  # (a block of two layers: NOTE [ A list of single layers ])


def test_a_kind_is_what_builds_a_block_and_not_its_index():
    blocks = [Block(i, wide=False, drop=0.1 * i) for i in range(6)]
    assert block_kinds(blocks) == (0,) * 6
    blocks[5].sliding = False  # (a plain value: Gemma 3's global layer)
    assert block_kinds(blocks) == (0, 0, 0, 0, 0, 1)
    blocks[2] = Block(2, wide=True, drop=0.2)  # (another shape: a third kind, not sliding either)
    assert block_kinds(blocks) == (0, 0, 1, 0, 0, 2)


@pytest.mark.parametrize(("lengths", "kinds", "cut"), [
    ((34,), [tuple(int(i % 6 == 5) for i in range(34))], ((6,), 5, 1)),   # Gemma-3-4B's text: 4 + 6t
    ((61,), [(0, 0, 0) + (1,) * 58], ((1,), 59, 1)),                      # DeepSeek-V3: 2 + t, its third dense layer in both
    ((48,), [tuple(i % 2 + 2 * (i % 4 == 3) for i in range(48))], ((4,), 12, 1)),  # Llama 4 Maverick: 3 kinds, 4t
    ((12,), [tuple(int(i % 4 == 3) for i in range(12))], None),           # no cut traces fewer than 12 blocks
    ((27, 34), [(0,) * 27, tuple(int(i % 6 == 5) for i in range(34))], ((5, 6), 5, 1)),  # Gemma-3-4B: 2 + 5t, 4 + 6t
])
def test_stacks_are_cut_in_units_that_repeat_their_kinds(lengths, kinds, cut):
    assert cut_by_kinds(lengths, kinds) == cut
    if cut:
        stacks = Stacks(lengths, cut[0], cut[1], cut[2], 2)
        assert stacks.at(stacks.full) == lengths and all(n >= 2 for n in stacks.at(stacks.least))


def _llama4(folder, layers: int = 16):
    """A tiny Llama 4 text model: experts every other layer, no rope every fourth (three kinds of layer)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "llama4_text", hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, num_hidden_layers=layers, num_local_experts=4,
        interleave_moe_layer_step=2)
    config.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("plan", [Plan(precision="bf16"),
                                  Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="blocks")],
                         ids=["bf16", "lora-blocks"])
def test_a_pair_of_units_of_three_kinds_gives_the_full_trace(tmp_path, plan):
    """Llama 4's pair at 2 and 3 layers added a dense layer for its experts: its peak was 34% low. Cut in units
    of 4 layers, its pair's peak, step time and allocations at full depth are the full trace's."""
    target = Target.resolve(_llama4(tmp_path), plan, 2, "rtx4090", seq_len=128)
    facts = model_facts(target.workload)
    stacks = stacks_of(facts.model)
    assert (stacks.unit, stacks.full, stacks.kinds) == ((4,), 4, 3)
    assert stacks.describe() == "16 blocks of 3 kinds (cut to 4t)"
    pair = depths(plan, stacks.full, stacks.least)
    assert pair == (1, 2)
    tracer = Tracer(target, facts.model, Budget.resolve(None, target.device))
    a, b, full = (tracer((plan, d, None)) for d in (*pair, None))
    assert extrapolate(a.peak_bytes, b.peak_bytes, *pair, stacks.full) == pytest.approx(full.peak_bytes, rel=1e-3)
    ops = extrapolate_ops(a.ops, b.ops, *pair, stacks.full)
    assert ops is not None
    assert time_from_ops(ops, target).seconds == pytest.approx(time_from_ops(full.ops, target).seconds, rel=1e-6)
    deep = deepen(a.stream, b.stream, *pair, stacks.full)
    assert replay(deep, STEADY_STEP) == (full.peak_bytes, full.used_bytes - full.context_bytes)


def test_a_model_whose_kinds_no_cut_repeats_is_traced_whole(tmp_path):
    """12 layers in periods of 4: a pair of 1 and 2 units traces as many layers as the model has."""
    target = Target.resolve(_llama4(tmp_path, layers=12), Plan(), 2, "rtx4090", seq_len=128)
    stacks = stacks_of(model_facts(target.workload).model)
    assert stacks.full == 1 and stacks.at(1) == (12,) and depths(Plan(), stacks.full, stacks.least) is None
    assert stacks.describe() == "12 blocks of 3 kinds (traced whole)"


def test_a_pair_of_one_unit_takes_its_peak_from_the_allocations_replayed_at_full_depth(tmp_path):
    """A tiny Nemotron-H (Mamba, experts, attention and MLP layers in turn) with a LoRA and blocks checkpointed
    peaks in another phase at one unit than at two or more (224, 327, 332 and 338 MB at 1 to 4 units): the line
    through the pair at 1 and 2 units was 57% high. The book takes the peak of the pair's allocations replayed at
    full depth, the full trace's."""
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.for_model(
        "nemotron_h", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=512, num_hidden_layers=16, mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
        chunk_size=128, n_routed_experts=8, moe_intermediate_size=32, moe_shared_expert_intermediate_size=7688,
        num_experts_per_tok=2, n_group=1, topk_group=1,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"] * 4).save_pretrained(tmp_path)
    plan = Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="blocks")
    target = Target.resolve(str(tmp_path), plan, 2, "rtx4090", seq_len=128)
    facts = model_facts(target.workload)
    book = TraceBook(target, facts, Budget.of_device(target.device))
    try:
        assert book.depths(plan) == (1, 2)
        m = book.measure(plan)
        a, b = (book._traced[(plan, d, None)] for d in (1, 2))
        full = book.confirm(plan)  # (its full trace)
    finally:
        book.close()
    assert extrapolate(a.peak_bytes, b.peak_bytes, 1, 2, 4) > 1.5 * full.peak_bytes  # (the line)
    assert m.peak_bytes == full.peak_bytes


def test_a_cut_keeps_two_blocks_of_each_class_of_a_stack_of_several():
    """Jamba-1.5-Large's 72 layers, an attention layer every eighth (offset 4), experts every other: a unit of 8
    holds one attention layer, not a stack of two classes (find_blocks), so the pair is at 2 and 3 units."""
    kinds = tuple(2 * (i % 8 == 4) + i % 2 for i in range(72))
    attention = [i for i in range(72) if i % 8 == 4]

    def holds(i, n):
        return sum(a < n for a in attention) >= 2 and n - sum(a < n for a in attention) >= 2
    assert cut_by_kinds((72,), [kinds]) == ((8,), 9, 1)
    assert cut_by_kinds((72,), [kinds], holds) == ((8,), 9, 2)


def test_a_last_block_of_its_own_kind_keeps_the_plain_cut():
    """SD3's last block outputs no text stream (``context_pre_only``): no prefix of its blocks holds it, so its
    stack keeps the plain cut (pairs of 2 and 3 blocks) rather than being traced whole for every plan."""
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block(i, wide=i == 23, drop=0.0) for i in range(24)])
    stacks = stacks_of(model)
    assert (stacks.unit, stacks.full, stacks.least, stacks.kinds) == ((1,), 24, 2, 0)
    model.blocks[11] = Block(11, wide=True, drop=0.0)  # (another one in the middle: no plain cut)
    assert stacks_of(model).kinds == 2


@pytest.mark.slow  # (13 s: the suite under 10 minutes; the swapped pair's figures stay in test_shallow_unrelated_stacks' singles-swapped)
def test_a_share_of_blocks_swapped_in_whole_units_keeps_its_pair_and_its_figures_are_the_full_traces(tmp_path):
    """NOTE [ Blocks of several kinds, some swapped ]: a tiny Gemma 2 (sliding and global layers in turn, 24
    layers, 12 units of 2). 8 swapped layers are 4 units, and 2 and 4 at the pair's 3 and 6 units: its pair's
    allocations at full depth and step time are the full trace's (before, every such plan was traced whole).
    6 swapped are 2 at 4 units but 3, a sliding layer more than global ones, at 6: traced at full depth."""
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.for_model(
        "gemma2", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=512, num_hidden_layers=24, sliding_window=32).save_pretrained(tmp_path)
    plan = Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="blocks", swap_blocks=8)
    target = Target.resolve(str(tmp_path), plan, 2, "rtx4090", seq_len=64)
    facts = model_facts(target.workload)
    book = TraceBook(target, facts, Budget.of_device(target.device))
    try:
        assert (book.stacks.unit, book.stacks.full, book.stacks.kinds) == ((2,), 12, 2)
        assert book.depths(plan) == (3, 6) and book.depths(plan.replace(swap_blocks=6)) == ()
        a, b = book._run([(plan, d, None) for d in (3, 6)])
        (full,) = book._run([(plan, None, None)])
    finally:
        book.close()
    assert replay(deepen(a.stream, b.stream, 3, 6, 12), STEADY_STEP) == (full.peak_bytes, full.used_bytes - full.context_bytes)
    line = extrapolate(*(time_from_ops(t.ops, target).seconds for t in (a, b)), 3, 6, 12)
    assert line == pytest.approx(time_from_ops(full.ops, target).seconds, rel=1e-3)
