"""A 7B full fine-tune with AdamW on a 24 GB card (issue: 7B full fine-tune on 24 GB).

Llama-2-7B, batch 1 x 2048 tokens, on the rtx4090 preset: bf16 weights, block checkpointing, AdamW
stepped in backward with its states on the host, chunked loss. The prediction must fit the card's
default budget; it did not while bf16-pure built the model in fp32 first (25.99 GiB: the
allocator kept the fp32 model's 25 GiB reserved after the cast)."""

import pytest

from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate_target
from memfit.plans import Plan
from memfit.target import Target

GiB = 2**30
PLAN = Plan(precision="bf16-pure", checkpointing="blocks", optimizer="adamw", optimizer_in_backward=True,
            offload=["optimizer_states"], loss_chunks=8)


def test_llama_7b_with_adamw_fits_a_24_gb_card():
    target = Target.resolve("llama", PLAN, 1, "rtx4090", seq_len=2048)
    report = estimate_target(target)
    budget = Budget.resolve(None, target.device)
    used = budget.used_bytes(report)
    assert used <= budget.bytes, f"{used / GiB:.2f} GiB > {budget.bytes / GiB:.2f} GiB"
    # bf16 weights (6.74e9 x 2 bytes = 12.55 GiB) are most of it; no fp32 copy stays reserved
    assert report.breakdown["parameters"] > 12.5 * GiB and report.reserved_bytes < 1.05 * report.peak_bytes


@pytest.mark.slow
def test_the_planner_finds_an_adamw_plan_for_7b_on_24_gb():
    from memfit.planner.search import plan
    result = plan("llama", device="rtx4090", batch_size=1, seq_len=2048)
    assert result.chosen is not None
    chosen = result.chosen.plan
    assert chosen.optimizer in ("adamw", "adamw8bit", "adamw8bit-ao", "adamw4bit-ao", "adamwfp8-ao", "adamw8bit-paged",
                                "adamw-paged") \
        and chosen.precision == "bf16-pure"
    # NOTE [ Low-bit states on the host ]: never a compiled low-bit update on the host
    assert not (chosen.config("optimizer").slow_host_update and chosen.config("offload").states == "optimizer_states")


def test_low_bit_states_that_cannot_fit_beside_the_weights_are_not_timed():
    """NOTE [ States that cannot fit ]: Llama-2-7B's bf16 weights (12.55 GiB) and 8-bit or fp8 states
    (12.55 GiB at least) exceed a 24 GB card's budget in every plan, so neither is timed (their
    compiles cost tens of seconds cold); 4-bit states (6.28 GiB) may fit and stay; at 16 GB none. Nor
    where the weights and 4-bit states fit but not with the largest gradient (the embedding's, made in
    backward beside them: Qwen2.5-7B on a 24 GB card)."""
    from memfit.devices import get_device
    from memfit.planner.space import default_space, leave_out_states_that_cannot_fit, model_facts
    from memfit.techniques.optimizers import ADAMW_CLASS
    from memfit.workloads import load_workload
    facts, device = model_facts(load_workload("llama", seq_len=2048)), get_device("rtx4090")
    sizes = [p.numel() for p in facts.model.parameters()]
    four_bit = 2 * facts.n_params + sum(sizes)  # (16-bit weights and 4-bit states: a byte a parameter, at least)
    for budget, left in ((Budget.resolve(None, device).bytes, {"adamw8bit-ao", "adamwfp8-ao"}),
                         (14 * GiB, {"adamw8bit-ao", "adamwfp8-ao", "adamw4bit-ao"}),
                         (four_bit + max(sizes), {"adamw8bit-ao", "adamwfp8-ao", "adamw4bit-ao"}),
                         (four_bit + 2 * max(sizes), {"adamw8bit-ao", "adamwfp8-ao"})):
        space = default_space(facts, device, 1, optimizers=ADAMW_CLASS)  # (the default leaves out two: named here)
        before = set(space.values["optimizer"])
        leave_out_states_that_cannot_fit(space, facts, budget, device)
        assert before - set(space.values["optimizer"]) == left
        assert {"adamw", "adamw8bit"} <= set(space.values["optimizer"])
        assert sum("exceed the budget" in n for n in space.notes) == len(left)


@pytest.mark.slow  # (about 40 s: keeps the default suite under 10 minutes)
def test_the_negative_answer_for_16_gb_is_decided_by_the_maximal_plans_full_traces():
    """NOTE [ A borderline answer decided by the maximal plans' full traces ]: at 14 GiB the lower
    bound of the smallest plan fits (13.88 GiB allocated) and its full trace does not (14.55 GiB):
    the walk used to trace 93 plans to say so. The footprint named is the smallest confirmed (14.20 GiB,
    paged 8-bit states and activations on the host), not that of the plan with the smallest bound."""
    from memfit.planner.search import plan
    result = plan("llama", device="rtx4090", batch_size=1, seq_len=2048, budget="14GiB")
    assert result.chosen is None and result.smallest is not None
    assert 14.1 * GiB < result.smallest.used_bytes < 14.3 * GiB
    assert result.traces <= 60, result.traces
