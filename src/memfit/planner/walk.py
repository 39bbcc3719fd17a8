"""The walk: candidates fastest first, each climbing the evidence ladder until one fits.

A priority queue on predicted time. A visited plan climbs the ladder (memfit.planner.ladder): an
estimate well over the budget rules it out untraced; its first rung's evidence (the CPU: a full
trace; GPU presets: a shallow pair, which also gives its own time) either rules it out or lets it
on; slower than its estimate, it goes back into the queue at its new time; the deep rung may rule
it out; its top rung (a full trace, or its deep stream checked at a third depth) confirms it. The
first plan that comes out fastest with final figures that fit is chosen.

Pruning: a plan that saves no more memory than one that did not fit cannot fit (techniques are
assumed not to *add* memory; the failures and what they rule out: memfit.planner.failures). The
maximal plans (none saves less than another everywhere) are traced after
``WALK_BEFORE_FEASIBILITY`` traces (memfit.planner.feasibility; first, when no plan measured before
the walk fits: NOTE [ Maximal plans first when nothing measured fits ]): when none of them fits,
nothing does.
"""

from __future__ import annotations

import heapq

from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.planner.candidate import Candidate, Fidelity, Status
from memfit.planner.failures import Failures
from memfit.planner.feasibility import MaximalPlans
from memfit.planner.ladder import Evaluator, Ladder
from memfit.planner.progress import NoProgress
from memfit.planner.time_model import StepTimeModel
from memfit.quiet import silenced_warnings
from memfit.units import fmt_bytes

WALK_BEFORE_FEASIBILITY = 8
"""Traces of the fastest plans before checking that any plan fits at all."""
LOOK_AHEAD = 16
"""Queued plans looked at for the one measured alongside (NOTE [ The next plan measured alongside ])."""


# NOTE [ Maximal plans first when nothing measured fits ]
# The time model measures the default plan and each value alone before the walk (GPU presets). When
# none of them fits, the answer needs several techniques together, and the fastest plans (few
# techniques) are the least likely to fit: the walk then traces the maximal plans first, whose
# failures prune every plan they dominate. Where a value alone fits, the fastest plans are tried
# first: the maximal plans may cost more traces than they save. Measured: docs/planner-notes.md.


class Walk:
    def __init__(self, batch_size: int, budget: Budget, model: StepTimeModel, ladder: Ladder, steps: int | None,
                 max_traces: int, progress=None, alongside: bool = True) -> None:
        self.bs, self.budget, self.model, self.ladder = batch_size, budget, model, ladder
        self.alongside = alongside
        """Idle workers trace the next plan's shallow pair while one is measured, and the next plans'
        full traces while one is confirmed (False: the searches of ``--methods`` share the cores)."""
        self.progress = progress or NoProgress()
        self.steps, self.max_traces = steps, max_traces
        self.failed = Failures(batch_size, budget.bytes)
        self.evaluated = 0
        self.maximal = MaximalPlans(batch_size, budget, ladder)
        self.before_feasibility = WALK_BEFORE_FEASIBILITY
        """Plans traced before the maximal ones."""
        self.limited = False
        """The trace limit left a faster plan untraced."""
        self.notes: list[str] = []
        self.over_host: dict[tuple, Candidate] = {}  # (by _host_copies: NOTE [ A plan over the host's memory ])
        self.heap: list = []
        self.order: dict[int, int] = {}

    @property
    def traces(self) -> int:
        return self.ladder.traces

    def run(self, ranked: list[Candidate]) -> Candidate | None:
        self.ranked = ranked  # (the recipes: NOTE [ The recipes' traces alongside ])
        measured = [e for e in (self.ladder.evidence(c.plan) for c in ranked) if e is not None]
        if measured and all(e.over(self.budget.bytes) for e in measured):  # NOTE [ Maximal plans first when nothing measured fits ]
            self.before_feasibility = 0
        self.heap = [(c.seconds, i, c) for i, c in enumerate(ranked)]
        heapq.heapify(self.heap)
        self.order = {id(c): i for i, c in enumerate(ranked)}
        deep = self.ladder.deep
        while True:
            chosen = self._walk(ranked)
            if chosen is None and deep is not None and deep.rejected and deep.trusted and not self.limited:
                if not deep.rejections_hold(self.ladder, self.budget.bytes):
                    self.notes.append(f"nothing fitted after {len(deep.rejected)} plans were ruled out by "
                                      "their reserved bytes at full depth from shallow traces, and a full trace "
                                      "of one fits: every plan they ruled out was traced instead")
                    self._distrust_deep(ranked, None)
                    continue
                deep.rejected.clear()  # (confirmed by their full traces: real failures)
            if chosen is not None or self.limited or self.maximal.plans is not None:
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
            if self._pruned(c):
                continue
            if self.evaluated >= self.max_traces and not self.ladder.has_evidence(c.plan):
                self._stop_at_limit(c)
                return None
            if self.maximal.plans is None and self.evaluated >= self.before_feasibility:
                if not self._check_feasible(ranked):
                    return None
                if not c.open or self._pruned(c):
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
            why = self.ladder.deep.disagreement(self.ladder, self.budget.bytes) if self.ladder.deep else None
            if why:  # NOTE [ Deep stream checked ]: then the plans it ruled out are traced
                self.notes.append(why)
                self._distrust_deep(ranked, c)
                continue
            c.choose()
            return c
        return None

    def _pruned(self, c: Candidate) -> bool:
        """``c`` ruled out by the failures, and pruned with their reason."""
        if (why := self.failed.rule_out(c)) is None and (x := self.over_host.get(_host_copies(c.plan))) is not None:
            why = f"holds the same host copies as {x.plan.describe()}, over the host memory (not traced)"
        if why is not None:
            c.prune(why)
        return why is not None

    def _requeued(self, c: Candidate) -> bool:
        """Slower than the fastest plan left (its time was measured): back in the queue at its time."""
        if slower := bool(self.heap) and c.seconds > self.heap[0][0]:
            heapq.heappush(self.heap, (c.seconds, self.order[id(c)], c))
        return slower

    def _stop_at_limit(self, c: Candidate) -> None:
        """A faster plan left untraced: no choice can be called the fastest that fits."""
        for _, _, x in [(None, None, c), *self.heap]:
            if x.open:
                x.note(f"trace limit ({self.max_traces}) reached")
        self.heap.clear()
        self.limited = True

    def _estimated_too_big(self, c: Candidate) -> bool:
        rung = self.ladder.estimate if c.recipe is None else None  # (NOTE [ A recipe is never ruled out by an estimate ])
        estimate = rung.evaluate(c.plan) if rung is not None else None
        if estimate is None or not estimate.over(self.budget.bytes):
            return False
        c.reject(f"estimated to need {fmt_bytes(estimate.used_bytes)} > budget {fmt_bytes(self.budget.bytes)} (not traced)")
        return True

    # NOTE [ The next plan measured alongside ]
    # A shallow pair is two traces of unequal length, so with one pair at a time one of two workers
    # waits. Where workers are spare, the walk measures the plan it visits together with the one it would
    # measure next were this one too big (queued next, untraced, not pruned by the plans that failed nor
    # by this one, not estimated too big). The second one's evidence is taken at once: too big, it prunes
    # the plans it saves no more than before the walk reaches them; slower than estimated, it waits in the
    # queue behind the faster estimates even where its evidence is final. Its traces are wasted only when
    # the first plan is chosen, or its measured time sends it behind plans that fit. The searches of
    # ``--methods`` share the cores, and measure one plan at a time (``alongside=False``).
    # Measured: docs/planner-notes.md.
    #
    # NOTE [ The next round's traces in the background ]
    # Most plans the walk measures are over the budget at the shallower depth, so their deeper traces
    # are skipped, and a round of two plans would end with a worker idle. So each round queues the
    # shallower traces of the plans that would come next, were the two plans of the round to fail (the
    # next round's pair), in the background (memfit.planner.workers): a worker the round leaves idle
    # starts them, and the next round takes their results. Each round replaces the queue; a trace that
    # started for a plan the round then pruned is wasted, on a worker that would have idled.
    # Measured: docs/planner-notes.md.
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
        """The ``n`` plans queued next that the walk would measure if ``c`` (and each before it) did not fit: open, untraced,
        not pruned by a failure or by ``c`` or those before it, not estimated too big (by an estimate needing no trace)."""
        if not self.alongside or self.ladder.spare_workers < 1 or self.evaluated + 1 >= self.max_traces:
            return []
        estimate, out = self.ladder.estimate, []
        for _, _, x in heapq.nsmallest(LOOK_AHEAD, self.heap):
            if x is c or not x.open or x.used_bytes is not None or self.ladder.traced(x.plan):
                continue
            if self.failed.rule_out(x) or self.failed.would_rule_out(x, (c, *out)) or _host_copies(x.plan) in self.over_host:
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
        elif self.budget.host_over(evidence.host_bytes):  # NOTE [ A plan over the host's memory ]
            c.reject(f"needs {fmt_bytes(evidence.host_bytes)} of host memory > {fmt_bytes(self.budget.host_bytes)} "
                     "(--host-memory)")
            self.over_host[_host_copies(c.plan)] = c
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
        self.failed.add(c)

    def _too_big_deep(self, c: Candidate) -> bool:
        """A plan whose lower bound fits, ruled out without its full trace by the deep rung."""
        deep = self.ladder.deep
        evidence = deep.rules_out(c.plan, self.ladder, self.budget.bytes) if deep is not None else None
        if evidence is None:
            return False  # (the full trace decides)
        c.used_bytes = evidence.used_bytes
        self._too_big(c, how="reserved, from its shallow traces' allocations replayed at full depth")
        deep.rejected.append(c)
        return True

    def _confirm_ahead(self, c: Candidate) -> None:
        """Run ``c``'s full trace alongside those of the next plans that may come up for confirming (measured, their
        lower bound fits), or the recipes' first rung, on the workers that would otherwise wait."""
        if (spare := self.ladder.spare_workers if self.alongside else 0) <= 0 or (ladder := self.ladder).has_full_trace(c.plan):
            return  # (nothing to run alongside)
        recipes = [x.plan for x in self.ranked if x.recipe is not None and x.open and not ladder.traced(x.plan)]
        ahead: dict = {}
        for _, _, x in heapq.nsmallest(len(self.heap), self.heap) if not recipes else ():  # NOTE [ The recipes' traces alongside ]
            if len(ahead) == spare:
                break
            if x is not c and x.open and ladder.has_evidence(x.plan) and not ladder.is_final(x.plan) \
                    and not ladder.has_full_trace(x.plan) and x.used_bytes is not None \
                    and x.used_bytes <= self.budget.bytes and _compiles_as(x.plan, c.plan) and not self._too_big_deep(x):
                ahead[x.plan] = None
        check = ladder.deep.to_check_alongside(ladder) if len(ahead) < spare and ladder.deep is not None else None
        if check is not None:
            ahead[check] = None  # NOTE [ A full trace for the deep rung's check, alongside ]
        ladder.prefetch([c.plan, *ahead], behind=recipes)

    def _distrust_deep(self, ranked: list[Candidate], c: Candidate | None) -> None:
        """Put the plans the deep rung ruled out back into the queue (and those pruned, which may
        have been pruned for them), with ``c``, and walk on without it."""
        rejected = self.ladder.deep.withdraw()
        for x in [*rejected, *(x for x in ranked if x.status is Status.PRUNED), *([c] if c else [])]:
            if x in self.failed:
                self.failed.remove(x)
            if x is not c:
                x.reopen()
                x.recall(self.ladder.evidence(x.plan))
            heapq.heappush(self.heap, (x.seconds, self.order[id(x)], x))

    def _check_feasible(self, ranked: list[Candidate]) -> bool:
        """Trace the maximal plans (memfit.planner.feasibility): False if none of them fits (then
        nothing does); else they go back into the queue at their measured times."""
        space = [c for c in ranked if c.recipe is None]  # (a field recipe is outside the space: none it dominates)
        if not self.maximal.check(space, self._measure, lambda m: self._take(m, self.ladder.full)):
            return False
        for m in self.maximal.plans + self.maximal.witnesses:
            if m.open:
                heapq.heappush(self.heap, (m.seconds, self.order[id(m)], m))
        return True

    def settle(self, c: Candidate, chosen: Candidate | None, within: float = 0.0) -> Candidate | None:
        """A plan the walk left open, weighed against ``chosen`` (a field recipe; a simpler plan):
        measured on the first rung, then, where it fits and is predicted faster than ``chosen`` (or
        by ``within`` of its time slower at most), confirmed by the top rung. Returns ``c`` where it
        should be chosen instead; it stays open (to be outrun) where it is slower."""
        if not c.open:
            return None
        if not self.ladder.has_evidence(c.plan):
            self.evaluated += 1
        if not self._take(c, self.ladder.first) or not c.open:
            return None
        if chosen is not None and c.seconds >= chosen.seconds * (1 + within):
            return None
        if not self.ladder.is_final(c.plan) and (self._too_big_deep(c) or not self._take(c, self.ladder.full)
                                                 or not c.open):
            return None
        return c if chosen is None or c.seconds < chosen.seconds * (1 + within) else None

    def smallest(self, ranked: list[Candidate]) -> Candidate | None:
        """The traced plan with the smallest footprint, confirmed by the top rung. A plan's lower bound
        may be below another's confirmed footprint and its own above it: plans are confirmed in the
        order of their bounds until no bound left is below the smallest footprint confirmed."""
        traced = [c for c in ranked if c.used_bytes is not None and c.status is not Status.INVALID and
                  not self.budget.host_over(c.host_bytes)]  # (NOTE [ A plan over the host's memory ])
        best = None
        for c in sorted(traced, key=lambda c: c.used_bytes):
            if best is not None and c.used_bytes >= best.used_bytes:
                break
            if (self.ladder.is_final(c.plan) or self._take(c, self.ladder.full)) and \
                    (best is None or c.used_bytes < best.used_bytes):
                best = c
        return best


# NOTE [ A plan over the host's memory ]
# Offloaded states and activations and swapped blocks live in the training machine's memory, and
# a plan that fits the card but not that machine is killed by the OS (memfit.memory.budget). Where
# the budget knows that machine's memory, a plan whose host peak is over it is rejected at the rung
# that finds it (a shallow pair's host bytes are on the line through its depths; the full trace
# decides the chosen plan's). It does not rule out other plans (memfit.planner.failures): the
# failures' order is the device's, and a plan saving more device memory may well hold more on
# the host. Nor is it the smallest footprint when nothing fits: no device budget would fit it.
# What it rules out are the plans that hold the same copies on the host: those that differ from it
# only in fields no host copy depends on (:func:`_host_copies`). Without that, the walk traced each
# optimizer and allocator variant of a plan over the host (Wan 1.3B's LoRA on rtx4060 with 32 GB:
# 112 traces, 359 s).
def _host_copies(plan) -> tuple:
    """``plan`` without the fields its host copies do not depend on: the allocator, and, where no
    optimizer state is on the host, the optimizer and when it steps (offloaded activations and swapped
    weights are the same whichever optimizer updates the trained ones)."""
    free = {"allocator"} | (set() if plan.config("offload").states else {"optimizer", "optimizer_in_backward",
                                                                          "bf16_update"})
    return tuple((k, str(v)) for k, v in sorted(plan.to_dict().items()) if k not in free)


def _compiles_as(plan, other) -> bool:
    """``plan``'s full trace compiles nothing ``other``'s does not: it may run alongside ``other``'s
    confirming full trace (a compiled plan's full trace compiles for many times an eager one's
    seconds, and the confirmation waits for every trace run beside it)."""
    mode = plan.config("compile").mode
    return mode in ("none", other.config("compile").mode)


# NOTE [ The recipes' traces alongside ]
# The field recipes the walk has not measured are measured after it, whichever plan it chooses (each
# is listed with figures of its own: memfit.planner.field_recipes), while a full trace of the next plan
# alongside a confirmation is of use only if the confirmation fails. So where a recipe is left to
# measure, the workers the confirmation leaves idle trace the recipes' shallow pairs in its place (in
# the background: the recipes' turn takes them), and the next plans' full traces are not run ahead. A
# deep rung's check still runs first (without it, every plan it ruled out is traced in full after the
# choice). Qwen2.5-7B's QLoRA on a 24 GB card: the three recipes' pairs took 8.6 s after a 25 s
# confirmation; measured: docs/planner.md.


# NOTE [ A recipe is never ruled out by an estimate ]
# The estimate rung adds each value's saving measured alone, and a saving measured alone can be less
# than the same value's in a combination: where the peak moves. Llama-3-8B sizes, bf16-pure, at 2 x
# 2048: alone, stepping in backward saves nothing (the peak is at the start of backward, before any
# gradient); with blocks checkpointed and paged states, the peak is the gradients', which it frees.
# So torchtune's recipe was estimated at 29.40 GiB for a 21.28 GiB budget and listed "too big (not
# traced)" on the h200-141gb preset, where its own traces (with --steps, which searches compile)
# fit it. A field recipe is a few plans that the report lists with figures of their own: it is traced.
