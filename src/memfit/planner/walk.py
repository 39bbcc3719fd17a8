"""The walk: candidates fastest first, each climbing the evidence ladder until one fits.

A priority queue on predicted time. A visited plan climbs the ladder (memfit.planner.ladder): an
estimate well over the budget rules it out untraced; its first rung's evidence (the CPU: a full
trace; GPU presets: a shallow pair, which also gives its own time) either rules it out or lets it
on; slower than its estimate, it goes back into the queue at its new time; the deep stream may
rule it out; its full trace confirms it. The first plan that comes out fastest with final figures
that fit is chosen.

Pruning: a plan that saves no more memory than one that did not fit cannot fit (techniques are
assumed not to *add* memory). The maximal plans (none saves less than another everywhere) are
traced after ``WALK_BEFORE_FEASIBILITY`` traces (first, when no plan measured before the walk
fits: NOTE [ Maximal plans first when nothing measured fits ]): when none of them fits, nothing does.

NOTE [ Maximal plans first when nothing measured fits ]
The time model measures the default plan and each value alone before the walk (GPU presets). When
none of them fits, the answer needs several techniques together, and the fastest plans (few
techniques) are the least likely to fit: the walk then traces the maximal plans first, whose
failures prune every plan they dominate. Llama-2-7B for the rtx4090 preset (its default plan needs
61.9 GiB, every value alone at least 24.8, of 21.3) traced nine 4-bit plans, fastest first, before
the maximal 4-bit plan (22.35 GiB) ruled out all of them. Where a value alone fits, the fastest
plans are tried first as before: the maximal plans may cost more traces than they save.

NOTE [ Split maximal plans last ]
A plan that splits the batch into n micro-batches runs forward and backward n times: its trace
takes n times the ops. GPT-2 at batch 8 x 1024 for a 4 GiB budget had eight maximal plans, four of
them at micro-batch 1, 3.4 s a pair each against 0.8 s for the others, and the others fitted: the
split ones proved nothing the others had not. So the maximal plans that do not split the batch are
traced first (together, on the workers), and the split ones only when none of those may fit; until
then they wait in the queue at their estimates like any plan.

NOTE [ The next plan measured alongside ]
A shallow pair is two traces of unequal length (2 and 3 blocks: 0.6 and 1.0 s for GPT-2 at batch
8 x 1024), so with one pair at a time one of two workers waits a third of the walk. Where workers
are spare, the walk measures the plan it visits together with the one it would measure next were
this one too big (queued next, untraced, not pruned by the plans that failed nor by this one, not
estimated too big): four traces share the workers. The second one's evidence is taken at once:
too big, it prunes the plans it saves no more than before the walk reaches them; slower than
estimated, it waits in the queue behind the faster estimates even where its evidence is final (a
model with no repeated blocks is measured by full traces). Its traces are wasted only when the
first plan is chosen, or its measured time sends it behind plans that fit. The searches of
``--methods`` share the cores, and measure one plan at a time (``alongside=False``).

NOTE [ The next round's traces in the background ]
Most plans the walk measures are over the budget at the shallower depth (GPT-2 at 8 x 1024 for
2 GiB: 19 of 23), so their deeper traces are skipped, and a round of two plans ended with a worker
idle while the other traced a deeper trace, or with both idle while the walk chose the next pair:
21 of 66 worker-seconds of the walk idle. So each round queues the shallower traces of the plans
that would come next, were the two plans of the round to fail (the next round's pair), in the
background (memfit.planner.workers): a worker the round leaves idle starts them, and the next round
takes their results. Each round replaces the queue; a trace that started for a plan the round then
pruned is wasted, on a worker that would have idled.

NOTE [ Deep stream checked ]
Plans ruled out by the deep stream (reserved bytes from shallow allocations, not a full trace)
are held against every full trace at hand when a plan is about to be chosen: a miss by more than
``Fidelity.DEEP``'s margin, or nothing to check against, puts them back into the queue (with the
plans pruned for them) and the walk goes on without trusting that rung.

NOTE [ A full trace for the deep rung's check, alongside ]
A plan the deep rung ruled out whose full trace fits is a miss too. And "nothing to check against"
was the common case: the deep stream has no figure for some plans (GPT-2's micro-batches of 4 with
checkpointing: a free it cannot carry over), so when such a plan came to be chosen, the three
plans the rung had ruled out were traced in full after it, 3.1 s of the 2 GiB GPT-2 plan with one
worker idle while the chosen one's full trace ran. So where nothing is at hand to check the rung
against, a worker the confirmation leaves idle traces a plan it ruled out, in full: when that one
agrees, the rung stands, and it was checked on a plan it ruled out.
"""

from __future__ import annotations

import heapq

from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.planner.candidate import Candidate, Fidelity, Status
from memfit.planner.ladder import Evaluator, Ladder
from memfit.planner.progress import NoProgress
from memfit.planner.space import saves_no_more_than
from memfit.planner.time_model import StepTimeModel
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.units import fmt_bytes

WALK_BEFORE_FEASIBILITY = 8
"""Traces of the fastest plans before checking that any plan fits at all."""
LOOK_AHEAD = 16
"""Queued plans looked at for the one measured alongside (NOTE [ The next plan measured alongside ])."""
NEAR_BUDGET = 0.85
"""NOTE [ A borderline answer decided by the maximal plans' full traces ]: when every maximal plan
whose lower bound fits is within this fraction of the budget, their full traces decide at once
whether anything fits. Without it, a budget just under the smallest plan (Llama-2-7B at 14 GiB: the
lower bound 13.88 GiB fits, the full trace needs 14.55) walked every plan the lower bounds let
through, 93 traces, to say that nothing fits."""


class Walk:
    def __init__(self, batch_size: int, budget: Budget, model: StepTimeModel, ladder: Ladder, steps: int | None,
                 max_traces: int, progress=None, alongside: bool = True) -> None:
        self.bs, self.budget, self.model, self.ladder = batch_size, budget, model, ladder
        self.alongside = alongside
        """Idle workers trace the next plan's shallow pair while one is measured, and the next plans'
        full traces while one is confirmed (False: the searches of ``--methods`` share the cores)."""
        self.progress = progress or NoProgress()
        self.steps, self.max_traces = steps, max_traces
        self.failed: list[Candidate] = []
        self.evaluated = 0
        self.maximal: list[Candidate] | None = None
        self.before_feasibility = WALK_BEFORE_FEASIBILITY
        """Plans traced before the maximal ones."""
        self.limited = False
        """The trace limit left a faster plan untraced."""
        self.trust_deep = True
        self.deep_rejected: list[Candidate] = []
        """Plans ruled out by the deep rung (NOTE [ Deep stream checked ])."""
        self.notes: list[str] = []
        self.heap: list = []
        self.order: dict[int, int] = {}

    @property
    def traces(self) -> int:
        return self.ladder.traces

    def run(self, ranked: list[Candidate]) -> Candidate | None:
        measured = [e for e in (self.ladder.evidence(c.plan) for c in ranked) if e is not None]
        if measured and all(e.over(self.budget.bytes) for e in measured):  # NOTE [ Maximal plans first when nothing measured fits ]
            self.before_feasibility = 0
        self.heap = [(c.seconds, i, c) for i, c in enumerate(ranked)]
        heapq.heapify(self.heap)
        self.order = {id(c): i for i, c in enumerate(ranked)}
        while True:
            chosen = self._walk(ranked)
            if chosen is None and self.deep_rejected and self.trust_deep and not self.limited:
                if not self._deep_rejections_hold():
                    self.notes.append(f"nothing fitted after {len(self.deep_rejected)} plans were ruled out by "
                                      "their reserved bytes at full depth from shallow traces, and a full trace "
                                      "of one fits: every plan they ruled out was traced instead")
                    self._distrust_deep(ranked, None)
                    continue
                self.deep_rejected.clear()  # (confirmed by their full traces: real failures)
            if chosen is not None or self.limited or self.maximal is not None:
                return chosen
            # Nothing fitted and the maximal plans were never traced (the estimates spared their
            # traces): trace them now, ignoring the estimates, and walk again if any may fit.
            if not self._check_feasible(ranked):
                return None

    def _walk(self, ranked: list[Candidate]) -> Candidate | None:
        heap = self.heap
        while heap:
            _, _, c = heapq.heappop(heap)
            if not c.open:
                continue
            self.progress.walk(self.evaluated, self.max_traces, len(heap) + 1)
            if self._dominated(c):
                c.prune()
                continue
            if self.evaluated >= self.max_traces and not self.ladder.has_evidence(c.plan):
                self._stop_at_limit(c)
                return None
            if self.maximal is None and self.evaluated >= self.before_feasibility:
                if not self._check_feasible(ranked):
                    return None
                if not c.open or self._dominated(c):
                    if c.open:
                        c.prune()
                    continue
                if self.ladder.has_evidence(c.plan) and self._requeued(c):
                    continue
            if c.used_bytes is None and (self._estimated_too_big(c) or not self._measure(c)):
                continue
            if not c.open:  # too big
                continue
            if self._requeued(c):  # (NOTE [ The next plan measured alongside ])
                continue
            if not self.ladder.is_final(c.plan):
                if self._too_big_deep(c):
                    continue
                self._confirm_ahead(c)
                if not self._take(c, self.ladder.full) or not c.open or self._requeued(c):
                    continue
            if not self._deep_agrees():  # then the plans it ruled out are traced
                self._distrust_deep(ranked, c)
                continue
            c.choose()
            return c
        return None

    def _dominated(self, c: Candidate) -> bool:
        return any(saves_no_more_than(c.plan, f.plan, self.bs) for f in self.failed)

    def _requeued(self, c: Candidate) -> bool:
        """Slower than the fastest plan left (its time was measured): back in the queue at its time."""
        if self.heap and c.seconds > self.heap[0][0]:
            heapq.heappush(self.heap, (c.seconds, self.order[id(c)], c))
            return True
        return False

    def _stop_at_limit(self, c: Candidate) -> None:
        """A faster plan left untraced: no choice can be called the fastest that fits."""
        for _, _, x in [(None, None, c), *self.heap]:
            if x.open:
                x.note(f"trace limit ({self.max_traces}) reached")
        self.heap.clear()
        self.limited = True

    def _estimated_too_big(self, c: Candidate) -> bool:
        estimate = self.ladder.estimate.evaluate(c.plan) if self.ladder.estimate is not None else None
        if estimate is None or not estimate.over(self.budget.bytes):
            return False
        c.reject(f"estimated to need {fmt_bytes(estimate.used_bytes)} > budget {fmt_bytes(self.budget.bytes)} "
                 "(not traced)")
        return True

    def _measure(self, c: Candidate) -> bool:
        """``c`` on the ladder's first rung (counted against the trace limit unless it was there),
        with the next plan the walk would measure (NOTE [ The next plan measured alongside ])."""
        if not self.ladder.has_evidence(c.plan):
            self.evaluated += 1
            upcoming = [] if self.ladder.traced(c.plan) else self._next_to_measure(c, 2 + self.ladder.spare_workers)
            if upcoming:
                ahead = upcoming[0]
                self.evaluated += 1
                with silenced_warnings():
                    self.ladder.queue([x.plan for x in upcoming[1:]])  # NOTE [ The next round's traces in the background ]
                    self.ladder.measure_together([c.plan, ahead.plan], skip_over=True)
                self._take(ahead, self.ladder.first)  # (at once: too big, it prunes the plans it dominates)
        return self._take(c, self.ladder.first)

    def _next_to_measure(self, c: Candidate, n: int = 1) -> list[Candidate]:
        """The ``n`` plans queued next that the walk would measure if ``c`` (and each before it) did
        not fit: open, untraced, not pruned by a plan that failed or by ``c`` or those before it (were
        they to fail), and not estimated too big (an estimate that would need a trace of its own is
        not asked for)."""
        if not self.alongside or self.ladder.spare_workers < 1 or self.evaluated + 1 >= self.max_traces:
            return []
        estimate, out = self.ladder.estimate, []
        for _, _, x in heapq.nsmallest(LOOK_AHEAD, self.heap):
            if x is c or not x.open or x.used_bytes is not None or self.ladder.traced(x.plan):
                continue
            if self._dominated(x) or any(saves_no_more_than(x.plan, y.plan, self.bs) for y in (c, *out)):
                continue
            if estimate is not None and (not estimate.free(x.plan) or estimate.evaluate(x.plan).over(self.budget.bytes)):
                continue
            out.append(x)
            if len(out) == n:
                break
        return out

    def _take(self, c: Candidate, rung: Evaluator) -> bool:
        """``c``'s evidence from ``rung``: its time (the model's, which the rung may have measured)
        and its footprint; False (status invalid) if the plan does not suit the workload."""
        try:
            with silenced_warnings():
                evidence = rung.evaluate(c.plan)
        except UserError as e:
            c.invalidate(e)
            return False
        c.retime(self.model, self.steps)
        c.take(evidence)
        if evidence.over(self.budget.bytes):
            self._too_big(c, at_least=evidence.fidelity is Fidelity.LOWER_BOUND)
        self._rekey()
        return True

    def _rekey(self) -> None:
        """Plans just measured may change the estimates of plans that contain them (NOTE [ Estimates
        from the nearest measured plan ]): the open plans queued at an estimate take their new one."""
        new = self.model.newly_measured()
        if not new:
            return
        changed = False
        for i, (seconds, order, x) in enumerate(self.heap):
            if x.open and self.model.is_estimate(x.plan) and self.model.estimate_depends_on(x.plan, new):
                x.retime(self.model, self.steps)
                if x.seconds != seconds:
                    self.heap[i] = (x.seconds, order, x)
                    changed = True
        if changed:
            heapq.heapify(self.heap)

    def _too_big(self, c: Candidate, at_least: bool = False, how: str = "") -> None:
        need = f"at least {fmt_bytes(c.used_bytes)} (allocated)" if at_least else fmt_bytes(c.used_bytes)
        c.reject(f"needs {need}{f' ({how})' if how else ''} > budget {fmt_bytes(self.budget.bytes)}")
        self.failed.append(c)

    def _too_big_deep(self, c: Candidate) -> bool:
        """A plan whose lower bound fits, ruled out without its full trace by the deep rung."""
        if self.ladder.deep is None or not self.trust_deep or self.ladder.has_full_trace(c.plan):
            return False  # (the full trace decides)
        deep = self.ladder.deep.evaluate(c.plan)
        if deep is None or not deep.over(self.budget.bytes):
            return False
        c.used_bytes = deep.used_bytes
        self._too_big(c, how="reserved, from its shallow traces' allocations replayed at full depth")
        self.deep_rejected.append(c)
        return True

    def _confirm_ahead(self, c: Candidate) -> None:
        """Run ``c``'s full trace alongside those of the next plans that may come up for confirming
        (measured, their lower bound fits), on the workers that would otherwise wait: when ``c``'s
        reserved bytes do not fit, the next one's are ready."""
        spare, ladder = self.ladder.spare_workers if self.alongside else 0, self.ladder
        if spare <= 0 or ladder.has_full_trace(c.plan):  # (nothing to run alongside)
            return
        ahead: dict = {}
        for _, _, x in heapq.nsmallest(len(self.heap), self.heap):
            if len(ahead) == spare:
                break
            if x is not c and x.open and ladder.has_evidence(x.plan) and not ladder.is_final(x.plan) \
                    and not ladder.has_full_trace(x.plan) and x.used_bytes is not None \
                    and x.used_bytes <= self.budget.bytes and not self._too_big_deep(x):
                ahead[x.plan] = None
        if len(ahead) < spare and self.deep_rejected and self.trust_deep and not ladder.full_and_deep() \
                and not any(ladder.has_full_trace(x.plan) for x in self.deep_rejected):
            ahead[self.deep_rejected[0].plan] = None  # NOTE [ A full trace for the deep rung's check, alongside ]
        ladder.prefetch([c.plan, *ahead])

    def _deep_rejections_hold(self) -> bool:
        """Nothing fitted: the full traces of the plans the deep rung ruled out (run together on the
        workers). True if each is over the budget by its full trace too; then what the walk pruned
        for them stays pruned, and no plan is traced again (the 7B answer for 14 GiB: 93 traces were
        99 and more when every pruned plan was reopened)."""
        self.ladder.prefetch([c.plan for c in self.deep_rejected])
        for c in self.deep_rejected:
            try:
                with silenced_warnings():
                    evidence = self.ladder.full.evaluate(c.plan)
            except UserError:
                return False
            if not evidence.over(self.budget.bytes):
                return False
            c.used_bytes = evidence.used_bytes
        return True

    def _deep_agrees(self) -> bool:
        """NOTE [ Deep stream checked ]: every full trace at hand within the deep rung's margin."""
        if not self.deep_rejected or not self.trust_deep:
            return True
        fitting = []  # (ruled out, and fits by its full trace)
        for c in self.deep_rejected:  # (traced alongside: NOTE [ A full trace for the deep rung's check, alongside ])
            if self.ladder.has_full_trace(c.plan):
                try:
                    with silenced_warnings():
                        full = self.ladder.full.evaluate(c.plan)  # (no new trace)
                except UserError:
                    continue
                if full.used_bytes <= self.budget.bytes:
                    fitting.append((full.used_bytes, c.used_bytes))
        margin = Fidelity.DEEP.margin
        checked = self.ladder.full_and_deep()
        missed = [(full, deep) for full, deep in checked if abs(deep - full) > margin * full] + fitting
        if checked and not missed:
            return True
        why = (f"missed a full trace ({fmt_bytes(missed[0][0])}) by more than {margin:.1%} "
               f"({fmt_bytes(missed[0][1])})") if missed else "had no full trace to be checked against"
        self.notes.append(f"reserved bytes at full depth from the shallow traces' allocations {why}: the "
                          f"{len(self.deep_rejected)} plans they ruled out were traced instead")
        return False

    def _distrust_deep(self, ranked: list[Candidate], c: Candidate | None) -> None:
        """Put the plans the deep rung ruled out back into the queue (and those pruned, which may
        have been pruned for them), with ``c``, and walk on without it."""
        self.trust_deep = False
        for x in [*self.deep_rejected, *(x for x in ranked if x.status is Status.PRUNED), *([c] if c else [])]:
            if x in self.failed:
                self.failed.remove(x)
            if x is not c:
                x.reopen()
                x.recall(self.ladder.evidence(x.plan))
            heapq.heappush(self.heap, (x.seconds, self.order[id(x)], x))
        self.deep_rejected.clear()

    def _check_feasible(self, ranked: list[Candidate]) -> bool:
        """Trace the maximal plans (they dominate every plan). False if none of them fits (then
        nothing does); else they go back into the queue at their measured times. Those that split
        the batch are traced only when none of the others may fit (NOTE [ Split maximal plans
        last ])."""
        self.maximal = maximal(sorted(ranked, key=lambda x: x.seconds), self.bs)
        whole = [m for m in self.maximal if not splits(m.plan, self.bs)]
        split = [m for m in self.maximal if splits(m.plan, self.bs)]
        for group in (whole, split):
            todo = [m for m in group if m.used_bytes is None]
            for m in todo:
                m.reopen()  # (an estimate may have called it too big)
            with silenced_warnings():
                self.ladder.measure_together([m.plan for m in todo])  # (on the workers at once)
            for m in todo:
                self._measure(m)
            if any(m.used_bytes is not None for m in group) and self._some_maximal_may_fit():
                break
        else:
            if any(m.used_bytes is not None for m in self.maximal):
                return False
        for m in self.maximal:
            if m.open:
                heapq.heappush(self.heap, (m.seconds, self.order[id(m)], m))
        return True

    def _some_maximal_may_fit(self) -> bool:
        tops = [m for m in self.maximal if m.used_bytes is not None]
        if all(m.status is Status.TOO_BIG for m in tops):
            return False
        near = [m for m in tops if m.status is not Status.TOO_BIG and not self.ladder.is_final(m.plan)]
        if near and all(m.used_bytes >= NEAR_BUDGET * self.budget.bytes for m in near):
            # NOTE [ A borderline answer decided by the maximal plans' full traces ]
            self.ladder.prefetch([m.plan for m in near])
            for m in near:
                self._take(m, self.ladder.full)
            if all(m.status is Status.TOO_BIG for m in tops):
                return False
        return True

    def smallest(self, ranked: list[Candidate]) -> Candidate | None:
        """The traced plan with the smallest footprint, confirmed by the top rung."""
        traced = [c for c in ranked if c.used_bytes is not None and c.status is not Status.INVALID]
        for best in sorted(traced, key=lambda c: c.used_bytes):
            if self.ladder.is_final(best.plan) or self._take(best, self.ladder.full):
                return best
        return None


def splits(plan: Plan, bs: int) -> bool:
    """The plan splits the batch into micro-batches (NOTE [ Split maximal plans last ])."""
    return plan.micro_batches(bs)[1] > 1


def maximal(ranked: list[Candidate], bs: int) -> list[Candidate]:
    """Plans that no other plan dominates in memory saving (fastest first). One pass that keeps the
    maximal plans so far (dominance is transitive): O(plans x maximal plans), not O(plans^2)."""
    def dominates(d: Candidate, c: Candidate) -> bool:
        return saves_no_more_than(c.plan, d.plan, bs) and not saves_no_more_than(d.plan, c.plan, bs)
    out: list[Candidate] = []
    for c in ranked:
        if not any(dominates(m, c) for m in out):
            out = [m for m in out if not dominates(c, m)] + [c]
    order = {id(c): i for i, c in enumerate(ranked)}
    return sorted(out, key=lambda c: order[id(c)])
