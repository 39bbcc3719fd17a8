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
compute capability, Hopper's cuDNN attention, fp16 where a card lacks bf16). Which do is the
kernels' business, not a rule to keep here, so it is measured: before an architecture's book traces
a plan at more than one sample, its shallower trace at one sample is compared with the one each
book opened before it made, once that one's workspaces and staging buffers are sized for this card
(NOTE [ A stream on another card ] in memfit.memory.stream_sizes): allocation for allocation of the
step, op for op, and the allocated, reserved and managed bytes. Where one is the same, that book
answers the plan for both architectures, at every batch, and the plan costs this one a single trace.
Its figures on each card are its allocations at full depth sized for that card and replayed
(:class:`OnCard`): a Blackwell card's 32 MiB cuBLAS workspaces, or an Ada card's 24 SMs to an RTX
4090's 128 (each card's own staging buffers, not its group's first card's).

NOTE [ What every card asks first ]
Each card's search is a sequence: a plan at one sample, at two, then where the line through them
meets the card's budget (memfit.planner.largest), so its traces run one pair at a time, and one of
the two workers waits while the deeper trace of a pair runs. What every card of an architecture asks
first does not depend on its capacity: each method's recipes at one sample, and its most frugal
recipe at two where one fits the group's largest card. So those are traced together, on every
worker, before the first card's search; and the frugal recipes at three samples too, which draws
their lines (NOTE [ A plan's line in the batch ]) one batch sooner: the first batch a card's search
traces then checks them. Every group's are traced before any search: the groups after the first
queue their first traces in the background of the one pool at once (NOTE [ One pool for many
books ] in memfit.planner.workers), and their prefetches run one after another, many traces each.
"""

from __future__ import annotations

import dataclasses

from memfit.devices import Device, architecture
from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.cuda.model import workspace_bytes
from memfit.memory.cuda.reduce import SEMAPHORES, STAGING_BUFFER
from memfit.memory.deep_stream import replay, step_events
from memfit.memory.stream_sizes import card_sizes, on_card
from memfit.planner.measured import PEAK_MARGIN, Measured
from memfit.planner.space import ModelFacts
from memfit.planner.trace_job import Traced
from memfit.planner.traces import TraceBook
from memfit.planner.turns import current as current_turns
from memfit.planner.workers import Lane, SharedWorkers
from memfit.plans import Plan
from memfit.target import Target
from memfit.workload import Workload


class Books:
    """Every architecture's trace book, and which one answers each plan for each card (the module's NOTEs)."""

    def __init__(self, workload: Workload, facts: ModelFacts, devices: list[Device] = ()) -> None:
        """``devices``: the cards to be asked, whose books open here, before any trace (their processes
        are one pool: NOTE [ One pool for many books ] in memfit.planner.workers)."""
        self.workload, self.facts = workload, facts
        self.pool = SharedWorkers()
        self.books: dict[tuple, TraceBook] = {}
        self._sources: dict[tuple[tuple, Plan], TraceBook] = {}
        self._deciding: set[tuple[tuple, Plan]] = set()
        """The (architecture, plan) whose source a search is deciding now, the others waiting for it."""
        self._cards: dict[tuple[int, str], OnCard] = {}
        self.shared = 0
        """Plans an architecture took from another's book."""
        for device in devices:
            self.open(device)

    def open(self, device: Device) -> TraceBook:
        """The book of ``device``'s architecture (opened on the first card that asks)."""
        arch = architecture(device)
        if arch not in self.books:
            self.books[arch] = TraceBook(Target(self.workload, Plan(), 1, device), self.facts,
                                         Budget.of_device(device), pool=self.pool)
        return self.books[arch]

    @property
    def in_processes(self) -> bool:
        """Every book's traces run in the shared pool's processes (not here, in turn: one core, or CUDA
        traces), so searches may take turns (NOTE [ Searches in turns ] in memfit.planner.turns)."""
        return self.pool.count > 1 and all(isinstance(b.workers, Lane) for b in self.books.values())

    def for_plan(self, device: Device, plan: Plan) -> TraceBook | OnCard:
        """What answers ``plan`` on ``device``: the book of its architecture, or of an earlier one where the
        plan traces alike there (NOTE [ Architectures that trace alike ]); through :class:`OnCard` where
        that book's card sizes its workspaces or staging buffers otherwise."""
        source = self._source(device, plan)
        if card_sizes(source.target.device) == card_sizes(device):
            return source
        key = (id(source), device.name)
        if key not in self._cards:
            self._cards[key] = OnCard(source, self.open(device), device)
        return self._cards[key]

    def _source(self, device: Device, plan: Plan) -> TraceBook:
        key = (architecture(device), plan)
        if key in self._deciding:  # (another search, in turns, is comparing it: NOTE [ Searches in turns ])
            current_turns().wait(lambda: key in self._sources or key not in self._deciding)
        if key not in self._sources:
            own = self.open(device)
            self._deciding.add(key)
            try:
                source = next((other for other in self._earlier(own) if _alike(other, own, plan)), own)
            finally:
                self._deciding.discard(key)
            self._sources[key] = source
            self.shared += source is not own
        return self._sources[key]

    def _earlier(self, own: TraceBook):
        """The books opened before ``own``."""
        for other in self.books.values():
            if other is own:
                return
            yield other

    def queue(self, device: Device, plans: list[Plan]) -> None:
        """The shallower trace of each of ``plans`` at one sample on ``device``'s book (what :meth:`prefetch`
        traces first), queued in the background of the shared pool, for its processes to trace while the
        planner asks the groups before it (NOTE [ One pool for many books ] in memfit.planner.workers)."""
        own = self.open(device)
        own.jobs([p for p in plans if own.depths(p)])  # (its cut models, made here: the pool forks with them)
        own.workers.start([(p, own.depths(p)[0], 1) for p in dict.fromkeys(plans) if own.depths(p)])

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
    def _trace(asks: list[tuple[TraceBook | OnCard, Plan, int]], room: int | None = None) -> None:
        """Each (book, plan, batch) traced together, on each book's workers, then its figures read in order;
        but those whose shallow pair is over ``room`` bytes (the group's largest budget less its context) by
        its lower bound: where the pair's allocations do not line up at full depth, a full trace would
        measure a plan no card of the group takes."""
        Books.trace_together(asks)
        for book, plan, batch in asks:  # (in order: a plan's line)
            try:
                if room is None or book.lower_bound(plan, batch) - book.target.device.context_bytes <= room:
                    book.at_batch(plan, batch)
            except UserError:
                pass

    @staticmethod
    def trace_shallower(asks: list[tuple[TraceBook | OnCard, Plan, int]]) -> None:
        """The shallower trace of each (book, plan, batch) the book cannot draw, together on each book's
        workers (what a lower bound at the batch needs: NOTE [ Faster recipes in rounds ] in
        memfit.planner.fit)."""
        Books._together(asks, shallower=True)

    @staticmethod
    def queue_shallower(asks: list[tuple[TraceBook | OnCard, Plan, int]]) -> None:
        """The shallower trace of each (book, plan, batch) the book cannot draw, queued in the background of
        its book's workers, for :meth:`trace_shallower` to take later (NOTE [ Faster recipes in rounds ] in
        memfit.planner.fit)."""
        for home, *todo in Books._jobs(asks, shallower=True).values():
            home.workers.start(todo)

    @staticmethod
    def trace_together(asks: list[tuple[TraceBook | OnCard, Plan, int]]) -> None:
        """The shallow pair (or the full trace) of each (book, plan, batch) the book cannot draw, together
        on each book's workers; the figures are read when asked."""
        Books._together(asks, shallower=False)

    @staticmethod
    def _together(asks: list, shallower: bool) -> None:
        """The traces of ``asks`` not traced yet, each book's together on its workers."""
        for home, *todo in Books._jobs(asks, shallower).values():
            home._run(todo, check=False)

    @staticmethod
    def _jobs(asks: list, shallower: bool) -> dict[int, list]:
        """The trace jobs of ``asks`` the books neither can draw nor have traced, by the book that traces them
        (an OnCard's: the book it draws from): ``id(book) -> [book, *jobs]``."""
        jobs: dict[int, list] = {}
        for book, plan, batch in asks:
            if book.has_at(plan, batch):
                continue
            home = book.source if isinstance(book, OnCard) else book
            depths = home.depths(plan) or (None,)
            jobs.setdefault(id(home), [home])[1:] += [(plan, d, batch) for d in depths[:1 if shallower else None]
                                                      if (plan, d, batch) not in home._traced]
        return jobs

    def close(self) -> tuple[int, int]:
        """Close every book; returns their (traces, full traces)."""
        for book in self.books.values():
            book.close()
        self.pool.close()
        return sum(b.traces for b in self.books.values()), sum(b.full_traces for b in self.books.values())


class OnCard:
    """A book's figures of plans on another card (one whose kernels allocate alike, but sizes its library
    workspaces or its reductions' staging buffers otherwise): the book's allocations at full depth resized
    for the card and replayed (NOTE [ A stream on another card ] in memfit.memory.stream_sizes). Where the
    book has no stream (a full trace), the card's own architecture's book answers, as before."""

    def __init__(self, source: TraceBook, own: TraceBook, device: Device) -> None:
        self.source, self.own = source, own
        self.target = dataclasses.replace(own.target, device=device)
        self._at: dict[tuple[Plan, int], Measured] = {}

    def _shift(self, book: TraceBook) -> int:
        return self.target.device.context_bytes - book.target.device.context_bytes

    def _with_context(self, m: Measured, book: TraceBook) -> Measured:
        """``book``'s figures with this card's CUDA context in place of ``book``'s card's."""
        shift = self._shift(book)
        return dataclasses.replace(m, used_lower=m.used_lower + shift, used_bytes=m.used_bytes + shift)

    def at_batch(self, plan: Plan, batch: int) -> Measured:
        key = (plan, batch)
        if key not in self._at:
            m = self.source.at_batch(plan, batch)
            stream, moved = self._moved(plan, batch)
            if moved is stream:  # (no size changes on this card: the book's figures)
                self._at[key] = self._with_context(m, self.source)
            elif moved is None:
                self._at[key] = self._with_context(self.own.at_batch(plan, batch), self.own)
            else:
                self.own.workers.pump()
                peak, reserved = replay(moved, STEADY_STEP, expandable=plan.config("allocator").expands)
                context = self.target.device.context_bytes
                self._at[key] = dataclasses.replace(m, peak_bytes=peak, used_lower=int(peak * (1 - PEAK_MARGIN)) + context,
                                                    used_bytes=reserved + context)
        return self._at[key]

    def has_at(self, plan: Plan, batch: int) -> bool:
        return self.source.has_at(plan, batch)

    def _moved(self, plan: Plan, batch: int):
        """(the book's allocations behind ``plan`` at ``batch``, the same on this card): the second is the first
        where no size changes, None where the book has no stream or the card makes fewer allocations."""
        stream = self.source.stream_at(plan, batch)
        return stream, on_card(stream, self.target.device) if stream is not None else None

    def expanded_used(self, plan: Plan, batch: int) -> int | None:
        """:meth:`at_batch`'s ``used_bytes`` with expandable segments (as the books' own)."""
        stream, moved = self._moved(plan, batch)
        if moved is stream:
            used = self.source.expanded_used(plan, batch)
            return None if used is None else used + self._shift(self.source)
        if moved is None:
            used = self.own.expanded_used(plan, batch)
            return None if used is None else used + self._shift(self.own)
        return replay(moved, STEADY_STEP, expandable=True)[1] + self.target.device.context_bytes

    def shallow_lower(self, plan: Plan, batch: int) -> int:
        if self.source.has_at(plan, batch):
            return self.at_batch(plan, batch).used_bytes
        return self.source.shallow_lower(plan, batch) + self._shift(self.source) - self._card_sized(plan, batch)

    def lower_bound(self, plan: Plan, batch: int) -> int:
        if self.source.has_at(plan, batch):
            return self.at_batch(plan, batch).used_lower
        return self.source.lower_bound(plan, batch) + self._shift(self.source) - self._card_sized(plan, batch)

    def _card_sized(self, plan: Plan, batch: int) -> int:
        """The most the source card's own allocations (its workspaces, its largest staging buffer) hold in
        the plan's shallower trace at ``batch``: what a bound from it may be above this card's."""
        depths = self.source.depths(plan)
        t = self.source._traced.get((plan, depths[0], batch)) if depths else None
        if not isinstance(t, Traced) or t.stream is None:
            return 0
        card = self.source.target.device
        workspaces = sum(tok[1] for tok in t.stream.tokens if tok[0] == "+" and workspace_bytes(tok[5], card) is not None)
        return workspaces + _staging(t.stream)


def _alike(other: TraceBook, own: TraceBook, plan: Plan) -> bool:
    """``plan``'s shallower trace at one sample is the same in both books (``other`` has traced it), once its
    workspaces and staging buffers are sized for ``own``'s card (NOTE [ A stream on another card ])."""
    depths = own.depths(plan)
    if not depths or other.depths(plan) != depths:
        return False
    job = (plan, depths[0], 1)
    if job not in other._traced:
        return False
    (theirs,), (ours,) = other._run([job], check=False), own._run([job], check=False)
    if not isinstance(theirs, Traced) or not isinstance(ours, Traced) or theirs.stream is None or ours.stream is None:
        return False  # (a plan's error: its own book says it)
    moved = on_card(theirs.stream, own.target.device)
    expands = plan.config("allocator").expands
    return (moved is not None and theirs.managed_bytes == ours.managed_bytes
            and step_events(moved) == step_events(ours.stream)
            and replay(moved, STEADY_STEP, expandable=expands) == replay(ours.stream, STEADY_STEP, expandable=expands)
            and [op._replace(key=0) for op in theirs.ops] == [op._replace(key=0) for op in ours.ops])


def _staging(stream) -> int:
    """The largest staging buffer in a stream (what it may add to the allocated peak)."""
    return max((t[1] for t in stream.tokens if t[0] == "+" and t[5] in (STAGING_BUFFER, SEMAPHORES)), default=0)
