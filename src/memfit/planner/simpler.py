"""A plan without a host-side technique where the time model cannot tell it from the fastest.

The walk (memfit.planner.walk) chooses the plan predicted fastest among those that fit. Two plans
can differ by less than the time model resolves, and a technique the user did not ask for is not
free where the prediction says so: it moves work (an update to a worker thread on the host), holds
memory elsewhere (the host's), adds a moving part that can fail. So a technique must pay for itself
(NOTE [ A technique pays for itself ]).
"""

from __future__ import annotations

from memfit.planner.candidate import Candidate, Status
from memfit.plans import Plan

TIE = 0.01
"""A plan with fewer techniques predicted no more than this share of the step slower is chosen."""
TRIES = 1
"""Simpler plans measured at most, after the walk (each a trace pair and a full trace: 8-10 s of a
2-core machine's CPU for a 7B model, the full trace of FLUX.1's 57 blocks longer)."""


# NOTE [ A technique pays for itself ]
# FLUX.1-dev's rank-16 LoRA (fp8 base, 1024 px) on the rtx4090 preset: blocks checkpointed with
# AdamW's states stepped on the host was predicted 2.1 ms (0.04% of 4.77 s) faster than the same
# plan with the states on the device, so the search chose to copy every gradient out and run the
# update on a worker thread, on a card with 6.58 GiB to spare, for a gain no measurement of the
# step could show. What the host does is the time model's least measured part (offloaded states ran
# at 3.45x and 4.44x the plain step on the H100 and H200 rows, and how much of that is exposed
# waiting is unknown: issue 51), and it holds host memory and adds threads. So after the walk, a plan
# whose techniques (its values other than the defaults; each offloaded item one) are a strict subset
# of the chosen plan's, without one of its HOST_SIDE ones, and that is predicted no more than TIE
# slower, is measured like a field recipe (memfit.planner.walk.Walk.settle) and, where it fits, chosen
# instead; the plan it displaces is listed as "not worth it", with what it adds. The plans that drop
# the fewest techniques are tried first (the likeliest to fit), then (with TRIES above 1), from the
# plan chosen so, the same again, within TIE of the fastest's time. The fields the user set are in
# every candidate, so they are never what makes a plan simpler. Only host-side techniques: each try
# costs a full trace, and an exact tie of device-side ones is common and harmless (Qwen2.5-7B's 24 GB
# plan is 2577.2 ms with its offloaded update stepped in backward and without; trying the simpler one
# made that search 1.15x as long).
HOST_SIDE = ("offload", "swap_blocks", "shard_offload")
"""Plan fields whose values move memory and work to the host."""


def techniques(plan: Plan) -> frozenset:
    """The plan's values other than a default plan's: ``(field, value)``, one per offloaded item."""
    out = set()
    for name, value in plan.changed().items():
        if isinstance(value, tuple):
            out.update((name, str(item)) for item in value)
        else:
            out.add((name, value))
    return frozenset(out)


def settle_simpler(walk, ranked: list[Candidate], chosen: Candidate | None) -> Candidate | None:
    """NOTE [ A technique pays for itself ]: the plan to choose instead of ``chosen`` (itself where
    none is simpler, fits and is within TIE of its time)."""
    if chosen is None or chosen.recipe is not None:
        return chosen
    fastest, tries = chosen, TRIES
    while tries:
        mine = techniques(chosen.plan)
        simpler = [c for c in ranked if c.open and c.recipe is None and techniques(c.plan) < mine
                   and any(k in HOST_SIDE for k, _ in mine - techniques(c.plan))
                   and c.seconds <= fastest.seconds * (1 + TIE)]
        better = None
        for c in sorted(simpler, key=lambda c: (-len(techniques(c.plan)), c.seconds))[:tries]:
            tries -= 1
            if walk.settle(c, fastest, within=TIE) is not None:
                better = c
                break
        if better is None:
            return chosen
        extra = " ".join(sorted(f"{k}={v}" for k, v in mine - techniques(better.plan)))
        saved = better.seconds - chosen.seconds
        gain = f"predicted {saved * 1e3:.1f} ms ({saved / better.seconds:.2%}) faster than the chosen plan, under " \
            f"{TIE:.0%}" if saved > 0 else "no faster than the chosen plan"
        chosen.status = Status.NOT_WORTH
        chosen.reason = f"{gain}: what it adds ({extra}) does not pay for itself"
        better.choose()
        chosen = better
    return chosen
