"""The built-in workloads' registry: the Hugging Face architectures and the plain-torch zoo."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from memfit.errors import UserError
from memfit.units import parse_key_values
from memfit.workload import Workload
from memfit.workloads import hf, zoo
from memfit.workloads.checks import guarded

_REGISTRY: dict[str, tuple[Callable[..., Workload], str]] = {
    **{name: (fn, doc) for name, (fn, doc) in hf.BUILDERS.items()},
    **{name: (fn, doc) for name, (fn, doc) in zoo.BUILDERS.items()},
}


def builtin_names() -> dict[str, str]:
    """Built-in workload names with a one-line description."""
    return {name: doc for name, (_, doc) in _REGISTRY.items()}


def builtin_workload(spec: str, *, seq_len: int | None = None) -> Workload:
    arch, _, override_text = spec.partition(":")
    arch = arch.strip().lower()
    if arch not in _REGISTRY:
        raise UserError(f"unknown workload {arch!r}; choose a built-in ({', '.join(_REGISTRY)}) "
                        "or a file (path/to/file.py:NAME)")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise UserError(f"--seq-len must be a positive whole number, got {seq_len!r}")
    builder, _ = _REGISTRY[arch]
    overrides = parse_key_values(override_text, arch)
    wl = builder(overrides, seq_len)
    return dataclasses.replace(wl, model=guarded(arch, overrides, "building the model", wl.model),
                               batch=guarded(arch, overrides, "batch(batch_size)", wl.batch),
                               loss=guarded(arch, overrides, "loss(model, batch)", wl.loss))
