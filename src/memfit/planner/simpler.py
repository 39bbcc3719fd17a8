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
COUNTED = "swap_blocks"
"""The host-side field whose value is a count: fewer is simpler (NOTE [ The fewest blocks swapped that fit ])."""


# NOTE [ The fewest blocks swapped that fit ]
# Swapping N of a model's blocks keeps their weights on the host and streams them over the link twice a
# step. While the copies hide behind compute, the time model prices every N alike, and the walk kept the
# first it traced: Wan 2.1 14B's ai-toolkit example on the rtx4080 preset chose 30 of 40 blocks where fewer
# may fit, each swapped block 0.6 GB more of the host's memory and of the link's traffic, the part of the
# step the time model knows least. So a plan equal to the chosen one but for fewer blocks swapped is also
# "simpler". Which count to try: the device bytes fall by one block's weights per block swapped, so a
# line through the counts already traced (the chosen plan's and another swapping some blocks of the same
# plan: swapping none holds no staging buffers, and its figure is often only a lower bound) predicts the
# fewest that fit. Without such a count traced, the other point is the weights each count keeps on the device
# (memfit.techniques.swap_blocks.resident_weight_bytes: the rest of the step is the same plan's). A count
# predicted to fit gets a try of its own, beside TRIES: LTX-2's 24 GB plan (fp8, 48 blocks, 0.37 GiB each)
# chose all 48 swapped with 13 GiB of the card free, 17 GiB of pinned host memory, because its one try went to
# keeping the optimizer states on the device. A count predicted not to fit costs no trace: FLUX.1's 12 GB plan
# (28 of 57 swapped) still tries its LoRA's states on the device first. Where nothing predicts a count, the
# next below the chosen one comes after the plans that drop a host-side technique.


def techniques(plan: Plan) -> frozenset:
    """The plan's values other than a default plan's: ``(field, value)``, one per offloaded item."""
    out = set()
    for name, value in plan.changed().items():
        if isinstance(value, tuple):
            out.update((name, str(item)) for item in value)
        else:
            out.add((name, value))
    return frozenset(out)


def lighter(plan: Plan, than: Plan) -> bool:
    """``plan`` asks less of the host than ``than`` and adds nothing: a strict subset of its techniques without
    one of its host-side ones, or its techniques with fewer blocks swapped (NOTE [ The fewest blocks swapped
    that fit ])."""
    mine, theirs = techniques(plan), techniques(than)
    if mine < theirs:
        return any(k in HOST_SIDE for k, _ in theirs - mine)
    rest = {t for t in mine if t[0] != COUNTED}
    return rest <= {t for t in theirs if t[0] != COUNTED} and 0 < getattr(plan, COUNTED) < getattr(than, COUNTED)


def _fewest_swapped_first(walk, ranked: list[Candidate], chosen: Candidate, lighter_ones: list[Candidate]) -> tuple:
    """``lighter_ones`` in the order to try, as two lists: those that differ from ``chosen`` by their swap count alone
    and that a line through the device bytes predicts to fit (the fewest first); then the rest as before (dropping
    the fewest techniques first), then the other counts, the next below the chosen's first (the likeliest to fit)."""
    def others(c: Candidate) -> frozenset:
        return frozenset(t for t in techniques(c.plan) if t[0] != COUNTED)
    same = others(chosen)
    counts = sorted((c for c in lighter_ones if others(c) == same), key=lambda c: -getattr(c.plan, COUNTED))
    at = _device_bytes(walk, ranked, chosen, same, others) if counts else None
    predicted = sorted((c for c in counts if at is not None and at(c.plan) <= walk.budget.bytes),
                       key=lambda c: getattr(c.plan, COUNTED))
    rest = sorted((c for c in lighter_ones if c not in counts), key=lambda c: (-len(techniques(c.plan)), c.seconds))
    return predicted, rest + [c for c in counts if c not in predicted]


def _device_bytes(walk, ranked: list[Candidate], chosen: Candidate, same: frozenset, others):
    """The device bytes of ``chosen``'s plan with another swap count, as a function of the plan; None without a
    second point (NOTE [ The fewest blocks swapped that fit ]): a count of the same plan traced, else the weights
    the count keeps on the device (where the walk's ladder knows them: a GPU preset's)."""
    n1 = getattr(chosen.plan, COUNTED)
    if chosen.used_bytes is None:
        return None
    traced = [(getattr(c.plan, COUNTED), c.used_bytes) for c in ranked if others(c) == same and c.used_bytes is not None
              and getattr(c.plan, COUNTED) not in (0, n1)]  # (none swapped: no staging buffers)
    if traced:
        n0, b0 = min(traced, key=lambda nb: abs(nb[0] - n1))  # (the nearest count traced: the line's other point)
        per_block = (b0 - chosen.used_bytes) / (n1 - n0)  # (device bytes a block swapped saves)
        return (lambda p: chosen.used_bytes + per_block * (n1 - getattr(p, COUNTED))) if per_block > 0 else None
    # (the ladder's estimate on a GPU preset, memfit.planner.gpu_ladder.Estimate: none on a CPU's)
    resident = getattr(getattr(walk.ladder, "estimate", None), "resident_weights", None)
    mine = resident(chosen.plan) if resident is not None else None
    if mine is None:
        return None
    return lambda p: chosen.used_bytes + resident(p) - mine


# NOTE [ A simpler plan timed from the chosen one ]
# The chosen plan's time is its own (traced); a simpler plan left untraced has an estimate from the plans measured
# before it and each value's factor alone (NOTE [ Estimates from the nearest measured plan ] in
# memfit.planner.gpu_time), which can err by more than TIE. HiDream-I1's 24 GB LoRA chose its 48 blocks swapped with
# the LoRA's AdamW states (126 MB) stepped on the host, 2,747.7 ms traced, where the same plan with the states on the
# device was estimated at 3,335.4 ms (1.21x) and never tried. So a simpler plan is weighed by the lesser of its own
# estimate and the chosen plan's time times the factors of the values in which the two differ: the values dropped
# divided out, those added multiplied in. Either way only its trace decides whether it is chosen
# (memfit.planner.walk.Walk.settle); an estimate that errs low costs one try (TRIES).
def _seconds_beside(walk, c: Candidate, fastest: Candidate) -> float:
    """NOTE [ A simpler plan timed from the chosen one ]."""
    ratio = walk.model.factor_between(c.plan, fastest.plan)
    return c.seconds if ratio is None else min(c.seconds, fastest.seconds * ratio)


def settle_simpler(walk, ranked: list[Candidate], chosen: Candidate | None) -> Candidate | None:
    """NOTE [ A technique pays for itself ]: the plan to choose instead of ``chosen`` (itself where
    none is simpler, fits and is within TIE of its time)."""
    if chosen is None or chosen.recipe is not None:
        return chosen
    fastest, tries = chosen, TRIES
    while True:
        mine = techniques(chosen.plan)
        simpler = [c for c in ranked if c.open and c.recipe is None and lighter(c.plan, chosen.plan)
                   and _seconds_beside(walk, c, fastest) <= fastest.seconds * (1 + TIE)]
        predicted, rest = _fewest_swapped_first(walk, ranked, chosen, simpler)
        better = None
        for c in predicted[:1] + rest[:tries]:  # (a count predicted to fit: a try of its own)
            if c not in predicted:
                tries -= 1
            if walk.settle(c, fastest, within=TIE) is not None:
                better = c
                break
        if better is None:
            return chosen
        dropped = sorted(f"{k}={v}" for k, v in mine - techniques(better.plan) if k != COUNTED)
        fewer, more = getattr(better.plan, COUNTED), getattr(chosen.plan, COUNTED)
        if fewer != more:
            dropped.append(f"{COUNTED}={more}" + (f" where {fewer} fit" if fewer else ""))
        extra = " ".join(dropped)
        saved = better.seconds - chosen.seconds
        gain = f"predicted {saved * 1e3:.1f} ms ({saved / better.seconds:.2%}) faster than the chosen plan, under " \
            f"{TIE:.0%}" if saved > 0 else "no faster than the chosen plan"
        chosen.status = Status.NOT_WORTH
        chosen.reason = f"{gain}: what it adds ({extra}) does not pay for itself"
        better.choose()
        chosen = better
    return chosen
