"""``memfit fit MODEL``: which cards train it, by which method, at what batch, how fast.

One table of cards by methods (full fine-tuning, LoRA, QLoRA; full and LoRA for the diffusion
models). Each cell answers on its own card, under its budget (by default the planner's: the card's
capacity less 10%, counted as reserved + CUDA context):

- the largest batch any recipe (memfit.planner.recipes) takes at the given sequence length or
  resolution, exact as ``estimate --batch-size max`` finds it (memfit.planner.largest: the batch fits,
  the next one does not), under the most frugal recipe;
- the plan that does it: the fastest recipe that takes that batch;
- its predicted step time (the GPU presets' op-level time model, memfit.planner.timing, on that
  card's peaks and bandwidths), as tokens, images or samples per second;
- where no recipe fits one card even at batch 1: the fewest cards (1, 2, 4, ... up to
  ``max_world``) whose FSDP2 recipe fits at one sample a rank, as ``memfit plan --max-world-size``
  decides, and the largest batch a rank then takes.

NOTE [ One book per architecture ]
A plan's bytes do not depend on the card's capacity: only on what the trace's kernels depend on
(memfit.devices.architecture: compute capability, CUDA and cuDNN, dtypes, workspaces). So the cards
are grouped by architecture, and each group has one trace book (memfit.planner.traces.TraceBook, on
one pool of worker processes) that every card of the group asks, at the batches and rank counts its
capacity leads to (NOTE [ A book for every batch ]): the first card's context is replaced by each
card's own.
Cards of one architecture share the traces at the batch sizes they share (1 and 2, which draw every
card's line, and any batch two cards both reach), and the check of a faster recipe at a batch costs
one shallow trace where its lower bound is over the budget. Each plan at a batch is measured as the
planner's top rungs measure it: the shallow pair's allocations replayed at full depth (a full trace
where they do not line up).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from memfit.devices import Device, architecture
from memfit.errors import UserError, brief
from memfit.memory.budget import Budget
from memfit.planner.largest import batch_axis, find_largest
from memfit.planner.methods import Method
from memfit.planner.progress import NoProgress
from memfit.planner.recipes import Recipe, recipes, sharded
from memfit.planner.shallow import extrapolate
from memfit.planner.space import ModelFacts, model_facts
from memfit.planner.timing import time_from_ops
from memfit.planner.traces import Measured, TraceBook
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target
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
                "used_bytes": self.used_bytes, "next_batch_used_bytes": self.next_used_bytes,
                "step_seconds": self.seconds, "throughput": self.throughput, "budget_bytes": self.budget_bytes,
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
    budget: str | None = None
    """The budget as given (a share of each card; None: the planner's default)."""

    def to_json(self) -> dict:
        return {"workload": self.workload, "sizes": self.sizes, "throughput_unit": self.unit, "methods": self.methods,
                "cards": [d.name for d in self.cards], "traces": self.traces, "full_traces": self.full_traces,
                "architectures": self.groups, "seconds": self.seconds,
                "cells": [c.to_json() for c in self.cells.values()]}


class Books:
    """The trace book of one architecture (NOTE [ One book per architecture ]): every plan, batch and
    rank count of its cards, on one pool of worker processes."""

    def __init__(self, workload: Workload, facts: ModelFacts, device: Device) -> None:
        self.facts, self.device = facts, device
        self.book = TraceBook(Target(workload, Plan(), 1, device), facts, Budget.of_device(device))

    def close(self) -> tuple[int, int]:
        """Close the book; returns its (traces, full traces)."""
        self.book.close()
        return self.book.traces, self.book.full_traces


def fit_table(workload: Workload, methods: list[Method], cards: list[Device], *, budget: str | None = None,
              max_world: int = 8, progress=None) -> FitTable:
    """The table of ``cards`` by ``methods`` for ``workload`` (the module docstring)."""
    progress = progress or NoProgress()
    t0 = time.perf_counter()
    with silenced_warnings():
        facts = model_facts(workload)
    info = workload.info
    sizes = (f"seq {info.seq_len}" if info.seq_len else f"{info.resolution} px" if info.resolution else "")
    table = FitTable(workload.name, sizes, _unit(workload), [m.name for m in methods], list(cards), budget=budget)
    groups: dict[tuple, list[Device]] = {}
    for card in cards:
        if not card.is_gpu:
            raise UserError(f"fit: {card.name} is not a GPU preset; name GPU presets (see memfit devices)")
        groups.setdefault(architecture(card), []).append(card)
    table.groups = len(groups)
    for group in groups.values():
        books = Books(workload, facts, group[0])
        progress.stage(f"tracing for {', '.join(d.name for d in group)}")
        try:
            for method in methods:
                for card in group:
                    table.cells[(card.name, method.name)] = _cell(card, method, books, budget, max_world)
        finally:
            traces, full = books.close()
            table.traces += traces
            table.full_traces += full
    table.seconds = time.perf_counter() - t0
    return table


def _cell(card: Device, method: Method, books: Books, budget: str | None, max_world: int) -> Cell:
    cell = Cell(card.name, method.name, budget_bytes=Budget.resolve(budget, card).bytes)
    try:
        with silenced_warnings():
            _fill(cell, card, method, recipes(method, books.facts, books.device), books, max_world)
    except UserError as e:
        cell.error, cell.cannot = brief(e, 120).removeprefix("plan: "), True
    return cell


def _fill(cell: Cell, card: Device, method: Method, plans: list[Recipe], books: Books, max_world: int) -> None:
    shift = card.context_bytes - books.device.context_bytes  # (the group's traces carry its first card's context)
    limit = cell.budget_bytes
    world, book, frugal = 1, books.book, plans[-1]

    def used(recipe: Recipe, batch: int) -> int:
        return book.at_batch(recipe.plan, batch).used_bytes + shift

    needs = used(frugal, 1)
    alone = book.at_batch(frugal.plan, 1).peak_bytes
    while needs > limit:  # no recipe fits one card: the fewest with FSDP2 (as plan --max-world-size decides)
        world *= 2
        if world > max_world:
            cell.error = f"needs {_gib(needs)} a rank on {world // 2} cards ({frugal.name})"
            return
        if alone / world + card.context_bytes > limit and world * 2 <= max_world:
            continue  # (a rank allocates at least 1/world of what one card does: its activations are not split)
        try:
            frugal = sharded(method, books.facts, books.device, world)
        except UserError as e:  # (FSDP2 with fp16 on a card without bf16)
            cell.error = f"needs {_gib(needs)} on one card; {str(e).split(' (')[0].removeprefix('plan: ')}"
            return
        needs = used(frugal, 1)
    found = find_largest(batch_axis(), lambda b: used(frugal, b), limit)
    n = found.value
    chosen = frugal
    for recipe in plans[:-1] if world == 1 else ():  # the fastest recipe that takes the batch too
        try:  # (over at batch 1, a bound every card of the architecture shares: over at n)
            if book.shallow_lower(recipe.plan, 1) + shift > limit:
                continue
            if book.shallow_lower(recipe.plan, n) + shift <= limit and used(recipe, n) <= limit:
                chosen = recipe
                break
        except UserError:  # (a recipe this model cannot run: the next one)
            continue
    m = book.at_batch(chosen.plan, n)
    target = dataclasses.replace(book.target, plan=chosen.plan, batch_size=n * world, device=card)
    cell.world, cell.batch, cell.recipe, cell.plan = world, n * world, chosen.name, chosen.plan
    cell.used_bytes, cell.next_used_bytes = m.used_bytes + shift, found.next_used_bytes
    cell.seconds = _seconds(m, target)
    info = book.target.workload.info
    per_sample = info.seq_len if info.text_lm and info.seq_len else 1
    cell.throughput = n * world * per_sample / cell.seconds


def _seconds(m: Measured, target: Target) -> float:
    """The step time of a plan's ops at full depth on the card (on the line through the shallow
    pair's times where their ops do not line up, as memfit.planner.gpu_time prices them)."""
    if m.ops is not None:
        return time_from_ops(m.ops, target).seconds
    a, b, d, e, full = m.pair
    return extrapolate(time_from_ops(a, target).seconds, time_from_ops(b, target).seconds, d, e, full)


def _unit(workload: Workload) -> str:
    info = workload.info
    return "tokens/s" if info.text_lm and info.seq_len else "images/s" if info.resolution else "samples/s"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
