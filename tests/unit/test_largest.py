"""``max`` as a value (memfit.planner.largest, memfit.planner.sized): the search is exact on its own
terms (the value fits, the next does not) in a few traces, and on this CPU the answer of
``estimate --batch-size max`` holds against the profiler: the step at N measures within the budget,
the step at N+1 over it."""

from types import SimpleNamespace

import pytest

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate_target
from memfit.memory.measure import profile
from memfit.planner.candidate import Candidate, Status
from memfit.planner.failures import Failures
from memfit.planner.largest import GROWTH, batch_axis, find_largest, resolution_axis, seq_axis
from memfit.planner.search_max import (
    SEGMENT_SLACK,
    _fastest_of_all,
    _too_big,
    maximal_plans,
    too_big_at_larger_batches,
)
from memfit.planner.sized import Sized, largest_estimate
from memfit.planner.space import model_facts
from memfit.plans import Plan
from memfit.step import batch_bytes
from memfit.techniques.base_weights import least_weight_bytes

GPT2 = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256"
FLUX = ("dit-flux:num_layers=1,num_single_layers=2,attention_head_dim=16,num_attention_heads=2,joint_attention_dim=32,"
        "pooled_projection_dim=16,in_channels=16,axes_dims_rope=4/6/6")  # (a small FLUX.1: its blocks of both kinds)
LLAMA = ("llama:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
         "num_key_value_heads=4,vocab_size=256")


@pytest.mark.parametrize("need, budget", [
    (lambda v: 1000 + 37 * v, 5000),            # affine: the line is right at once
    (lambda v: 1000 + 37 * v + v * v // 3, 5000),  # curved: the line errs, and is redrawn
    (lambda v: 1000 + 100 * (v // 7) * 7, 4000),   # steps (an allocator's rounding)
    (lambda v: 10 + v, 10 ** 6),                 # far: the line points past GROWTH x
])
def test_the_value_found_fits_and_the_next_does_not(need, budget):
    found = find_largest(batch_axis(), need, budget)
    assert need(found.value) <= budget < need(found.value + 1)
    assert found.next_value == found.value + 1 and found.next_used_bytes == need(found.value + 1)
    assert set(found.measured) >= {found.value, found.value + 1}


def test_an_affine_need_costs_four_traces():
    found = find_largest(batch_axis(), lambda v: 10_000 + 123 * v, 50_000)
    assert (found.value, found.traces) == (325, 4)  # 1 and 2 draw the line, 325 and 326 confirm it


def test_a_resolution_steps_by_latents_and_grows_with_the_area():
    axis = resolution_axis(16)
    found = find_largest(axis, lambda px: 10 ** 6 + 10 * px * px, 5 * 10 ** 7, second=1024)
    assert found.value % 16 == 0 and found.next_value == found.value + 16
    assert 10 ** 6 + 10 * found.value ** 2 <= 5 * 10 ** 7 < 10 ** 6 + 10 * found.next_value ** 2
    assert found.traces <= 4  # the smallest, the native size, then the value and the next


def test_a_video_of_a_fixed_width_grows_with_its_height_alone():
    """A Wan clip given a width (``dit-wan:width=832``) grows only in height with ``--resolution``: its axis is
    affine in the value, so the line through two traces lands on the answer (a squared axis would not)."""
    pytest.importorskip("diffusers")
    assert Sized.of("dit-wan:width=832", "resolution").axis.squared is False
    assert Sized.of("dit-wan", "resolution").axis.squared is True
    assert Sized.of("dit-flux:width=1216", "resolution").axis.squared is False  # (an image too: NOTE [ A resolution's width ])
    assert Sized.of("dit-flux", "batch_size", resolution=(1216, 832)).workload_at(1).name == "dit-flux 1216x832px"
    found = find_largest(resolution_axis(16, squared=False), lambda px: 10 ** 6 + 9000 * px, 5 * 10 ** 7, second=480)
    assert 10 ** 6 + 9000 * found.value <= 5 * 10 ** 7 < 10 ** 6 + 9000 * found.next_value and found.traces <= 4
    assert found.describe().startswith("largest height that fits")


def test_a_value_the_model_cannot_take_bounds_the_search():
    def need(seq):
        if seq > 1024:
            raise UserError("gpt2: --seq-len exceeds the model's n_positions=1024")
        return seq
    found = find_largest(seq_axis(), need, 10 ** 9)
    assert (found.value, found.next_value, found.next_used_bytes) == (1024, 1088, None)
    assert "n_positions" in found.next_error and "beyond the model" in found.describe()


def test_nothing_fits_says_what_the_smallest_needs():
    found = find_largest(batch_axis(), lambda v: 1000 * v + 500, 400)
    assert found.value is None and found.next_value == 1 and found.next_used_bytes == 1500
    assert "not even batch size 1" in found.describe()


def test_growth_is_bounded_per_trace():
    values = []

    def need(v):
        values.append(v)
        return v
    find_largest(batch_axis(), need, 10 ** 6)
    assert all(b <= max(a * GROWTH, a + 1) for a, b in zip(values, values[1:]) if b > a)


def test_a_split_batch_cannot_be_max():
    sized = Sized.of(GPT2, "batch_size", seq_len=16)
    with pytest.raises(UserError, match="holds at once"):
        largest_estimate(sized, Plan(micro_batch_size=2), "cpu", Budget.resolve("1GiB", sized.target(1, None, "cpu").device))


def test_resolution_max_needs_an_image_model():
    with pytest.raises(UserError, match="image- and video-generation built-ins"):
        Sized.of(GPT2, "resolution")


@pytest.mark.parametrize("workload, plan, sizes", [
    (GPT2, Plan(), {"seq_len": 32}),
    (LLAMA, Plan(adapter="lora:r=4"), {"seq_len": 32}),
    (FLUX, Plan(adapter="lora:r=4", checkpointing="blocks"), {"resolution": 64}),
], ids=["gpt2", "peft-lora-llama", "flux-lora"])
def test_batch_max_is_exact_against_the_profiler(workload, plan, sizes):
    """The budget lies between the profiler's peaks at batch 5 and 6 (measured here, not predicted):
    ``max`` must answer 5, and the profiler's own peaks at its N and N+1 straddle the budget."""
    measured = {b: profile(workload, plan, batch_size=b, repeats=0, **sizes).peak_bytes for b in (5, 6)}
    assert measured[5] < measured[6]
    budget_bytes = (measured[5] + measured[6]) // 2
    sized = Sized.of(workload, "batch_size", **sizes)
    budget = Budget(budget_bytes, sized.target(1, None, "cpu").device)
    found, report = largest_estimate(sized, plan, "cpu", budget)
    assert found.value == 5 and report.batch_size == 5
    assert found.traces <= 6
    assert measured[found.value] <= budget_bytes < measured[found.value + 1]


def test_max_searches_swapped_blocks_where_the_weights_fill_the_budget():
    """The maximal plans ``max`` draws its largest value from include every block swapped where the weights
    take most of the budget, as the planner's own search does (memfit.techniques.swap_blocks.search). Before,
    they never swapped: a LoRA of Llama-2-7B on a 12 GB card (``memfit plan llama --adapter lora:r=16 --device
    rtx4070 -b max --seq-len 2048``) was "nothing fits: not even batch size 1", which ``memfit fit`` and
    ``memfit plan -b 1`` fit with blocks swapped."""
    sized = Sized.of(LLAMA, "batch_size", seq_len=16)
    model = model_facts(sized.target(1, None, "rtx4090").workload).model
    weights = least_weight_bytes(model.parameters(), model, "as-is")
    fixed = {"adapter": "lora:r=4"}
    tops = maximal_plans(sized, get_device("rtx4090"), fixed, budget_bytes=weights)  # (the weights fill it)
    assert {p.swap_blocks for p in tops} == {2}  # (both blocks: swapping more saves more)
    assert {p.swap_blocks for p in maximal_plans(sized, get_device("rtx4090"), fixed, budget_bytes=100 * weights)} == {0}


def test_plans_too_big_at_the_smallest_value_do_not_keep_the_halving_going():
    """NOTE [ Plans too big at the smallest value ]: a faster plan that was too big keeps ``max`` halving its
    value, unless it was too big at the smallest value too (then at every value), split into micro-batches
    or not. Before, on a card that holds a 7B LoRA only with blocks swapped, every unswapped plan kept it
    halving down to batch 1 (19 minutes and more)."""
    swapped, plain = Plan(adapter="lora:r=4", swap_blocks=2), Plan(adapter="lora:r=4")
    chosen = Candidate(swapped, 2.0, status=Status.CHOSEN)
    at_value = SimpleNamespace(chosen=chosen, candidates=[chosen, Candidate(plain.replace(micro_batch_size=2), 1.0,
                                                                            status=Status.TOO_BIG)])
    at_smallest = SimpleNamespace(chosen=chosen, candidates=[chosen, Candidate(plain, 0.5, status=Status.TOO_BIG)])
    assert not _fastest_of_all(at_value)  # (the faster plan may fit at a smaller value: halve)
    assert _fastest_of_all(at_value, _too_big(at_smallest))  # (it does not fit at the smallest: stop)


def test_a_split_plan_needs_at_a_smaller_batch_what_it_needs_at_a_larger_one_less_the_inputs():
    """NOTE [ Plans too big at a larger batch ]: the claim ``max``'s searches rest on, traced. With the same
    micro-batches, batch 8 needs at most batch 4's bytes plus batch 8's inputs and one segment, and no less."""
    split = Plan(adapter="lora:r=4", micro_batch_size=2)
    budget = Budget.resolve(None, get_device("rtx4090"))
    sized = Sized.of(LLAMA, "batch_size", seq_len=64)
    used = {b: budget.used_bytes(estimate_target(sized.target(b, split, "rtx4090"))) for b in (4, 8)}
    assert used[4] <= used[8] <= used[4] + batch_bytes(sized.target(8, None, "rtx4090")) + SEGMENT_SLACK


def test_split_plans_too_big_at_a_larger_batch_fail_untraced_at_a_smaller_one():
    """A split plan over the budget at batch 16 by more than its inputs and a segment is taken as too big at
    batch 8 with the same micro-batches (not where the micro-batch is the whole batch, nor within the slack),
    and the walk rejects it untraced and prunes the plans that save no more than it."""
    budget = 10 * 2**30
    sized = Sized.of(LLAMA, "batch_size", seq_len=64)
    base = Plan(adapter="lora:r=4", checkpointing="blocks")
    over = budget + SEGMENT_SLACK + 2**20

    def c(plan, used):
        return Candidate(plan, 1.0, status=Status.TOO_BIG, used_bytes=used)
    at16 = SimpleNamespace(budget_bytes=budget, candidates=[
        c(base.replace(micro_batch_size=4), over),       # carried
        c(base.replace(micro_batch_size=2), budget + 2**20),  # within the slack: traced again
        c(base.replace(micro_batch_size=8), over),       # the whole batch at 8: traced again
        c(base, over)])                                  # not split
    known = too_big_at_larger_batches(sized, [(16, at16)], 8, get_device("rtx4090"))
    assert list(known) == [base.replace(micro_batch_size=4)]
    need, why = known[base.replace(micro_batch_size=4)]
    assert budget < need < over and "batch 16" in why
    assert too_big_at_larger_batches(sized, [(16, at16)], 16, get_device("rtx4090")) == {}  # (not a larger batch)

    failed = Failures(8, budget)
    ranked = [Candidate(p, 1.0) for p in (base.replace(micro_batch_size=4), base.replace(micro_batch_size=2), base)]
    failed.known(ranked, known)
    assert [x.status for x in ranked] == [Status.TOO_BIG, Status.NOT_EVALUATED, Status.NOT_EVALUATED]
    assert failed.rule_out(ranked[2]) and failed.rule_out(ranked[1]) is None  # (batch 8 whole saves no more than 4s)


def test_max_searches_the_smallest_value_first_and_then_only_for_what_beats_it(monkeypatch):
    """NOTE [ The smallest value first ]: the search at the smallest value has no bound; each later one is
    told the step time it must beat (its samples over the best throughput found before), and a search
    that finds nothing faster leaves the halving going."""
    from memfit.planner import search_max
    from memfit.planner.largest import Largest
    sized = Sized.of(LLAMA, "batch_size", seq_len=64)
    largest = Largest(batch_axis(), 1 << 30, 8, 1 << 29, 9, 1 << 31)
    monkeypatch.setattr(search_max, "maximal_plans", lambda *a, **k: [])
    own = iter([(largest, Plan()), SimpleNamespace(value=None)])  # (the largest under any plan; the best's own)
    monkeypatch.setattr(search_max, "in_own_process", lambda f: next(own))
    seconds = {1: 1.0, 8: None, 4: 3.0, 2: 3.0}  # (batch 1: 64 tokens/s; at 8 nothing beats 8 s; 4 beats it)
    asked = []

    def search(workload, batch_size, slower_than=None, **kwargs):
        asked.append((batch_size, slower_than))
        s = seconds[batch_size]
        chosen = None if s is None else Candidate(Plan(), s, status=Status.CHOSEN)
        return SimpleNamespace(chosen=chosen, candidates=[chosen] if chosen else [], limited=False,
                               slower_than=slower_than, batch_size=batch_size)
    out = search_max.plan_largest(sized, budget="1GiB", device="rtx4090", fixed={}, search=search)
    assert asked == [(1, None), (8, 8.0), (4, 4.0)]  # (4's plan is the fastest of all: no need for 2)
    assert out.best_value == 4 and out.throughput == pytest.approx(4 * 64 / 3.0)


def test_a_search_with_a_time_to_beat_walks_only_the_plans_estimated_faster():
    """``slower_than``: plans estimated no faster are not traced, and where none faster fits, nothing is
    chosen (not a negative answer: no error, no search of the optimizer choices again)."""
    from memfit.planner.search import plan
    free = plan(LLAMA, device="rtx4090", batch_size=2, seq_len=64, max_traces=6, fixed={"adapter": "lora:r=4"})
    fastest = min(c.seconds for c in free.candidates)
    capped = plan(LLAMA, device="rtx4090", batch_size=2, seq_len=64, max_traces=6, fixed={"adapter": "lora:r=4"},
                  slower_than=fastest)
    assert capped.chosen is None and capped.slower_than == fastest
    assert all(c.status is Status.SLOWER and "not traced" in c.reason for c in capped.candidates)
    half = plan(LLAMA, device="rtx4090", batch_size=2, seq_len=64, max_traces=6, fixed={"adapter": "lora:r=4"},
                slower_than=free.chosen.seconds * 1.001)
    assert half.chosen is not None and half.chosen.plan == free.chosen.plan


def test_plan_max_prints_its_searches_and_says_how_to_write_the_plan(monkeypatch, capsys):
    """The text answer: the fastest value and plan, the searches by value, and how to keep the plan (with
    the value to train at); the plan's every field is not dumped (plan's own table does not either)."""
    from memfit.cli.main import main
    from memfit.planner import search_max
    from memfit.planner.largest import Largest
    sized = Sized.of(LLAMA, "batch_size", seq_len=64)
    chosen = Candidate(Plan(checkpointing="blocks"), 2.0, used_bytes=1 << 29, status=Status.CHOSEN)
    best = SimpleNamespace(chosen=chosen, candidates=[chosen], limited=False, slower_than=None, batch_size=4)
    out = search_max.LargestPlan(sized, 1 << 30, Largest(batch_axis(), 1 << 30, 8, 1 << 29, 9, 1 << 31), Plan(),
                                 best=best, best_value=4, throughput=128.0, unit="tokens/s", searched=[(4, best)])
    monkeypatch.setattr(search_max, "plan_largest", lambda *a, **k: out)
    assert main(["plan", LLAMA, "--seq-len", "64", "-b", "max", "--device", "rtx4090"]) == 0
    text = capsys.readouterr().out
    assert "fastest: batch size 4 with fp32 ckpt=blocks" in text and "bf16_update" not in text
    assert text.rstrip().endswith("--out plan.yaml writes the fastest plan; train with it at --batch-size 4 (memfit "
                                  "train ... --plan plan.yaml)")
