"""The trace books ``memfit fit`` asks (memfit.planner.fit): one per card architecture, and a plan's
figures shared by the architectures where it traces alike.

NOTE [ One book per architecture ]
A plan's bytes do not depend on the card's capacity: only on what the trace's kernels depend on
(memfit.devices.architecture: compute capability, CUDA and cuDNN, dtypes, workspaces). So the cards
are grouped by architecture, and each group has one trace book (memfit.planner.traces.TraceBook, on
one pool of worker processes) that every card of the group asks, at the batches and rank counts its
capacity leads to (NOTE [ A book for every batch ] in memfit.planner.at_batch): the book's context
is replaced by each card's own. Once a plan is traced at three batches, its other batches are drawn
on its line (NOTE [ A plan's line in the batch ]), so a card costs a plan no trace of its own.

NOTE [ Architectures that trace alike ]
Most plans trace alike on most architectures: an sm86 and an sm89 card pick the same attention
kernel and the same cuBLAS workspace for a bf16 LoRA, and only some plans differ (4-bit kernels by
compute capability, Hopper's larger workspace, fp16 where a card lacks bf16). Which do is the
kernels' business, not a rule to keep here, so it is measured: before an architecture's book traces
a plan at more than one sample, its shallower trace at one sample is compared with the one each
book opened before it made (allocation for allocation of the step, op for op, and the allocated,
reserved and managed bytes but the context). Where one is the same, that book answers the plan for
both architectures, at every batch, and the plan costs this one a single trace.

NOTE [ What every card asks first ]
Each card's search is a sequence: a plan at one sample, at two, then where the line through them
meets the card's budget (memfit.planner.largest), so its traces run one pair at a time, and one of
the two workers waits while the deeper trace of a pair runs. What every card of an architecture asks
first does not depend on its capacity: each method's recipes at one sample, and its most frugal
recipe at two where one fits the group's largest card. So those are traced together, on every
worker, before the first card's search; and the frugal recipes at three samples too, which draws
their lines (NOTE [ A plan's line in the batch ]) one batch sooner: the first batch a card's search
traces then checks them.
"""

from __future__ import annotations

from memfit.devices import Device, architecture
from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.cuda.reduce import SEMAPHORES, STAGING_BUFFER
from memfit.memory.deep_stream import MARK, step_events
from memfit.planner.space import ModelFacts
from memfit.planner.trace_job import Traced
from memfit.planner.traces import TraceBook
from memfit.plans import Plan
from memfit.target import Target
from memfit.workload import Workload


class Books:
    """Every architecture's trace book, and which one answers each plan for each (the module's NOTEs)."""

    def __init__(self, workload: Workload, facts: ModelFacts) -> None:
        self.workload, self.facts = workload, facts
        self.books: dict[tuple, TraceBook] = {}
        self._answers: dict[tuple[tuple, Plan], TraceBook] = {}
        self.shared = 0
        """Plans an architecture took from another's book."""

    def open(self, device: Device) -> TraceBook:
        """The book of ``device``'s architecture (opened on the first card that asks)."""
        arch = architecture(device)
        if arch not in self.books:
            self.books[arch] = TraceBook(Target(self.workload, Plan(), 1, device), self.facts,
                                         Budget.of_device(device))
        return self.books[arch]

    def for_plan(self, device: Device, plan: Plan) -> TraceBook:
        """The book that answers ``plan`` on ``device``: its architecture's, or an earlier one's where the
        plan traces alike there (NOTE [ Architectures that trace alike ])."""
        arch = architecture(device)
        key = (arch, plan)
        if key not in self._answers:
            own = self.open(device)
            self._answers[key] = own
            for other in self.books.values():
                if other is own:
                    break
                if _alike(other, own, plan):
                    self._answers[key] = other
                    self.shared += 1
                    break
        return self._answers[key]

    def prefetch(self, device: Device, first: list[Plan], others: list[Plan], room: int) -> None:
        """Trace together what every card of ``device``'s architecture asks first (NOTE [ What every card
        asks first ]): each plan at one sample (its shallower trace first: the comparison with the books
        opened before), then those of ``first`` that fit ``room`` bytes at one sample (the group's
        largest budget less its context) at two and three, each on the book that answers it."""
        own = self.open(device)
        plans = list(dict.fromkeys([*first, *others]))
        own._run([(p, own.depths(p)[0], 1) for p in plans if own.depths(p)], check=False)
        self._trace([(self.for_plan(device, plan), plan, 1) for plan in plans], room)
        more = []
        for plan in first:
            book = self.for_plan(device, plan)
            try:
                if book.at_batch(plan, 1).used_bytes - book.target.device.context_bytes <= room:
                    more += [(book, plan, 2), (book, plan, 3)]
            except UserError:  # (a plan this model cannot run: the cell says so)
                pass
        self._trace(more)

    @staticmethod
    def _trace(asks: list[tuple[TraceBook, Plan, int]], room: int | None = None) -> None:
        """Each (book, plan, batch) traced together, on each book's workers, then its figures read in order;
        but those whose shallow pair is over ``room`` bytes (the group's largest budget less its context) by
        its lower bound: where the pair's allocations do not line up at full depth, a full trace would
        measure a plan no card of the group takes."""
        jobs: dict[int, list] = {}
        for book, plan, batch in asks:
            jobs.setdefault(id(book), [book])[1:] += [(plan, d, batch) for d in book.depths(plan) or (None,)]
        for book, *todo in jobs.values():
            book._run(todo, check=False)
        for book, plan, batch in asks:  # (in order: a plan's line)
            try:
                if room is None or book.lower_bound(plan, batch) - book.target.device.context_bytes <= room:
                    book.at_batch(plan, batch)
            except UserError:
                pass

    def close(self) -> tuple[int, int]:
        """Close every book; returns their (traces, full traces)."""
        for book in self.books.values():
            book.close()
        return sum(b.traces for b in self.books.values()), sum(b.full_traces for b in self.books.values())


def _alike(other: TraceBook, own: TraceBook, plan: Plan) -> bool:
    """``plan``'s shallower trace at one sample is the same in both books (``other`` has traced it)."""
    depths = own.depths(plan)
    if not depths or other.depths(plan) != depths:
        return False
    job = (plan, depths[0], 1)
    if job not in other._traced:
        return False
    (theirs,), (ours,) = other._run([job], check=False), own._run([job], check=False)
    if not isinstance(theirs, Traced) or not isinstance(ours, Traced) or theirs.stream is None or ours.stream is None:
        return False  # (a plan's error: its own book says it)
    slack = _staging(theirs.stream) + _staging(ours.stream)
    return (abs(theirs.peak_bytes - ours.peak_bytes) <= slack and theirs.managed_bytes == ours.managed_bytes
            and abs((theirs.used_bytes - theirs.context_bytes) - (ours.used_bytes - ours.context_bytes)) <= slack
            and _kernels_aside(step_events(theirs.stream)) == _kernels_aside(step_events(ours.stream))
            and [op._replace(key=0) for op in theirs.ops] == [op._replace(key=0) for op in ours.ops])


STAGING = (STAGING_BUFFER, SEMAPHORES)
"""What a reduction kernel allocates for its own blocks: sized by the card's SM count (memfit.memory.cuda.reduce),
which the cards of one architecture differ in and share traces anyway (memfit.devices.architecture)."""


def _kernels_aside(events: list) -> list:
    """The events with the reductions' staging buffers at no size (the SM count's)."""
    return [(t[0], 0, *t[2:]) if t[0] != MARK and t[5] in STAGING else t for t in events]


def _staging(stream) -> int:
    """The largest staging buffer in a stream (what it may add to the allocated peak)."""
    return max((t[1] for t in stream.tokens if t[0] == "+" and t[5] in STAGING), default=0)
