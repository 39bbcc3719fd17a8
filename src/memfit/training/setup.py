"""What a training run is checked and set up with before its loop starts: the device, the text,
the plan (given, or the planner's for the budget), the --out folder, and the one line that ends a
run out of adaptations."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from memfit.devices import Device, get_device
from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate_target
from memfit.planner.search import plan as make_plan
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target
from memfit.techniques.sharding import on_ranks
from memfit.training.adapt import OutOfAdaptations
from memfit.training.data import ByteCorpus
from memfit.units import fmt_bytes
from memfit.workload import Workload


def training_device(name: str) -> Device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r}: training runs on this machine; choose auto, cpu or cuda "
                        "(GPU presets are for estimate and plan)")
    return get_device(name)


def corpus(wl: Workload, data: str | None):
    """The text a language model trains on (``--data``, or Python's own sources); None for others."""
    info = wl.info
    if info.text_lm and (info.vocab_size or 256) < 256:  # the corpus's token ids are bytes
        raise UserError(f"{wl.name}: vocab_size={info.vocab_size} is below 256, and training text is "
                        f"tokenized as bytes (ids 0-255); override {wl.name}:vocab_size=256 or more")
    if data is not None and not info.text_lm:
        raise UserError(f"--data applies to the built-in language models (gpt2, llama); {wl.name} makes its own "
                        "batches")
    return ByteCorpus(data) if info.text_lm else None


def choose_plan(target: Target, plan: Plan | str | None, budget: str | int | None,
                 world_size: int = 1) -> tuple[Target, Budget | None]:
    """The plan to train with (given, or the planner's for the budget, per rank at ``world_size``
    ranks) and the budget enforced."""
    if isinstance(plan, str):
        plan = Plan.load(plan)
    budget_obj = Budget.resolve(budget, target.device) if budget is not None else None
    if plan is None and budget is not None:
        found = make_plan(target.workload, budget=budget, batch_size=target.batch_size, device=target.device,
                          fixed={"world_size": world_size} if world_size > 1 else None)
        if found.chosen is None:
            smallest = found.smallest
            hint = (f"; the smallest footprint found is {fmt_bytes(smallest.used_bytes)} with "
                    f"{smallest.plan.describe()}: give a budget of at least that, or a smaller --batch-size"
                    if smallest is not None else "; give a larger budget or a smaller --batch-size")
            raise UserError(f"no plan fits the budget of {fmt_bytes(budget_obj.bytes)}{hint}")
        plan = found.chosen.plan
    plan = on_ranks(plan or Plan(), world_size)
    return target.with_plan(plan), budget_obj  # (with_plan refuses a batch the ranks cannot split)


def predicted_peak(target: Target) -> int:
    """What the run's measurement sees: on a CPU the whole process heap, on a GPU allocated bytes."""
    with silenced_warnings():
        return estimate_target(target).measurable_peak_bytes


def out_of_adaptations(e: OutOfAdaptations, target: Target, budget: Budget | None) -> UserError:
    """The run cannot go on: say what the most frugal plan it reached needs, and what to do."""
    with silenced_warnings():
        need = estimate_target(target.with_plan(e.plan)).peak_bytes
    limit = f"the budget of {fmt_bytes(budget.bytes)}" if budget else f"the {target.device.name}'s memory"
    return UserError(f"out of memory with every adaptation applied ({e.plan.describe()}): the step needs "
                     f"{fmt_bytes(need)} (predicted) and {limit} is smaller; give at least that, a smaller "
                     "--batch-size, or let the planner search every technique (memfit plan WORKLOAD --budget ...)")


def out_dir(out: str | Path) -> Path:
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".memfit-write-test-{os.getpid()}"  # (the ranks of a run check the same folder at once)
        probe.write_text("")
        probe.unlink(missing_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to --out {str(path)!r} ({e.strerror}); choose a writable folder") from None
    return path
