"""Built-in workloads, named ``ARCH`` or ``ARCH:key=value,key=value``.

Hugging Face architectures (``gpt2``, ``llama``, ``bert``, ``t5``, ``vit``) are built from their
config class only: no weights, no tokenizer, no network. Overrides set config attributes
(``gpt2:n_layer=4,n_embd=256``). The plain-torch zoo (``cnn``, ``lstm``, ``transformer``, ``mha``,
``dit``) covers kernels with hidden workspaces and data-dependent code paths; overrides set the
fields of each model's config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from memfit.errors import UserError
from memfit.workload import Workload

from . import hf, zoo
from .checks import guarded

_REGISTRY: dict[str, tuple[Callable[..., Workload], str]] = {
    **{name: (fn, doc) for name, (fn, doc) in hf.BUILDERS.items()},
    **{name: (fn, doc) for name, (fn, doc) in zoo.BUILDERS.items()},
}


def builtin_names() -> dict[str, str]:
    """Built-in workload names with a one-line description."""
    return {name: doc for name, (_, doc) in _REGISTRY.items()}


def parse_overrides(text: str, what: str) -> dict:
    """'a=1,b=0.5,c=true' -> {'a': 1, 'b': 0.5, 'c': True} (values parsed as YAML scalars)."""
    import yaml
    out: dict = {}
    if not text:
        return out
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            example = "--ema decay=0.999,device=cpu" if what == "--ema" else f"{what}:key=value,key=value"
            raise UserError(f"malformed override {item!r} for {what}; write key=value pairs separated by commas, "
                            f"e.g. {example}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key] = value
    return out


def builtin_workload(spec: str, *, seq_len: int | None = None) -> Workload:
    arch, _, override_text = spec.partition(":")
    arch = arch.strip().lower()
    if arch not in _REGISTRY:
        raise UserError(f"unknown workload {arch!r}; choose a built-in ({', '.join(_REGISTRY)}) "
                        "or a file (path/to/file.py:NAME)")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise UserError(f"--seq-len must be a positive whole number, got {seq_len!r}")
    builder, _ = _REGISTRY[arch]
    overrides = parse_overrides(override_text, arch)
    wl = builder(overrides, seq_len)
    return dataclasses.replace(wl, model=guarded(arch, overrides, "building the model", wl.model),
                               batch=guarded(arch, overrides, "batch(batch_size)", wl.batch),
                               loss=guarded(arch, overrides, "loss(model, batch)", wl.loss))
