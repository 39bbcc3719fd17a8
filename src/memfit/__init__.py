"""memfit: make PyTorch training fit a memory budget.

Predict the peak memory of a training step without the target GPU (``estimate``), measure it
(``profile``), on the one TrainStep that training uses (``build_step``); find the fastest plan for
a budget (``plan``) and train with it, adapting when memory runs short (``train``). Importing memfit is
cheap: it does not import transformers and never initialises CUDA; submodules load on use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["apply", "Plan", "plan", "train", "TrainResult", "Workload", "load_workload", "build_step", "TrainStep", "Target",
           "estimate", "profile", "MemoryReport", "Budget", "UserError", "get_device", "__version__"]

_LAZY = {
    "apply": "memfit.integrations.apply",
    "Plan": "memfit.plans",
    "plan": "memfit.planner.search",
    "train": "memfit.training.loop",
    "TrainResult": "memfit.training.loop",
    "Workload": "memfit.workload",
    "load_workload": "memfit.workloads",
    "Target": "memfit.target",
    "Budget": "memfit.memory.budget",
    "build_step": "memfit.step",
    "TrainStep": "memfit.step",
    "estimate": "memfit.memory.estimate",
    "profile": "memfit.memory.measure",
    "MemoryReport": "memfit.memory.report",
    "UserError": "memfit.errors",
    "get_device": "memfit.devices",
}

if TYPE_CHECKING:  # pragma: no cover
    from memfit.devices import get_device
    from memfit.errors import UserError
    from memfit.integrations.apply import apply
    from memfit.memory.budget import Budget
    from memfit.memory.estimate import estimate
    from memfit.memory.measure import profile
    from memfit.memory.report import MemoryReport
    from memfit.planner.search import plan
    from memfit.plans import Plan
    from memfit.step import TrainStep, build_step
    from memfit.target import Target
    from memfit.training.loop import TrainResult, train
    from memfit.workload import Workload
    from memfit.workloads import load_workload


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'memfit' has no attribute {name!r}")
