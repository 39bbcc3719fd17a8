"""Memory techniques: one module each. What a technique is, and how to add one:
memfit.techniques.base.

Every module that defines ``TECHNIQUE`` is found here; ``memfit.plans`` orders them by the fields of
``Plan``.
"""

from __future__ import annotations

import importlib
import pkgutil

from memfit.techniques.base import Key, Technique


def _discover() -> dict[str, Technique]:
    found: dict[str, Technique] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        technique = getattr(module, "TECHNIQUE", None)
        if isinstance(technique, Technique):
            assert technique.name not in found, f"two techniques are named {technique.name!r}"
            found[technique.name] = technique
    keys = [k.name for t in found.values() for k in t.keys]
    assert len(set(keys)) == len(keys), f"two techniques share a plan key: {keys}"
    return found


FOUND: dict[str, Technique] = _discover()
"""Technique name -> technique, as the modules define them (``memfit.plans`` orders them)."""
KEYS: dict[str, tuple[Technique, Key]] = {k.name: (t, k) for t in FOUND.values() for k in t.keys}
"""Plan key -> its technique and its :class:`Key`."""
