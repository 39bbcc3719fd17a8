"""A plan's figures from its shallow pair's allocations at full depth (memfit.memory.deep_stream): the
reserved bytes the deep rung rules plans out by, and the top rung's, checked at a third depth where a
trace costs a few blocks, in place of a full trace.

NOTE [ The deep stream checked at a third depth ]
A full trace costs every block: Qwen2.5-7B's 28 at batch 2 x 2048 took 15-21 s of a worker a plan,
where its shallow traces take 1-3 s, and the planner's top rung ran one for every plan it chose and
for the maximal plans near the budget (83 of the 236 worker-seconds of ``plan --methods
full,lora,qlora``). Yet the figures the top rung gives are those of the pair's allocations replayed at
full depth (NOTE [ Allocations at full depth ] in memfit.memory.deep_stream) wherever those line up:
to the byte on every plan checked, those five included. What a full trace still checks is that
the deepening holds for that plan. A trace at a third depth ``f = 2e - d`` checks the same thing for
the cost of ``f`` blocks: the pair's allocations deepened to ``f`` and replayed must give that trace's
allocated peak and reserved bytes exactly. Where they do, the plan's figures at full depth are the
replayed ones (its ops the pair's, extrapolated, as before confirming) and it may be chosen; where
they do not (or nothing lines up, or ``f`` is not short of full depth), its full trace runs, as
before. The deep rung's rulings (NOTE [ Deep stream checked ] in memfit.planner.ladder) are then held
against these plans as against full traces: such a plan's figure is its deep one, so what that check
now rests on is the deepening checked at the third depth. A failed trace there is a miss, and does not
turn shallow pairs off for the search, as a failed shallow trace does.

What this cannot see is a model whose full build differs from its cut (a tensor sized by the depth
outside the blocks); such a model's streams do not line up with the cut's in the first place (the
build is part of them), and ``memfit estimate`` of the chosen plan is still its full trace.
"""

from __future__ import annotations

import dataclasses
import time

from memfit.errors import UserError
from memfit.memory.categories import STEADY_STEP
from memfit.memory.deep_stream import deepen, replay
from memfit.planner.measured import Measured, ShallowFailed
from memfit.planner.shallow import extrapolate
from memfit.planner.trace_job import Traced
from memfit.plans import Plan


class DeepFigures:
    """The trace book's figures from a plan's deep stream (the module's docstring). A mixin of
    memfit.planner.traces.TraceBook: it uses its ``depths``, ``depth``, ``measured``, ``_traced``, ``_run``,
    ``_counted`` and ``_spend``."""

    def _start_deep_figures(self) -> None:
        self._deep: dict[Plan, int | None] = {}
        self.missed_at_third: set[Plan] = set()
        """Plans whose deep stream missed their trace at the third depth (confirmed by a full trace)."""
        self.third_jobs: set[tuple] = set()

    def deep_used(self, plan: Plan) -> int | None:
        """The allocator side of what the budget counts for a measured plan, from its shallow pair's allocations
        replayed at full depth (NOTE [ Allocations at full depth ]; 0.05-0.5 s, so asked only of a
        plan about to be confirmed); None where they do not line up, or the plan has no pair."""
        if plan not in self._deep:
            pair, traced = self.depths(plan), None
            if pair and all(isinstance(self._traced.get((plan, d, None)), Traced) for d in pair):
                traced = [self._traced[(plan, d, None)] for d in pair]
            deep = None
            if traced and traced[0].stream is not None and traced[1].stream is not None:
                deep = deepen(traced[0].stream, traced[1].stream, *pair, self.depth)
            t0 = time.process_time()
            used = None
            if deep is not None:
                managed = self.measured[plan].managed_bytes if plan in self.measured else 0
                used = self._used_at_full_depth(plan, deep, traced[1].context_bytes, managed)[1]
            self._deep[plan] = used
            self._spend("deep stream replay", time.process_time() - t0)
        return self._deep[plan]

    def _used_at_full_depth(self, plan: Plan, deep, context: int, managed: int) -> tuple[int, int]:
        """The allocated peak of the stream ``deep`` at full depth, and the allocator side the book keeps of it
        (with expandable segments where only they fit: ``_counted``)."""
        peak, reserved = replay(deep, STEADY_STEP, expandable=plan.config("allocator").expands)
        return peak, self._counted(plan, reserved + context,
                                   lambda: replay(deep, STEADY_STEP, expandable=True)[1] + context, managed)

    def third_depth_job(self, plan: Plan) -> tuple | None:
        """The trace that confirms ``plan`` in place of its full trace (None: its full trace confirms it)."""
        pair = self.depths(plan)
        m = self.measured.get(plan)
        if not pair or m is None or m.shallower_only or plan in self.missed_at_third:
            return None
        d, e = pair
        third = 2 * e - d
        if third >= self.depth or self.deep_used(plan) is None:
            return None
        job = (plan, third, None)
        self.third_jobs.add(job)
        return job

    def checked_at_third(self, plan: Plan) -> bool:
        """``plan``'s trace at the third depth ran, and its deep stream did not miss it (no deep stream
        is made to answer: the walk asks this of every plan it may run alongside)."""
        pair = self.depths(plan)
        job = (plan, 2 * pair[1] - pair[0], None) if len(pair) == 2 else None
        return job in self.third_jobs and job in self._traced and plan not in self.missed_at_third

    def top_job(self, plan: Plan) -> tuple:
        """The job of ``plan``'s top rung: its trace at the third depth, or at full depth."""
        return self.third_depth_job(plan) or (plan, None, None)

    def confirmed_at_third(self, plan: Plan) -> Measured | None:
        """``plan``'s figures at full depth from its deep stream, where its trace at the third depth
        equals that stream deepened to it (None: they differ, or there is no such trace)."""
        job = self.third_depth_job(plan)
        if job is None:
            return None
        (d, e), third = self.depths(plan), job[1]
        try:
            (t,) = self._run([job])
        except (ShallowFailed, UserError):  # (a failed third trace is a miss: the full trace decides)
            t = None
        a, b = (self._traced.get((plan, x, None)) for x in (d, e))
        deep = deepen(a.stream, b.stream, d, e, third) if isinstance(t, Traced) else None
        if deep is None or not _same_figures(deep, t, a, b, (d, e, third), plan.config("allocator").expands):
            self.missed_at_third.add(plan)
            return None
        m = self.measured[plan]
        peak, used = self._used_at_full_depth(plan, deepen(a.stream, b.stream, d, e, self.depth), b.context_bytes,
                                              m.managed_bytes)
        m = self.measured[plan] = dataclasses.replace(m, peak_bytes=peak, used_lower=peak + b.context_bytes,
                                                      used_bytes=used, full=True)
        self._new.append(plan)
        return m


def _same_figures(deep, t: Traced, a: Traced, b: Traced, depths: tuple[int, int, int], expands: bool) -> bool:
    """The pair's figures at the third depth are its trace's: the allocated peak and reserved bytes replayed
    (with expandable segments too, where the trace has that figure), and the managed and host bytes on the
    pair's line (as the full-depth ones are drawn)."""
    d, e, third = depths
    if replay(deep, STEADY_STEP, expandable=expands) != (t.peak_bytes, t.used_bytes - t.context_bytes):
        return False
    if t.expandable_used_bytes is not None and not expands and \
            replay(deep, STEADY_STEP, expandable=True)[1] != t.expandable_used_bytes - t.context_bytes:
        return False
    return all(int(extrapolate(u, v, d, e, third)) == w for u, v, w in
               ((a.managed_bytes, b.managed_bytes, t.managed_bytes), (a.host_bytes, b.host_bytes, t.host_bytes)))
