"""Memory techniques: one module each (see memfit.techniques.base for what a technique is).

Every module that defines ``TECHNIQUE`` is found here. Adding a technique is adding its module and
naming its keys as fields of :class:`memfit.plans.Plan` (where the build order is written): the
plan's keys, ``build_step``, the planner's search space and time model, the exports, the report's
ablations and OOM adaptation all come from ``memfit.plans.TECHNIQUES``.
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
