"""Workload: *what* to train.

A workload is four functions, so that memfit controls where tensors are created (on fake tensors
for prediction, on real ones for measurement and training):

- ``model()`` builds the ``nn.Module``; memfit calls it under its device and fake-tensor context.
- ``batch(batch_size)`` builds one batch: a tensor, or a tuple/list/dict of tensors whose first
  dimension is the batch (micro-batching splits along it).
- ``loss(model, batch)`` returns a scalar tensor.
- ``optimizer(params)`` builds the optimizer; default ``torch.optim.AdamW(params, lr=1e-4)``.

Workloads are named on the command line as a built-in (``gpt2``, ``llama:num_hidden_layers=2``,
``cnn``; see ``memfit workloads``) or a user file ``path/to/file.py:NAME`` where NAME is a Workload
or a function returning one.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.errors import UserError


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


@dataclass
class Workload:
    model: Callable[[], torch.nn.Module]
    batch: Callable[[int], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    name: str = "workload"
    default_batch_size: int = 8
    """Batch size used when the user gives none."""
    info: dict = field(default_factory=dict)
    """Free-form facts shown in reports (architecture, config, sequence length)."""

    def build_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return (self.optimizer or default_optimizer)(params)


def load_workload(spec: str | Workload, *, seq_len: int | None = None) -> Workload:
    """Resolve a workload spec: a Workload, ``file.py:NAME`` or a built-in name with overrides."""
    if isinstance(spec, Workload):
        if seq_len is not None:
            raise UserError("--seq-len applies to built-in workloads only; set it inside your workload")
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise UserError("no workload given; name a built-in (e.g. gpt2) or a file (path/to/file.py:NAME)")
    spec = spec.strip()
    head = spec.split(":", 1)[0]
    if head.endswith(".py") or "/" in head or Path(head).suffix == ".py":
        if seq_len is not None:
            raise UserError("--seq-len applies to built-in workloads only; set it inside your workload file")
        return _load_file_workload(spec)
    from memfit.workloads import builtin_workload
    return builtin_workload(spec, seq_len=seq_len)


def _load_file_workload(spec: str) -> Workload:
    path_text, _, name = spec.partition(":")
    path = Path(path_text)
    if not path.is_file():
        raise UserError(f"workload file {path_text!r} not found; give path/to/file.py:NAME")
    if not name:
        raise UserError(f"workload {spec!r} names no object; write {path_text}:NAME (a Workload or a function returning one)")
    mod_name = f"memfit_user_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None:  # not a .py file: Python has no loader for it
        raise UserError(f"workload file {path_text!r} is not a Python file; give path/to/file.py:NAME")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise UserError(f"workload file {path_text!r} raised {type(e).__name__} while importing: {e}; "
                        "fix the file (run with --debug for the traceback)") from e
    if not hasattr(module, name):
        found = [k for k, v in vars(module).items() if isinstance(v, Workload) or (callable(v) and not k.startswith("_"))]
        raise UserError(f"{path_text} has no {name!r}; define a Workload or a function returning one"
                        + (f" (found: {', '.join(found[:8])})" if found else ""))
    obj = getattr(module, name)
    if not isinstance(obj, Workload):
        if not callable(obj):
            raise UserError(f"{path_text}:{name} is a {type(obj).__name__}, not a Workload or a function returning one")
        try:
            obj = obj()
        except Exception as e:
            raise UserError(f"{path_text}:{name}() raised {type(e).__name__}: {e}; fix the workload "
                            "(run with --debug for the traceback)") from e
        if not isinstance(obj, Workload):
            raise UserError(f"{path_text}:{name}() returned a {type(obj).__name__}, not a memfit.Workload")
    if obj.name == "workload":
        obj.name = f"{path.name}:{name}"
    return obj
