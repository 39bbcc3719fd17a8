"""Memory techniques: one module each (see memfit.techniques.base for what a technique is).

Every module that defines ``TECHNIQUE`` is found here, so adding a technique is adding its module:
the plan's keys, ``build_step``, the planner's search space and time model, the exports, the
report's ablations and OOM adaptation all come from :data:`TECHNIQUES`.
"""

from __future__ import annotations

import importlib
import pkgutil

from memfit.techniques.base import Technique


def _discover() -> tuple[Technique, ...]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        technique = getattr(module, "TECHNIQUE", None)
        if isinstance(technique, Technique):
            found.append(technique)
    found.sort(key=lambda t: t.order)
    names = [t.name for t in found]
    assert len(set(names)) == len(names), f"two techniques share a name: {names}"
    keys = [k.name for t in found for k in t.keys]
    assert len(set(keys)) == len(keys), f"two techniques share a plan key: {keys}"
    return tuple(found)


TECHNIQUES: tuple[Technique, ...] = _discover()
"""Every technique, in plan order (``Technique.order``)."""
BY_NAME: dict[str, Technique] = {t.name: t for t in TECHNIQUES}
"""Technique name -> technique."""
