"""``memfit fit MODEL``: which cards train it, by which method, at what batch, how fast.

One table of cards by methods (full fine-tuning, LoRA, QLoRA; full and LoRA for the diffusion
models). Each cell answers on its own card, under its budget (by default the planner's: the card's
capacity less 10%, counted as reserved + CUDA context):

- the largest batch any recipe (memfit.planner.recipes) takes at the given sequence length or
  resolution, as ``estimate --batch-size max`` finds it (memfit.planner.largest: the batch fits, the
  next one does not), under the most frugal recipe; each batch's figures from the shallow pair's
  allocations at full depth, or drawn on the plan's line in the batch once that line has drawn a
  third traced batch allocation for allocation (NOTE [ A plan's line in the batch ]);
- the plan that does it: the fastest recipe that takes that batch;
- its predicted step time (the GPU presets' op-level time model, memfit.planner.timing, on that
  card's peaks and bandwidths), as tokens, images or samples per second;
- where no recipe fits one card even at batch 1: the fewest cards (1, 2, 4, ... up to
  ``max_world``) whose FSDP2 recipe fits at one sample a rank, as ``memfit plan --max-world-size``
  decides, and the largest batch a rank then takes.

The traces: memfit.planner.fit_books (NOTE [ One book per architecture ], NOTE [ Architectures that
trace alike ]). A faster recipe is checked at one sample first (a figure every card of the
architecture shares), and at a card's batch only where that fits; at the batch, one shallow trace
rules it out where its lower bound is over the budget.

NOTE [ Faster recipes in rounds ]
Each card's largest batch is its own (a dozen cards, a dozen batches), so checking a faster recipe at
it is a trace of its own: the shallower trace at that batch, then, where its lower bound is within the
budget, the deeper one. Asked card by card, each is one trace while the other worker waits. So the
cells of a group of cards first find their batches under the frugal recipes (drawn on the recipes'
lines once the first card has traced them), then ask their faster recipes in rounds, fastest first:
each round traces together every cell's next recipe at its batch, the shallower traces, then the
deeper ones of those within their budgets; a cell whose recipe takes its batch leaves the rounds. The
same traces as one cell at a time, run two at a time. A cell's first faster recipe is known as soon as its
batch is (those over the budget at one sample are passed over without a trace), so its shallower trace at
the batch is queued in the background then: the workers trace it while the planner draws the other cards'
batches on the lines, where they had nothing queued, and the first round takes it.

The cards of a group find their largest batches in turns, and so do the groups after the first (NOTE
[ Searches in turns ] in memfit.planner.turns): while one search waits for its pair, another computes
its figures or hands out its own. The first group searches alone, before the others: they draw on its
plans' lines and take the plans that trace alike from its book, which, asked before its own searches
had traced them, would cost traces of their own. A search that asks a plan whose line a batch being
traced may decide waits for that batch (memfit.planner.at_batch), and one that asks which book answers
a plan another is deciding waits for that answer (memfit.planner.fit_books): the same traces as in turn.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

from memfit.devices import Device, architecture
from memfit.errors import UserError, brief
from memfit.memory.budget import Budget
from memfit.planner.fit_books import Books
from memfit.planner.largest import batch_axis, find_largest
from memfit.planner.measured import Measured
from memfit.planner.methods import Method
from memfit.planner.progress import NoProgress
from memfit.planner.recipes import Recipe, recipes, sharded
from memfit.planner.shallow import extrapolate
from memfit.planner.space import model_facts
from memfit.planner.timing import time_from_ops
from memfit.planner.traces import TraceBook
from memfit.planner.turns import in_turns
from memfit.quiet import silenced_warnings
from memfit.target import Target
from memfit.units import fmt_bytes
from memfit.workload import Workload


@dataclass
class Cell:
    """One card and one method."""

    card: str
    method: str
    world: int = 0
    """Cards: 1 (it fits one), the fewest with FSDP2, or 0 (none up to the most tried)."""
    batch: int | None = None
    """The largest global batch (``world`` x the largest a rank takes)."""
    recipe: str | None = None
    plan: object = None
    used_bytes: int | None = None
    """What the budget counts at ``batch`` (one rank's)."""
    host_bytes: int = 0
    """The plan's peak in the training machine's memory at ``batch``: offloaded states, swapped weights."""
    passed_over: str = ""
    """The recipes passed over for the host's memory, in words (NOTE [ A recipe over the host's memory ])."""
    next_used_bytes: int | None = None
    """What one more sample a rank needs."""
    seconds: float | None = None
    throughput: float | None = None
    budget_bytes: int = 0
    error: str | None = None
    """Why the method cannot run here (its trace's error), or what nothing fitting needs."""
    cannot: bool = False
    """The method cannot run on this model or card (``error`` says why), whatever the memory."""

    @property
    def fits(self) -> bool:
        return self.world == 1

    def to_json(self) -> dict:
        return {"card": self.card, "method": self.method, "fits_one_card": self.fits, "cards": self.world or None,
                "batch": self.batch, "recipe": self.recipe, "plan": self.plan.to_dict() if self.plan else None,
                "used_bytes": self.used_bytes, "host_bytes": self.host_bytes, "next_batch_used_bytes": self.next_used_bytes,
                "passed_over_for_host_memory": self.passed_over or None, "step_seconds": self.seconds, "throughput": self.throughput, "budget_bytes": self.budget_bytes,
                "error": self.error, "cannot": self.cannot}


@dataclass
class FitTable:
    workload: str
    sizes: str
    """The sequence length or resolution, in words."""
    unit: str
    methods: list[str]
    cards: list[Device]
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    traces: int = 0
    full_traces: int = 0
    seconds: float = 0.0
    groups: int = 0
    shared: int = 0
    """Plans an architecture took from another's book (NOTE [ Architectures that trace alike ])."""
    budget: str | None = None
    """The budget as given (a share of each card; None: the planner's default)."""
    host_budget_bytes: int | None = None
    """The training machine's memory the plans' host copies may hold (``--host-memory``; None: not checked)."""

    def to_json(self) -> dict:
        return {"workload": self.workload, "sizes": self.sizes, "throughput_unit": self.unit, "methods": self.methods,
                "cards": [d.name for d in self.cards], "traces": self.traces, "full_traces": self.full_traces,
                "architectures": self.groups, "plans_shared_between_architectures": self.shared, "seconds": self.seconds,
                "host_budget_bytes": self.host_budget_bytes, "cells": [c.to_json() for c in self.cells.values()]}


def fit_table(workload: Workload, methods: list[Method], cards: list[Device], *, budget: str | None = None,
              max_world: int = 8, host_memory: str | int | None = None, progress=None) -> FitTable:
    """The table of ``cards`` by ``methods`` for ``workload`` (the module docstring). ``host_memory``: the
    training machine's memory (``64GB``, ``80%`` of this one's) the recipes' host copies may hold (NOTE [ A
    recipe over the host's memory ]); None: not checked, as for ``memfit plan`` on a preset."""
    progress = progress or NoProgress()
    t0 = time.perf_counter()
    host = Budget.resolve(budget, cards[0]).with_host(host_memory).host_bytes if cards else None  # (bad input: now)
    with silenced_warnings():
        facts = model_facts(workload)
    info = workload.info
    wide = f"{info.config['width']}x" if info.config.get("fixed_width") else ""  # (a Wan clip of a given width)
    sizes = (f"seq {info.seq_len}" if info.seq_len else f"{wide}{info.resolution} px" if info.resolution else "")
    table = FitTable(workload.name, sizes, _unit(workload), [m.name for m in methods], list(cards), budget=budget,
                     host_budget_bytes=host)
    groups: dict[tuple, list[Device]] = {}
    for card in cards:
        if not card.is_gpu:
            raise UserError(f"fit: {card.name} is not a GPU preset; name GPU presets (see memfit devices)")
        groups.setdefault(architecture(card), []).append(card)
    table.groups = len(groups)
    order = sorted(groups.values(), key=len, reverse=True)
    books = Books(workload, facts, [group[0] for group in order])
    try:  # (the largest group first: the others take the plans that trace alike from its book)
        for group in order[1:]:  # (their first traces, in the background: NOTE [ One pool for many books ])
            first, others = _recipes(group[0], methods, books, budget)
            books.queue(group[0], first + others)
        for group in order:  # (what every card asks first, for every group: many traces at once)
            progress.stage(f"tracing what {', '.join(d.name for d in group)} ask first")
            _prefetch(books, group, methods, budget)
        searched = []
        for together in (order[:1], order[1:]):  # (the first alone: the others draw on its lines, take its plans)
            progress.stage(f"tracing for {', '.join(d.name for group in together for d in group)}")
            searched += in_turns([functools.partial(_search_group, group, methods, books, budget, max_world, host_memory)
                                  for group in together], together=books.in_processes)
        for searches in searched:  # (NOTE [ Searches in turns ])
            for search in searches:
                table.cells[(search.cell.card, search.cell.method)] = search.cell
    finally:
        table.traces, table.full_traces = books.close()
        table.shared = books.shared
    table.seconds = time.perf_counter() - t0
    return table


def _search_group(group: list[Device], methods: list[Method], books: Books, budget: str | None,
                  max_world: int, host_memory: str | int | None) -> list[_Search]:
    """The cells of one architecture's cards: their largest batches, then faster recipes in rounds."""
    searches = [_Search(card, method, books, budget, max_world, host_memory) for method in methods for card in group]
    in_turns([search.largest for search in searches], together=books.in_processes)
    _faster_in_rounds(searches, books)
    for search in searches:
        search.finish()
    return searches


def _prefetch(books: Books, group: list[Device], methods: list[Method], budget: str | None) -> None:
    """What every card of the ``group`` asks first (NOTE [ What every card asks first ])."""
    room = max(Budget.resolve(budget, c).bytes - c.context_bytes for c in group)
    first, others = _recipes(group[0], methods, books, budget)
    with silenced_warnings():
        books.prefetch(group[0], first, others, room)


def _recipes(card: Device, methods: list[Method], books: Books, budget: str | None) -> tuple[list, list]:
    """Each method's most frugal recipe's plan on ``card``, and the others' plans."""
    first, others = [], []
    for method in methods:
        try:
            with silenced_warnings():
                plans = recipes(method, books.facts, card, Budget.resolve(budget, card).bytes)
        except UserError:
            continue
        first.append(plans[-1].plan)
        others += [r.plan for r in plans[:-1]]
    return first, others


def _faster_in_rounds(searches: list[_Search], books: Books) -> None:
    """Each search's fastest recipe that takes its batch (NOTE [ Faster recipes in rounds ])."""
    with silenced_warnings():
        while asks := [(s, r) for s in searches if (r := s.next_faster()) is not None]:
            books.trace_shallower([(s.book(r), r.plan, s.batch) for s, r in asks])
            near = [(s, r) for s, r in asks if s.may_take(r)]
            books.trace_together([(s.book(r), r.plan, s.batch) for s, r in near])
            for s, r in near:
                s.try_take(r)


class _Search:
    """One cell's search (the module docstring): the cards that train it and the largest batch under the
    most frugal recipe (:meth:`largest`), then the fastest recipe that takes that batch too (asked by
    :func:`_faster_in_rounds`), and its figures (:meth:`finish`)."""

    def __init__(self, card: Device, method: Method, books: Books, budget: str | None, max_world: int,
                 host_memory: str | int | None = None) -> None:
        self.card, self.method, self.books, self.max_world = card, method, books, max_world
        self.budget = Budget.resolve(budget, card).with_host(host_memory)
        self.cell = Cell(card.name, method.name, budget_bytes=self.budget.bytes)
        self.limit = self.cell.budget_bytes
        self.plans: list[Recipe] = []
        self.faster: list[Recipe] = []
        """The recipes faster than ``chosen`` still to ask, fastest first."""
        self.chosen: Recipe | None = None
        self.world, self.batch, self.found = 1, None, None
        try:
            with silenced_warnings():
                self.plans = recipes(method, books.facts, card, self.limit)
        except UserError as e:
            self._cannot(e)

    def _cannot(self, e: UserError) -> None:
        self.cell.error, self.cell.cannot = brief(e, 120).removeprefix("plan: "), True
        self.plans, self.faster, self.chosen = [], [], None

    # -- a recipe's figures on this card -----------------------------------------------------------
    def book(self, recipe: Recipe) -> TraceBook:
        return self.books.for_plan(self.card, recipe.plan)

    def _shift(self, recipe: Recipe) -> int:  # (a book's traces carry its own card's context)
        return self.card.context_bytes - self.book(recipe).target.device.context_bytes

    def default_used(self, recipe: Recipe, batch: int) -> int:
        return self.book(recipe).at_batch(recipe.plan, batch).used_bytes + self._shift(recipe)

    def used(self, recipe: Recipe, batch: int) -> int:  # NOTE [ Expandable segments where they decide the fit ]
        need = self.default_used(recipe, batch)
        if need > self.limit and not recipe.plan.config("allocator").expands:
            expanded = self.book(recipe).expanded_used(recipe.plan, batch)
            need = need if expanded is None else min(need, expanded + self._shift(recipe))
        return need

    def lower(self, recipe: Recipe, batch: int) -> int:  # (where the book has the batch: its figure, either segments)
        if self.book(recipe).has_at(recipe.plan, batch):
            return self.used(recipe, batch)
        return self.book(recipe).shallow_lower(recipe.plan, batch) + self._shift(recipe)

    def bound(self, recipe: Recipe, batch: int) -> int:  # (the shallow pair's: no full trace where it does not line up)
        return self.book(recipe).lower_bound(recipe.plan, batch) + self._shift(recipe)

    # -- the search --------------------------------------------------------------------------------
    def largest(self) -> None:
        """The fewest cards that train the method (one, or FSDP2 over 2, 4, ...; as ``plan --max-world-size``
        decides) and the largest batch a rank takes under its most frugal recipe."""
        if self.plans:
            self._guarded(self._largest)

    def _largest(self) -> None:
        if not self._within_host():
            return
        cell, world, frugal = self.cell, 1, self.plans[-1]
        needs = self.used(frugal, 1)
        alone = self.book(frugal).at_batch(frugal.plan, 1).peak_bytes
        while needs > self.limit:  # no recipe fits one card: the fewest with FSDP2
            world *= 2
            if world > self.max_world:
                cell.error, self.plans = f"needs {_gib(needs)} a rank on {world // 2} cards ({frugal.name})", []
                return
            if alone / world + self.card.context_bytes > self.limit and world * 2 <= self.max_world:
                continue  # (a rank allocates at least 1/world of what one card does: its activations are not split)
            try:
                frugal = sharded(self.method, self.books.facts, self.card, world)
            except UserError as e:  # (FSDP2 with fp16 on a card without bf16)
                why = str(e).split(" (")[0].removeprefix("plan: ").replace("shard: fsdp with ", "FSDP2 with ")
                lacks = " (this card has no bf16)" if "fp16" in why and not self.card.bf16 else ""
                cell.error = f"needs {_gib(needs)} on one card; {why}{lacks}"
                self.plans = []
                return
            needs = self.used(frugal, 1)
        self.found = find_largest(batch_axis(), lambda b: self.used(frugal, b), self.limit)
        self.world, self.batch, self.chosen = world, self.found.value, frugal
        self.faster = list(self.plans[:-1]) if world == 1 else []
        if (first := self.next_faster()) is not None:  # (the first round's shallower trace, in the background now)
            self.books.queue_shallower([(self.book(first), first.plan, self.batch)])

    # NOTE [ A recipe over the host's memory ]
    # With --host-memory, a recipe holding copies on the host (optimizer states offloaded, frozen blocks
    # swapped) that needs more of the training machine's memory than it gives is passed over, as the
    # planner's walk rejects such a plan; the cell then takes the recipes left (the next most frugal
    # saves less, so the batch may be smaller, or FSDP2 over several cards). Those copies hold the
    # weights' or the states' bytes, whatever the batch (no recipe offloads activations), so one sample
    # decides: the figure every card of the architecture shares. A paged optimizer's pages out grow with
    # the batch (its activations leave the states less of the card), so its figure there is all of its
    # states: what a batch that fills the card pages out. Recipes without host copies are not
    # asked (no trace of their own). The chosen recipe's host bytes at its batch are in its cell. In
    # place of ``offloaded``, passed over, the cell tries ``paged`` (memfit.planner.recipes): its states
    # a quarter of the bytes, and only those the card has no room for on the host. Not before: its
    # allocator side is larger (a smaller batch) and the pages it moves each step make it slower.
    def host(self, recipe: Recipe, batch: int) -> int:
        """The recipe's peak in host memory at ``batch`` (pinned copies), with a paged optimizer's pages out."""
        m = self.book(recipe).at_batch(recipe.plan, batch)
        return m.host_bytes + self.budget.paged_out(self.used(recipe, batch), m.managed_bytes)

    def _host_at_one(self, recipe: Recipe) -> int:
        """What the recipe may hold on the host at any batch, from one sample: its copies, and all of a paged
        optimizer's states (a batch that fills the card pages every one out); 0 where the model cannot run
        the recipe (its own figures say so later)."""
        try:
            m = self.book(recipe).at_batch(recipe.plan, 1)
        except UserError:
            return 0
        return m.host_bytes + m.managed_bytes

    def _within_host(self) -> bool:
        """Pass over the recipes over the host's memory (NOTE [ A recipe over the host's memory ]); False
        where none is left (then the cell's error says what they need)."""
        if self.budget.host_bytes is None:
            return True
        over = {r.name: n for r in self.plans if _holds_host(r.plan) and self.budget.host_over(n := self._host_at_one(r))}
        if "offloaded" in over:  # (its host-light stand-in: the states paged, a quarter of the bytes)
            light = recipes(self.method, self.books.facts, self.card, self.limit, host_light=True)
            self.plans = [r for r in self.plans if r.name != "offloaded"] + [r for r in light if r.name == "paged"]
            if self.plans[-1].name == "paged" and self.budget.host_over(n := self._host_at_one(self.plans[-1])):
                over["paged"] = n
        self.plans = [r for r in self.plans if r.name not in over]
        if over:
            self.cell.passed_over = (" and ".join(f"{name} needs {fmt_bytes(n)}" for name, n in over.items())
                                     + f" of host memory > {fmt_bytes(self.budget.host_bytes)} (--host-memory)")
        if not self.plans:
            self.cell.error = "every recipe is over the host memory (--host-memory)"
        return bool(self.plans)

    def next_faster(self) -> Recipe | None:
        """The fastest recipe left to ask at the batch: past those over the budget at one sample (a figure
        every card of the architecture shares, so no trace of its own)."""
        while self.faster:
            recipe = self.faster[0]
            if self._within(self.bound, recipe, 1) and self._within(self.used, recipe, 1):
                return recipe
            self.faster.pop(0)
        return None

    def may_take(self, recipe: Recipe) -> bool:
        """Its shallower trace at the batch (a lower bound) is within the budget; else it is out."""
        if self._within(self.lower, recipe, self.batch):
            return True
        self.faster.pop(0)
        return False

    def try_take(self, recipe: Recipe) -> None:
        """The recipe takes the batch (and is chosen: the searches stop here), or it is out."""
        if self._within(self.used, recipe, self.batch):
            self.chosen, self.faster = recipe, []
        else:
            self.faster.pop(0)

    def _within(self, figure, recipe: Recipe, batch: int) -> bool:
        """``figure(recipe, batch)`` is within the budget; False where the model cannot run the recipe."""
        try:
            return figure(recipe, batch) <= self.limit
        except UserError:
            return False

    def finish(self) -> None:
        """The cell's figures from the chosen recipe at the batch."""
        if self.chosen is not None:
            self._guarded(self._finish)

    def _guarded(self, step) -> None:
        """``step()``; where it raises a UserError, the method cannot run here (the cell says why)."""
        try:
            with silenced_warnings():
                step()
        except UserError as e:
            self._cannot(e)

    def _finish(self) -> None:
        cell, chosen, n, world = self.cell, self.chosen, self.batch, self.world
        m = self.book(chosen).at_batch(chosen.plan, n)
        target = dataclasses.replace(self.book(chosen).target, plan=chosen.plan, batch_size=n * world, device=self.card)
        cell.world, cell.batch, cell.recipe, cell.plan = world, n * world, chosen.name, chosen.plan
        cell.used_bytes, cell.next_used_bytes = self.used(chosen, n), self.found.next_used_bytes
        cell.host_bytes = self.host(chosen, n) if _holds_host(chosen.plan) else 0
        if cell.used_bytes < self.default_used(chosen, n):  # (it fits with expandable segments only)
            cell.plan, cell.recipe = chosen.plan.replace(allocator="expandable"), f"{chosen.name}+expandable"
        cell.seconds = _seconds(m, target)
        cell.used_bytes = self.budget.counted(cell.used_bytes, m.managed_bytes)  # (a paged optimizer's pages kept)
        if m.managed_bytes:  # (a paged optimizer's pages the card has no room for move each step: NOTE [ Migration in estimates ])
            cell.seconds += self.budget.migration(self.used(chosen, n), m.managed_bytes).seconds
        info = target.workload.info
        per_sample = info.seq_len if info.text_lm and info.seq_len else 1
        cell.throughput = n * world * per_sample / cell.seconds


def _seconds(m: Measured, target: Target) -> float:
    """The step time of a plan's ops at full depth on the card (on the line through the shallow
    pair's times where their ops do not line up, as memfit.planner.gpu_time prices them)."""
    if m.ops is not None:
        return time_from_ops(m.ops, target).seconds
    a, b, d, e, full = m.pair
    return extrapolate(time_from_ops(a, target).seconds, time_from_ops(b, target).seconds, d, e, full)


def _holds_host(plan) -> bool:
    """The plan may keep copies in host memory: offloaded optimizer states or activations, swapped blocks,
    or a paged optimizer's states (those the card has no room for)."""
    return (not (plan.config("offload").is_default and plan.config("swap_blocks").is_default)
            or plan.optimizer.endswith("-paged"))


def _unit(workload: Workload) -> str:
    info = workload.info
    return "tokens/s" if info.text_lm and info.seq_len else "images/s" if info.resolution else "samples/s"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
