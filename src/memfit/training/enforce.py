"""Enforcing the budget while training: on a CPU with memfit's BudgetGuard (it raises an OOM past
the budget), on a GPU with the caching allocator's own per-process limit; and reading the peak of
a step from the best source the run has."""

from __future__ import annotations

import resource

import torch

from memfit.devices import Device
from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.guard import BudgetGuard
from memfit.step import TrainStep
from memfit.units import fmt_bytes


def enforce(budget: Budget | None) -> BudgetGuard | None:
    """Enforce the budget: on a CPU with the BudgetGuard, on a GPU with the caching allocator's own
    per-process limit (it raises torch.OutOfMemoryError past it)."""
    if budget is None:
        return None
    if budget.device.is_gpu:
        limit_cuda_allocator(budget.bytes)
        return None
    return BudgetGuard(budget.bytes)


def limit_cuda_allocator(budget_bytes: int) -> float:
    """Cap what PyTorch's CUDA allocator may reserve at ``budget_bytes``; returns the fraction set."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = min(1.0, budget_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def arm(guard: BudgetGuard, step: TrainStep) -> None:
    """Count what the step holds (also what a checkpoint restored), refuse a budget it already
    exceeds, and start enforcing."""
    guard.watch([list(step.model.parameters()), list(step.model.buffers()), step.optimizer.state_dict()])
    if guard.live_bytes > guard.budget_bytes:
        raise UserError(f"the budget {fmt_bytes(guard.budget_bytes)} is below what the model and optimizer hold "
                        f"before the first step ({fmt_bytes(guard.live_bytes)}); give a larger budget, or let "
                        "memfit choose a plan (memfit plan WORKLOAD --budget ...)")
    guard.reset_peak()
    guard.armed = True


def step_peak(measured: int | None, guard: BudgetGuard | None, dev: Device) -> tuple[int, str]:
    if measured is not None:
        return measured, "allocator (profiler)" if dev.kind == "cpu" else "allocator (cuda)"
    if guard is not None:
        return guard.peak_bytes, "device (budget guard)"
    if dev.kind == "cuda":
        return torch.cuda.max_memory_allocated(), "allocator (cuda, run peak)"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS"
