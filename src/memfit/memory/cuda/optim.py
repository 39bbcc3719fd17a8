"""Rule: optimizers default to their foreach implementation, as for real CUDA parameters.

torch.optim's optimizers left at ``foreach=None`` (and ``fused=None``) ask
``torch.optim.optimizer._default_to_fused_or_foreach(params, differentiable)``, which picks the
foreach implementation when every parameter is a plain ``Tensor``/``Parameter`` on a device with
foreach kernels (CUDA). Under fake tensors ``type(p)`` is ``FakeTensor`` (and the trace of a GPU
preset is on CPU tensors), so it answers False and the for-loop implementation runs. The foreach
one allocates intermediates as large as all parameters of a group at once (``_foreach_sqrt`` of
``exp_avg_sq`` in AdamW: snap-llama2l-bf16, snap-mha-bf16), so the for-loop trace was 15% low on
a 4-layer Llama.

During a GPU-target trace each optimizer module's reference to that function answers as it would
for the same parameters on CUDA: ``differentiable`` still disables both, a parameter that is not
a tensor of a foreach-supported dtype still disables foreach, and an optimizer that does not
consult it (Adafactor keeps ``foreach=None`` as for-loop) is unaffected. Optimizers created with
an explicit ``foreach``/``fused`` keep it.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

# modules of torch.optim that import _default_to_fused_or_foreach by name
_MODULES = ("optimizer", "adam", "adamw", "adagrad", "adamax", "asgd", "nadam", "radam", "rmsprop", "rprop", "sgd",
            "adadelta")
_NAME = "_default_to_fused_or_foreach"


def cuda_default_to_fused_or_foreach(params, differentiable: bool, use_fused: bool = False) -> tuple[bool, bool]:
    """``_default_to_fused_or_foreach`` as it answers for these parameters living on a GPU."""
    if torch.jit.is_scripting() or differentiable:
        return False, False
    ok = all(p is None or isinstance(p, torch.Tensor) for p in params)
    fused = use_fused and ok and all(p is None or torch.is_floating_point(p) for p in params)
    return fused, (not fused and ok)


@contextlib.contextmanager
def cuda_optimizer_defaults():
    saved = []
    try:
        for name in _MODULES:
            try:
                mod = importlib.import_module(f"torch.optim.{name}")
            except ImportError:  # pragma: no cover - a module torch no longer has
                continue
            if hasattr(mod, _NAME):
                saved.append((mod, getattr(mod, _NAME)))
                setattr(mod, _NAME, cuda_default_to_fused_or_foreach)
        yield
    finally:
        for mod, fn in saved:
            setattr(mod, _NAME, fn)
