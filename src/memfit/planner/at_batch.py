"""A plan at any batch size, for the questions asked of many batches (``memfit fit``, and the largest
batch that fits): the trace book's figures of a plan at ``batch`` samples a rank.

NOTE [ A book for every batch ]
``memfit fit`` asks one book (one card architecture) for each plan at many batch sizes and rank
counts (a job's batch is one rank's, of its plan's ranks): the cards' capacities differ, their
plans' bytes do not. A plan at a batch is measured as the walk's top rungs measure one: the shallow
pair's allocations replayed at full depth (the reserved bytes, equal to a full trace's on every plan
seen: NOTE [ Allocations at full depth ] in memfit.memory.deep_stream), or a full trace where the
pair's streams do not line up or the model has no shallow pair.

NOTE [ A plan's line in the batch ]
A dozen cards ask a plan at a dozen batches, two each (the largest that fits, and the next), and
each batch costs a shallow pair: on Llama-2-7B about 1-2.5 s of CPU a trace, most of ``memfit fit``'s
time. But the step at ``x`` samples makes the allocations the steps at two other batches make, each
of a size on the line through theirs (NOTE [ Allocations at another batch ] in memfit.memory.stream_sizes), and its ops are theirs
on the same line. So once a plan is traced at two batches (of at least two samples, ``LINE_FROM``), its figures at any other are drawn: the
allocations at full depth on the line, replayed through the caching-allocator model (the reserved
bytes, fragmentation and all, not a line through two totals), and the ops on the line for the time.
A line is trusted only once it has drawn a third batch traced for real, allocation for allocation
(and op for op); where it has not (a kernel chosen by size, a size off the line), the plan is
traced at every batch, as before. So a plan costs three batches' traces whatever the cards ask.

NOTE [ A line drawn at full depth ]
Drawing a batch on the line widened each depth's shallow stream to the batch and deepened the two to
full depth: the deepening diffs the two streams, 85 ms a batch on Llama-2-7B, and ``memfit fit`` draws
a hundred batches in the planner's own process while the workers trace. The streams at full depth of
the two batches traced are kept (their replays gave those batches' figures), so where they are the same
events throughout (the model's build included: the replay starts there) the batch is drawn on their
line directly, 25-35 ms. Widening and deepening commute where the events pair one to one: ``memfit fit
llama`` drew 43 batches of its plans without swapped blocks to the same allocations both ways (tokens,
frees and phases). With every block swapped they do not: each block's forward frees copies of the same
sizes, and the shallow runs of frees, widened, paired some frees with another block's copy. The default
allocator's reserved bytes are the same either way, but expandable segments' are not: Llama-2-7B's
swapped LoRA at 13 samples on an RTX 4080 drew 15,240,003,584 B where its full trace needs 15,219,032,064 B,
just within the card's budget, and the line at full depth draws that to the byte (and at 13 on an RTX
4060 Ti, 6 on an RTX 4060 and an RTX 3070: four cells of ``memfit fit llama``, each now its full trace's
figure). Where the two builds differ (a worker's first trace may build otherwise), the shallow streams
are widened and deepened, as before. The line's check draws the third batch from the first two, the
way their streams allow; later batches are drawn from the smallest and the largest batch traced, which
may go the other way where those two builds differ.
"""

from __future__ import annotations

import math
import time

from memfit.memory.categories import STEADY_STEP
from memfit.memory.deep_stream import Stream, deepen, replay, step_events
from memfit.memory.stream_sizes import Paired, pair_up, widen
from memfit.planner.measured import PEAK_MARGIN, Measured, ShallowFailed
from memfit.planner.shallow import OpsOnLine, extrapolate, extrapolate_ops, ops_line_up
from memfit.planner.turns import current as current_turns
from memfit.plans import Plan

TRUSTED, BROKEN = "trusted", "broken"

LINE_FROM = 2
"""The smallest batch on a plan's line. One sample is not: a tensor with a batch dimension of 1 is
contiguous where more samples make it strided, so a reshape that views it at one sample copies it at
two (the chunked loss's shifted labels)."""


class AtBatch:
    """The trace book's figures of a plan at a batch (the module's NOTEs). A mixin of
    memfit.planner.traces.TraceBook: it uses its ``depths``, ``depth``, ``_run``, ``_shallow_lower`` and
    ``workers`` (pumped before a figure is computed here: NOTE [ One pool for many books ] in
    memfit.planner.workers)."""

    def _start_batches(self) -> None:
        self._at: dict[tuple[Plan, int], Measured] = {}
        """(plan, batch) -> its figures."""
        self._streams: dict[tuple[Plan, int], tuple[Stream, int]] = {}
        """(plan, batch) traced -> its allocations at full depth, and their reserved bytes."""
        self._lines: dict[Plan, str] = {}
        """A plan -> whether its line drew a third batch (TRUSTED) or not (BROKEN)."""
        self._paired: dict[tuple, Paired | None] = {}
        """(plan, depth, x_a, x_b) -> its two traces' events paired (memfit.memory.stream_sizes.pair_up; depth None:
        the streams at full depth, NOTE [ A line drawn at full depth ])."""
        self._drawn: dict[tuple[Plan, int], Stream] = {}
        """(plan, batch) drawn on its line -> its allocations at full depth."""
        self._expanded: dict[tuple[Plan, int], int | None] = {}
        """(plan, batch) -> what the budget counts of it with expandable segments."""
        self._ops_line_up: dict[tuple, bool] = {}
        """(plan, x_a, x_b, which) -> whether the ops at the two batches line up (:meth:`_line_up`)."""
        self._tracing: dict[Plan, int] = {}
        """A plan -> its batches being traced now, by searches in turns (:meth:`_after_others`)."""

    def at_batch(self, plan: Plan, batch: int) -> Measured:
        """``plan`` at ``batch`` samples a rank: what the budget counts and its ops at full depth
        (NOTE [ A book for every batch ]; drawn on its line where it has one, NOTE [ A plan's line in
        the batch ])."""
        key = (plan, batch)
        if key not in self._at:
            self._after_others(plan)
        if key not in self._at:
            self.workers.pump()  # (the background traces while the figures are computed here)
            drawn = self._draw(plan, batch) if self._lines.get(plan) == TRUSTED and batch >= LINE_FROM else None
            if drawn:
                self._drawn[key] = drawn[1]
            self._at[key] = drawn[0] if drawn else self._traced_at(plan, batch)
        return self._at[key]

    def _after_others(self, plan: Plan) -> None:
        """Where searches take turns (NOTE [ Searches in turns ] in memfit.planner.turns) and another is
        tracing ``plan`` at a batch while its line is undecided: wait for that batch, which may decide the
        line, so that this batch is drawn on it, as it would be asked after, and costs no trace."""
        turns = current_turns()
        if turns is not None and plan not in self._lines and self._tracing.get(plan):
            turns.wait(lambda: plan in self._lines or not self._tracing.get(plan))

    def has_at(self, plan: Plan, batch: int) -> bool:
        """``plan``'s figures at ``batch`` cost no trace: kept, or drawn on its line."""
        return (plan, batch) in self._at or (self._lines.get(plan) == TRUSTED and batch >= LINE_FROM)

    def expanded_used(self, plan: Plan, batch: int) -> int | None:
        """:meth:`at_batch`'s ``used_bytes`` with expandable segments: the same allocations replayed by the
        other allocator model (NOTE [ Expandable segments where they decide the fit ] in
        memfit.planner.traces); None where there is no such figure."""
        key = (plan, batch)
        if key not in self._expanded:
            stream = self.stream_at(plan, batch)
            self.workers.pump()
            if stream is not None:
                t0 = time.process_time()
                used = replay(stream, STEADY_STEP, expandable=True)[1] + self.target.device.context_bytes
                self._spend("expandable replay", time.process_time() - t0)
            else:
                t = self._traced.get((plan, None, batch))
                used = getattr(t, "expandable_used_bytes", None)
            self._expanded[key] = used
        return self._expanded[key]

    def stream_at(self, plan: Plan, batch: int) -> Stream | None:
        """The allocations at full depth behind ``plan``'s figures at ``batch`` (None: a full trace's)."""
        self.at_batch(plan, batch)
        kept = self._streams.get((plan, batch))
        return kept[0] if kept else self._drawn.get((plan, batch))

    def shallow_lower(self, plan: Plan, batch: int) -> int:
        """A lower bound of what ``plan`` at ``batch`` needs from its shallower trace alone (more blocks
        hold no less; a full trace where it has no shallow pair; exact where the plan has a line)."""
        if self.has_at(plan, batch):
            return self.at_batch(plan, batch).used_bytes
        pair = self.depths(plan)
        if pair:
            try:
                (t,) = self._run([(plan, pair[0], batch)])
                return self._shallow_lower(t)
            except ShallowFailed:
                pass
        return self.at_batch(plan, batch).used_bytes

    def lines(self) -> dict[str, int]:
        """How many plans' lines are trusted, and how many broke."""
        values = list(self._lines.values())
        return {TRUSTED: values.count(TRUSTED), BROKEN: values.count(BROKEN)}

    # -- traced, and drawn -----------------------------------------------------------------------
    def _traced_at(self, plan: Plan, batch: int) -> Measured:
        self._tracing[plan] = self._tracing.get(plan, 0) + 1
        try:
            m = self._deep_at(plan, batch) or self._full_at(plan, batch)
        finally:
            self._tracing[plan] -= 1
        if plan not in self._lines and (plan, batch) in self._streams and batch >= LINE_FROM:
            others = sorted(b for p, b in self._streams if p == plan and b != batch and b >= LINE_FROM)
            if len(others) >= 2:  # a third batch: does the line through the first two draw it?
                drawn = self._draw(plan, batch, others[0], others[1])
                self._lines[plan] = TRUSTED if drawn and _same(*drawn, m, self._streams[(plan, batch)][0]) else BROKEN
        return m

    def _draw(self, plan: Plan, batch: int, x_a: int | None = None, x_b: int | None = None) \
            -> tuple[Measured, Stream] | None:
        """``plan`` at ``batch`` on the line through two batches it was traced at (by default the
        smallest and the largest: a long base), and its allocations; None where the line does not hold."""
        if x_a is None:
            traced = sorted(b for p, b in self._streams if p == plan and b != batch and b >= LINE_FROM)
            if len(traced) < 2:
                return None
            x_a, x_b = traced[0], traced[-1]
        a, b = self._at[(plan, x_a)], self._at[(plan, x_b)]
        stream = self._widened_deep(plan, x_a, x_b, batch)
        if stream is None:
            shallow = []
            for d in self.depths(plan):  # (each depth's allocations at ``batch``, then at full depth)
                t_a, t_b = self._traced[(plan, d, x_a)], self._traced[(plan, d, x_b)]
                key = (plan, d, x_a, x_b)
                if key not in self._paired:
                    self._paired[key] = pair_up(t_a.stream, t_b.stream)
                shallow.append(widen(t_a.stream, t_b.stream, x_a, x_b, batch, self._paired[key]) if self._paired[key] else None)
            stream = deepen(*shallow, *self.depths(plan), self.depth) if len(shallow) == 2 and None not in shallow else None
        if stream is None:
            return None
        ops, pair = None, None
        if a.ops is not None and b.ops is not None:
            if not self._line_up(plan, x_a, x_b, 0, a.ops, b.ops):
                return None
            ops = OpsOnLine(a.ops, b.ops, x_a, x_b, batch)
        elif a.pair is not None and b.pair is not None:
            if not all(self._line_up(plan, x_a, x_b, i + 1, u, v) for i, (u, v) in enumerate(zip(a.pair[:2], b.pair[:2]))):
                return None
            pair = (*(OpsOnLine(u, v, x_a, x_b, batch) for u, v in zip(a.pair[:2], b.pair[:2])), *b.pair[2:])
        else:
            return None
        peak, reserved = replay(stream, STEADY_STEP, expandable=plan.config("allocator").expands)
        context = b.used_bytes - self._streams[(plan, x_b)][1]
        managed, host = (round(u + (v - u) * (batch - x_a) / (x_b - x_a))
                         for u, v in ((a.managed_bytes, b.managed_bytes), (a.host_bytes, b.host_bytes)))
        return Measured(peak_bytes=peak, used_lower=int(peak * (1 - PEAK_MARGIN)) + context,
                        used_bytes=reserved + context, ops=ops, pair=pair, managed_bytes=managed,
                        host_bytes=host), stream

    def _widened_deep(self, plan: Plan, x_a: int, x_b: int, batch: int) -> Stream | None:
        """``plan``'s allocations at full depth at ``batch`` on the line through those at ``x_a`` and ``x_b``
        (NOTE [ A line drawn at full depth ]); None where the two are not the same events throughout, a size
        is off the line of whole bytes, or a reduction has no staging buffer at ``batch``."""
        key = (plan, None, x_a, x_b)
        if key not in self._paired:
            self._paired[key] = pair_up(self._streams[(plan, x_a)][0], self._streams[(plan, x_b)][0],
                                        setups_may_differ=False)
        paired = self._paired[key]
        return widen(paired.a, paired.b, x_a, x_b, batch, paired) if paired else None

    def _line_up(self, plan: Plan, x_a: int, x_b: int, which: int, a: list, b: list) -> bool:
        """Whether the ops ``a`` and ``b`` of ``plan`` at ``x_a`` and ``x_b`` samples (``which``: the full
        depth's, or a depth's of the pair) are the same ops, checked once for every batch drawn on them."""
        key = (plan, x_a, x_b, which)
        if key not in self._ops_line_up:
            self._ops_line_up[key] = x_a != x_b and ops_line_up(a, b)
        return self._ops_line_up[key]

    def _deep_at(self, plan: Plan, batch: int) -> Measured | None:
        pair = self.depths(plan)
        if not pair:
            return None
        try:
            a, b = self._run([(plan, d, batch) for d in pair])
        except ShallowFailed:
            return None
        deep = deepen(a.stream, b.stream, *pair, self.depth) if a.stream and b.stream else None
        if deep is None:
            return None
        # (the replay's peak: the line's is low where the peak moves between phases with the depth, every
        # block swapped: NOTE [ Stacks of two depths ] in memfit.planner.shallow)
        peak, reserved = replay(deep, STEADY_STEP, expandable=plan.config("allocator").expands)
        self._streams[(plan, batch)] = deep, reserved
        ops = extrapolate_ops(a.ops, b.ops, *pair, self.depth)
        managed = int(extrapolate(a.managed_bytes, b.managed_bytes, *pair, self.depth))
        host = int(extrapolate(a.host_bytes, b.host_bytes, *pair, self.depth))
        return Measured(peak_bytes=peak, used_lower=int(peak * (1 - PEAK_MARGIN)) + b.context_bytes,
                        used_bytes=reserved + b.context_bytes, ops=ops,
                        pair=None if ops is not None else (a.ops, b.ops, *pair, self.depth), managed_bytes=managed,
                        host_bytes=host)

    def _full_at(self, plan: Plan, batch: int) -> Measured:
        (t,) = self._run([(plan, None, batch)])
        return Measured(peak_bytes=t.peak_bytes, used_lower=t.peak_bytes + t.context_bytes, used_bytes=t.used_bytes,
                        ops=t.ops, full=True, managed_bytes=t.managed_bytes, host_bytes=t.host_bytes)


def _same(drawn: Measured, drawn_stream: Stream, traced: Measured, stream: Stream) -> bool:
    """The line drew the traced batch: the same allocations at full depth, the same bytes, and its ops
    within rounding."""
    if step_events(drawn_stream) != step_events(stream):
        return False
    if (drawn.used_bytes, drawn.managed_bytes) != (traced.used_bytes, traced.managed_bytes):
        return False
    pairs = [(drawn.ops, traced.ops)] if drawn.ops is not None else list(zip(drawn.pair[:2], traced.pair[:2]))
    for x, y in pairs:
        if x is None or y is None or len(x) != len(y):
            return False
        for u, v in zip(x, y):
            if u._replace(flops=0, nbytes=0, host_bytes=0, elements=0, key=0) != \
                    v._replace(flops=0, nbytes=0, host_bytes=0, elements=0, key=0):
                return False
            if not all(math.isclose(p, q, rel_tol=1e-6, abs_tol=1) for p, q in
                       ((u.flops, v.flops), (u.nbytes, v.nbytes), (u.host_bytes, v.host_bytes), (u.elements, v.elements))):
                return False
    return True

