"""``ema: {device: auto}`` (the default): the planner keeps the shadow on the device when that fits
the budget and is faster, and puts it on the host when only that fits; without a planner it is
the device."""

import pytest

from memfit.memory.budget import Budget
from memfit.planner.search import plan
from memfit.planner.space import SearchSpace
from memfit.planner.timing import trace_step
from memfit.plans import Plan
from memfit.target import Target
from memfit.techniques.ema import EMA

MODEL = "gpt2:n_layer=2,n_embd=768,n_head=4,vocab_size=2000,n_positions=64"
DEVICE = "h100-80gb"


def _used(target):
    """What the budget counts (with the default segments or expandable ones, whichever is less: the
    planner takes expandable segments where they decide the fit), and the step time."""
    report, st, _ = trace_step(target)
    budget = Budget.resolve(None, target.device)
    expanded = budget.expandable_allocator_bytes(report)
    return min(budget.used_bytes(report), expanded if expanded is not None else 1 << 62), st.seconds


def test_the_planner_places_the_average_where_it_fits_fastest():
    target = Target.resolve(MODEL, Plan(precision="bf16"), 4, DEVICE, seq_len=64)
    on_device = _used(target.with_plan(Plan(precision="bf16", ema=EMA(decay=0.99, device="device"))))
    on_host = _used(target.with_plan(Plan(precision="bf16", ema=EMA(decay=0.99, device="cpu"))))
    assert on_host[0] < on_device[0] and on_device[1] < on_host[1]  # the host saves memory, the device time
    space = SearchSpace(values={"precision": ["bf16"]}, micro_batches=[4])
    fixed = {"ema": {"decay": 0.99}}  # device: auto
    loose = plan(MODEL, budget=on_device[0] + (1 << 20), device=DEVICE, batch_size=4, seq_len=64,
                 space=SearchSpace(values=dict(space.values), micro_batches=[4]), fixed=dict(fixed))
    tight = plan(MODEL, budget=(on_device[0] + on_host[0]) // 2, device=DEVICE, batch_size=4, seq_len=64,
                 space=SearchSpace(values=dict(space.values), micro_batches=[4]), fixed=dict(fixed))
    assert loose.chosen.plan.ema == EMA(decay=0.99, device="device")
    assert tight.chosen.plan.ema == EMA(decay=0.99, device="cpu")


def test_without_a_planner_auto_is_the_device():
    assert EMA().device == "auto" and EMA().placed == "device"
    assert EMA(device="cpu").placed == "cpu"
    with pytest.raises(Exception, match="device auto, cpu or device"):
        EMA(device="gpu")
