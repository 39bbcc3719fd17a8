"""A plan with fewer techniques where the time model cannot tell it from the fastest.

The walk (memfit.planner.walk) chooses the plan predicted fastest among those that fit. Two plans
can differ by less than the time model resolves, and a technique the user did not ask for is not
free where the prediction says so: it moves work (an update to a worker thread on the host), holds
memory elsewhere (the host's), adds a moving part that can fail. So a technique must pay for itself
(NOTE [ A technique pays for itself ]).
"""

from __future__ import annotations

import dataclasses

from memfit.planner.candidate import Candidate, Status
from memfit.plans import Plan

TIE = 0.01
"""A plan with fewer techniques predicted no more than this share of the step slower is chosen."""
TRIES = 2
"""Simpler plans measured at most, after the walk (each a trace pair and a full trace)."""


# NOTE [ A technique pays for itself ]
# FLUX.1-dev's rank-16 LoRA (fp8 base, 1024 px) on the rtx4090 preset: blocks checkpointed with
# AdamW's states stepped on the host was predicted 2.1 ms (0.04% of 4.77 s) faster than the same
# plan with the states on the device, so the search chose to copy every gradient out and run the
# update on a worker thread, on a card with 6.58 GiB to spare, for a gain no measurement of the
# step could show (the time model's median error on held-out GPU rows is 11.6%: docs/planner.md). So
# after the walk, a plan whose techniques (its values other than the defaults; each offloaded item
# one) are a strict subset of the chosen plan's, and that is predicted no more than TIE slower, is
# measured like a field recipe (memfit.planner.walk.Walk.settle) and, where it fits, chosen instead;
# the plan it displaces is listed as "not worth it", with what its extra techniques would save. The
# simplest are tried first, at most TRIES. The fields the user set are in every candidate, so they
# are never what makes a plan simpler.
def techniques(plan: Plan) -> frozenset:
    """The plan's values other than a default plan's: ``(field, value)``, one per offloaded item."""
    default, out = Plan(), set()
    for f in dataclasses.fields(plan):
        value = getattr(plan, f.name)
        if not f.init or value == getattr(default, f.name):
            continue
        if isinstance(value, tuple):
            out.update((f.name, str(item)) for item in value)
        else:
            out.add((f.name, value))
    return frozenset(out)


def settle_simpler(walk, ranked: list[Candidate], chosen: Candidate | None) -> Candidate | None:
    """NOTE [ A technique pays for itself ]: the plan to choose instead of ``chosen`` (itself where
    none is simpler, fits and is within TIE of its time)."""
    if chosen is None or chosen.recipe is not None:
        return chosen
    mine = techniques(chosen.plan)
    simpler = [c for c in ranked if c.open and c.recipe is None and techniques(c.plan) < mine
               and c.seconds <= chosen.seconds * (1 + TIE)]
    for c in sorted(simpler, key=lambda c: (len(techniques(c.plan)), c.seconds))[:TRIES]:
        if walk.settle(c, chosen, within=TIE) is None:
            continue
        extra = " ".join(sorted(_short(k, v) for k, v in mine - techniques(c.plan)))
        chosen.status = Status.NOT_WORTH
        saved = c.seconds - chosen.seconds
        chosen.reason = (f"predicted {saved * 1e3:.1f} ms ({saved / c.seconds:.2%}) faster than the chosen plan, "
                         f"under {TIE:.0%}: what it adds ({extra}) does not pay for itself")
        c.choose()
        return c
    return chosen


def _short(name: str, value) -> str:
    return f"{name}={value}"
