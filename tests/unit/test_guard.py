"""BudgetGuard: counts what the profiler measures, raises CUDA's OOM error past the budget, frees the
failed step, and leaves host-placed tensors out."""

import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, record_function
from torch.profiler import profile as torch_profile

from memfit.memory.estimate import estimate
from memfit.memory.guard import BudgetGuard
from memfit.memory.measure import STEP_RANGE
from memfit.memory.profiler_events import profiler_peak
from memfit.plans import Plan
from memfit.quiet import QuietProfiler
from memfit.step import build_step
from memfit.training.adapt import free_failed_step
from memfit.workloads import load_workload

LM = "gpt2:n_layer=2,n_embd=64,n_head=4,n_positions=128"


def _guarded_step(plan: Plan, budget: int = 1 << 40, batch_size: int = 4):
    wl = load_workload(LM, seq_len=64)
    guard = BudgetGuard(budget)
    with guard:
        step = build_step(wl, plan, batch_size, "cpu", observer=guard)
    return guard, step, wl.batch(batch_size)


def test_guard_peak_equals_the_profilers_measured_peak():
    gc.collect()
    guard = BudgetGuard(1 << 40)
    prof = torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    wl = load_workload(LM, seq_len=64)
    with QuietProfiler(prof), guard:
        step = build_step(wl, Plan(), 4, "cpu", observer=guard)
        batch = wl.batch(4)
        step(batch)
        guard.reset_peak()
        with record_function(STEP_RANGE):
            step(batch)
    measured = profiler_peak(prof, STEP_RANGE)
    assert abs(guard.peak_bytes - measured) <= 0.01 * measured, (guard.peak_bytes, measured)


def test_guard_raises_cuda_oom_past_the_budget_and_the_failed_step_is_freed():
    guard, step, batch = _guarded_step(Plan())
    with guard:
        step(batch)
        guard.reset_peak()
        step(batch)
        peak = guard.peak_bytes
        guard.budget_bytes = peak - (1 << 20)
        failed_in = None
        try:
            step(batch)
        except torch.OutOfMemoryError as e:
            failed_in = step.phase
            assert "over the budget" in str(e)
        assert failed_in in ("forward", "backward")
        free_failed_step(step)
    held = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in step.model.parameters()}
    for state in step.optimizer.state.values():
        held.update({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in state.values()
                     if isinstance(t, torch.Tensor)})
    assert guard.live_bytes == sum(held.values())  # weights and optimizer state: nothing of the failed step


def test_a_budget_the_step_fits_in_never_raises():
    guard, step, batch = _guarded_step(Plan())
    with guard:
        step(batch)
        guard.reset_peak()
        step(batch)
        guard.budget_bytes = guard.peak_bytes
        for _ in range(2):
            step(batch)  # the same peak again: no error


@pytest.mark.parametrize("offload", [("optimizer_states",), ("activations",)])
def test_host_placed_tensors_are_not_device_memory(offload):
    """The guard's device peak falls by what the estimate says the offload saves on the device."""
    peaks = {}
    for plan in (Plan(), Plan(offload=offload)):
        guard, step, batch = _guarded_step(plan)
        with guard:
            step(batch)
            guard.reset_peak()
            step(batch)
        peaks[plan] = guard.peak_bytes
    predicted = {p: estimate(LM, p, batch_size=4, seq_len=64).peak_bytes for p in peaks}
    saved, predicted_saved = (m[Plan()] - m[Plan(offload=offload)] for m in (peaks, predicted))
    assert saved > 0
    assert abs(saved - predicted_saved) <= 0.02 * predicted_saved, (saved, predicted_saved)
