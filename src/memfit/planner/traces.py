"""The trace book: every fake trace a GPU-preset search runs, run once, on the worker processes.

A plan's figures come from fake traces of its own TrainStep (memfit.planner.timing.record_step):
a *shallow pair* (the model cut to 2 and 3 of its repeated blocks, memfit.planner.shallow), whose
ops and allocated peak extrapolate to full depth, or a *full trace*, what ``memfit estimate`` runs.
Independent traces (the values alone, a pair's two depths, the next plans of the walk) run in
forked worker processes, one per CPU core (memfit.planner.workers); a trace job is ``(plan, depth
or None for full, batch or None for the whole batch)``, and its result is kept, so no trace runs
twice. What the book keeps of a plan (:class:`Measured`) is what its traces say of its memory and
its ops at full depth; what the ops cost in time is the time model's business
(memfit.planner.gpu_time), and which figure rules a plan out the ladder's (memfit.planner.gpu_ladder).
"""

from __future__ import annotations

import dataclasses
import time

from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.deep_stream import deepen, replay
from memfit.planner.at_batch import AtBatch
from memfit.planner.deep_figures import DeepFigures
from memfit.planner.measured import PEAK_MARGIN, Measured, ShallowFailed
from memfit.planner.ops import FORWARD
from memfit.planner.shallow import depths, extrapolate, extrapolate_ops, offloaded_blocks, swapped_in_units
from memfit.planner.space import ModelFacts
from memfit.planner.stacks import stacks_of
from memfit.planner.trace_job import Traced, Tracer
from memfit.planner.workers import SKIPPED, SharedWorkers, Workers
from memfit.plans import Plan
from memfit.target import Target
from memfit.techniques.base import GraphSize

OUTSIDE_THE_GRAPH = ("allocator", "grad_accum_steps", "optimizer", "optimizer_in_backward", "ema", "max_grad_norm",
                     "bf16_update")
"""Plan fields that change no compiled region of the model (the update, the allocator, how micro-batches
add up): plans that differ only in them trace one graph (offload too, but for its activations)."""


def compiles(job: tuple) -> tuple | None:
    """What a trace job compiles, as a key (None: nothing): the job runs in a worker that compiled
    it before (NOTE [ A compile's traces in the process that compiled it ] in memfit.planner.workers).
    A whole-model graph is one per depth and batch; a block's serves every depth."""
    plan, depth, batch = job
    mode = plan.config("compile").mode
    if mode == "blocks":
        return ("blocks", _graph_fields(plan), batch)
    if mode == "full":
        return ("full", _graph_fields(plan), depth, batch)
    optimizer = plan.config("optimizer")
    if not optimizer.compiles_per_weight_dtype:
        return None
    return ((optimizer.name, *map(str, optimizer.values().values())),), plan.config("precision").weights


def _graph_fields(plan: Plan) -> tuple:
    """The plan's values that its compiled regions depend on (NOTE [ Wrapped forwards that torch.compile
    does not tie to one model ] in memfit.techniques.forwards: in one process, plans equal in these
    share the graphs)."""
    values = ((f.name, getattr(plan, f.name)) for f in dataclasses.fields(plan) if f.init and f.name not in OUTSIDE_THE_GRAPH)
    return tuple((k, tuple(x for x in v if x.startswith("activations")) if k == "offload" else v) for k, v in values)


def _shares_compiles(plan: Plan) -> bool:
    """The plan's compiled graphs are the same at every depth (torchao's update, one per parameter
    shape; ``compile: blocks``, one per block): a deeper trace after the shallowest finds them in
    Inductor's cache (NOTE [ Jobs in the background, and after the compile they share ] in
    memfit.planner.workers). A whole-model graph is not (``compile: full``)."""
    key = compiles((plan, None, None))
    return key is not None and key[0] != "full"


def _after_shallowest(jobs: list[tuple], which) -> dict:
    """Job -> the job it waits for: among the ``jobs`` of the plans ``which(plan)`` names, each
    deeper trace (full depth last) of a plan and batch starts after its shallowest one."""
    first, after = {}, {}
    for job in sorted((j for j in jobs if which(j[0])), key=lambda j: (j[1] is None, j[1] or 0)):
        key = (job[0], job[2])
        if key in first:
            after[job] = first[key]
        else:
            first[key] = job
    return after


# NOTE [ Host bytes from a shallow pair ]
# What a plan keeps in host memory grows with the depth as its device bytes do: offloaded
# activations and states per block, swapped blocks' weights (the pair keeps the full model's share
# of offloaded and swapped blocks: memfit.planner.shallow). So the host peak at full depth is on the
# line through the pair's, as the allocated peak is. On an 8-block GPT-2 (rtx4090, batch 4 x 128)
# it equalled the full trace's to the byte for activations offloaded (all, the first half, with
# blocks checkpointed), optimizer states offloaded, both, and a LoRA swapping 4 and 8 blocks
# (tests/integration/test_plan_host_memory.py). The walk holds a plan to the host's memory with it
# (NOTE [ A plan over the host's memory ] in memfit.planner.walk).


class TraceBook(AtBatch, DeepFigures):
    """The traces of one search, run on the workers and kept (see the module docstring)."""

    def __init__(self, target: Target, facts: ModelFacts, budget: Budget, world: int = 1,
                 pool: SharedWorkers | None = None) -> None:
        """``pool``: processes shared with other books (NOTE [ One pool for many books ] in
        memfit.planner.workers); by default the book forks its own."""
        self.target, self.budget = target, budget
        self.world = world
        self.rank_batch = target.batch_size // world
        """The samples one rank's step runs (what micro-batch sizes split)."""
        self.stacks = stacks_of(facts.model)
        """How the shallow traces cut the model (NOTE [ Stacks of two depths ]: FLUX.1's units of 1 + 2 blocks)."""
        self.depth = self.stacks.full if self.stacks else None
        self.n_params = facts.n_params
        self.measured: dict[Plan, Measured] = {}
        self._new: list[Plan] = []
        """Plans measured since the walk last asked (:meth:`newly_measured`)."""
        self.traces = self.full_traces = 0
        self.seconds_spent = 0.0
        self.phase = "before the walk"
        """What the searches' traces are for now (the search sets it: ``before the walk`` while the
        default plan and each value alone are measured, then ``walk``): :attr:`spent` is kept by it."""
        self.spent: dict[str, list] = {}
        """``"<phase>: <kind>"`` -> [traces, CPU seconds in the processes that ran them] (kind: a shallow
        trace, a full-depth trace, either at a micro-batch size, or the deep stream's replay)."""
        self.progress = None
        """Told which kind of trace runs now (memfit.planner.progress)."""
        self.shallow_failed: str | None = None
        self._traced: dict[tuple, Traced | Exception] = {}
        self.expands: set[Plan] = set()
        """Plans that fit the budget only with expandable segments (NOTE [ Expandable segments where
        they decide the fit ]): their figures here are those of expandable segments."""
        self._start_batches()
        self._start_deep_figures()
        self.tracer = Tracer(target, facts.model, budget)
        # forked children cannot use CUDA once the parent has: no workers where tensors are CUDA's
        fork = target.tensor_device != "cuda"
        self.workers = pool.lane(self.tracer, compiles) if pool is not None and fork else \
            Workers(self.tracer, fork=fork, affinity=compiles)

    def close(self) -> None:
        self.workers.close()

    # -- a plan's figures ----------------------------------------------------------------------
    def measure(self, plan: Plan) -> Measured:
        """The plan's ops, allocated peak and host bytes from a shallow trace pair (full depth when the model is shallow, or a shallow trace failed once)."""
        if plan in self.measured:
            return self.measured[plan]
        pair = self.depths(plan)
        if not pair:
            return self.confirm(plan)
        try:
            a, b = self._run([(plan, d, None) for d in pair])
        except (ShallowFailed, UserError):  # the shallow model failed: the full one decides (and raises)
            return self.confirm(plan)
        if b is SKIPPED:  # NOTE [ The deeper trace of a plan over the budget at the shallower depth ]
            m = self.measured[plan] = Measured(peak_bytes=a.peak_bytes, used_lower=self._shallow_lower(a),
                                               managed_bytes=a.managed_bytes, shallower_only=True, host_bytes=a.host_bytes)
            return m
        (d, e), full = pair, self.depth
        ops = extrapolate_ops(a.ops, b.ops, d, e, full)
        peak = self._replayed_peak(plan, a, b, pair) if self.stacks.least == 1 else None
        peak = peak or int(extrapolate(a.peak_bytes, b.peak_bytes, d, e, full))  # (PEAK_MARGIN below)
        managed, host = (int(extrapolate(u, v, d, e, full)) for u, v in  # (host: NOTE [ Host bytes from a shallow pair ])
                         ((a.managed_bytes, b.managed_bytes), (a.host_bytes, b.host_bytes)))
        n = plan.micro_batches(self.target.batch_size)[1]  # a graph is compiled once, run per micro-batch
        fwd_a, fwd_b = (sum(op.phase == FORWARD for op in t.ops) // n for t in (a, b))
        graph = GraphSize(forward_ops=int(extrapolate(fwd_a, fwd_b, d, e, full)), block_ops=max(1, (fwd_b - fwd_a) // (e - d)))
        m = Measured(peak_bytes=peak, used_lower=int(peak * (1 - PEAK_MARGIN)) + b.context_bytes, graph=graph, ops=ops,
                     pair=None if ops is not None else (a.ops, b.ops, d, e, full), managed_bytes=managed, host_bytes=host)
        self.measured[plan] = m
        self._new.append(plan)
        return m

    def _replayed_peak(self, plan: Plan, a, b, pair: tuple[int, int]) -> int | None:
        """The peak of the pair's allocations replayed at full depth (None: they do not line up): a pair at one
        unit may peak in another phase than deeper (NOTE [ Blocks of several kinds ]; Nemotron-H's line: 57%
        high, its replay exact, for 0.3-0.4 s a plan of Gemma-3-12B)."""
        t0 = time.process_time()
        deep = deepen(a.stream, b.stream, *pair, self.depth) if a.stream is not None and b.stream is not None else None
        peak = replay(deep, STEADY_STEP)[0] if deep is not None else None
        self._spend("deep stream replay", time.process_time() - t0)
        return peak

    def confirm(self, plan: Plan) -> Measured:
        """The plan's figures at full depth: its deep stream checked at a third depth (NOTE [ The deep stream
        checked at a third depth ] in memfit.planner.deep_figures), else its full trace, what ``memfit estimate``
        reports, and its ops at full depth."""
        m = self.measured.get(plan)
        if m is not None and m.full:
            return m
        if (checked := self.confirmed_at_third(plan)) is not None:
            return checked
        (t,) = self._run([(plan, None, None)])
        forward = sum(op.phase == FORWARD for op in t.ops) // plan.micro_batches(self.target.batch_size)[1]
        graph = GraphSize(forward_ops=forward, block_ops=m.graph.block_ops if m else forward // max(1, self.depth or 1))
        used = self._counted(plan, t.used_bytes, lambda: t.expandable_used_bytes, t.managed_bytes)
        m = Measured(peak_bytes=t.peak_bytes, used_lower=t.peak_bytes + t.context_bytes, used_bytes=used,
                     graph=graph, ops=t.ops, full=True, managed_bytes=t.managed_bytes, host_bytes=t.host_bytes)
        self.measured[plan] = m
        self._new.append(plan)
        return m

    # NOTE [ Expandable segments where they decide the fit ]
    # Expandable segments change no tensor and no kernel, only how the caching allocator holds what
    # the step allocates: its reserved bytes come from the same trace, replayed by the other allocator
    # model (NOTE [ Reserved bytes with expandable segments, from the same trace ] in
    # memfit.techniques.allocator). So the planner does not search them as a value (that would double
    # the plans for no trace), but each plan whose reserved bytes are over the budget with PyTorch's
    # default segments and within it with expandable ones fits: with ``allocator: expandable``, which
    # the chosen plan then carries (memfit.planner.search). Where the default segments fit, the plan
    # is the user's as written: no default changes the allocator. This is PyTorch's own advice when
    # "reserved but unallocated" memory ran a step out of memory.
    def _counted(self, plan: Plan, used: int, expanded, managed: int) -> int:
        """The allocator side the book keeps for ``plan``: ``used`` (the default segments'), or ``expanded()``
        (expandable segments'; None: no such figure) where only that fits, the plan then kept in
        :attr:`expands`. ``expanded`` is asked only of a plan over the budget."""
        budget = self.budget
        if plan.config("allocator").expands or budget.counted(used, managed) <= budget.bytes:
            return used
        other = expanded()
        if other is None or budget.counted(other, managed) > budget.bytes:
            return used
        self.expands.add(plan)
        return other

    def expanded(self, plan: Plan) -> Plan:
        """``plan`` with ``allocator: expandable``, its figures in this book those ``plan`` has here (the
        same traces: NOTE [ Expandable segments where they decide the fit ])."""
        twin = plan.replace(allocator="expandable")
        if plan in self.measured:
            self.measured[twin] = self.measured[plan]
        for (p, d, b), t in list(self._traced.items()):
            if p == plan and isinstance(t, Traced):
                self._traced[(twin, d, b)] = t._replace(used_bytes=t.expandable_used_bytes or t.used_bytes)
        if plan in self._deep:
            self._deep[twin] = self._deep[plan]
        return twin

    def lower_bound(self, plan: Plan, batch: int) -> int:
        """The lower bound of what ``plan`` at ``batch`` needs (a micro-batch's step: what the
        plan split into micro-batches of ``batch`` holds at its peak, but the accumulated gradients)."""
        pair = self.depths(plan)
        if pair:
            try:
                a, b = self._run([(plan, d, batch) for d in pair])
                peak = extrapolate(a.peak_bytes, b.peak_bytes, *pair, self.depth)
                return int(peak * (1 - PEAK_MARGIN)) + b.context_bytes
            except ShallowFailed:
                pass
        (t,) = self._run([(plan, None, batch)])
        return t.peak_bytes + t.context_bytes

    def ops_of(self, plan: Plan) -> list:
        """The full-depth ops of a measured plan."""
        pair = self.depths(plan)
        if pair and not isinstance(self._traced.get((plan, None, None)), Traced):
            a, b = self._run([(plan, d, None) for d in pair])
            ops = extrapolate_ops(a.ops, b.ops, *pair, self.depth)
            if ops is not None:
                return ops
        (t,) = self._run([(plan, None, None)])
        return t.ops

    def newly_measured(self) -> list[Plan]:
        """Plans measured since the last call."""
        new, self._new = self._new, []
        return new

    def is_measured(self, plan: Plan) -> bool:
        return plan in self.measured

    def is_confirmed(self, plan: Plan) -> bool:
        m = self.measured.get(plan)
        return m is not None and m.full

    def has_full_trace(self, plan: Plan, full_depth: bool = False) -> bool:
        """The plan's top rung ran (or failed): its full trace, or (unless ``full_depth``) its trace at the third
        depth (NOTE [ The deep stream checked at a third depth ])."""
        return (plan, None, None) in self._traced or not full_depth and self.checked_at_third(plan)

    def has_shallow_traces(self, plan: Plan) -> bool:
        """Its shallow pair ran (or failed): :meth:`measure` costs no trace (a full trace where it has none)."""
        pair = self.depths(plan)
        return all((plan, d, None) in self._traced for d in pair) if pair else self.has_full_trace(plan)

    def depths(self, plan: Plan) -> tuple[int, ...]:
        """The depths of the plan's shallow pair (none: it is traced at full depth)."""
        if not self.depth or self.shallow_failed:
            return ()
        moved = offloaded_blocks(plan) or plan.swap_blocks  # (a share of all the stacks' blocks: NOTE [ Stacks of
        share = offloaded_blocks(plan) or 0 < plan.swap_blocks < sum(self.stacks.lengths)  # unrelated depths ], [ Blocks of several kinds ])
        if any(self.stacks.offsets) and moved and (offloaded_blocks(plan) or plan.swap_blocks > sum(self.stacks.tail)):
            return ()  # (swapped blocks behind the stacks of an offset: NOTE [ Stacks of unequal blocks ])
        pair = depths(plan, self.depth, self.stacks.least, self.stacks.unit) or ()
        if self.stacks.kinds and max(self.stacks.unit) > 1 and share and not swapped_in_units(plan, pair, self.stacks):
            return ()
        return pair

    # -- running traces together -----------------------------------------------------------------
    def trace_shallow(self, plans: list[Plan], behind: list[tuple] = (), skip_over: bool = False) -> None:
        """Run the shallow pairs of ``plans`` together (in parallel; :meth:`measure` then reads them);
        the jobs ``behind`` are queued after them, in the background (memfit.planner.workers).
        ``skip_over``: a plan over the budget at its shallower depth is not traced deeper (NOTE [ The
        deeper trace of a plan over the budget at the shallower depth ] in memfit.planner.gpu_ladder)."""
        jobs = self.jobs(plans)
        rest = [j for j in dict.fromkeys(behind) if j not in jobs and j not in self._traced]
        self._run(jobs, check=False, behind=rest, skip_over=skip_over and len(plans) > 1)

    def trace_full(self, plans: list[Plan], behind: list[tuple] = ()) -> None:
        """Trace ``plans`` at full depth together; ``behind``: shallow jobs queued after them (not full ones: a worker held)."""
        self._run([self.top_job(p) for p in plans], check=False, behind=[j for j in behind if j[1] and j not in self._traced])

    def queue_shallowest(self, plans: list[Plan]) -> None:
        """The shallowest trace of each of ``plans`` (those with a pair) queued in the background, in
        place of the plans queued before (NOTE [ The next round's traces in the background ] in
        memfit.planner.walk); the base's traces at other micro-batch sizes stay queued, behind them."""
        micro = [j for j in self.workers.cancel() if j[2] is not None]  # (the base at a micro-batch size: kept)
        jobs = [(p, pair[0], None) for p in plans for pair in [self.depths(p)] if pair]
        self.workers.start([j for j in [*jobs, *micro] if j not in self._traced])

    def cancel_queued(self) -> None:
        """Drop the jobs queued in the background and not started (those running finish)."""
        self.workers.cancel()

    def jobs(self, plans: list[Plan]) -> list[tuple]:
        """The shallow pairs (or full traces) of ``plans``, the shallower depth of every plan first: the
        deeper trace of a plan that compiles comes later, and finds its graphs in Inductor's cache
        (NOTE [ Predicted wrappers in Inductor's caches ])."""
        pairs = [self.depths(p) or (None,) for p in plans]
        jobs = [(p, pair[i], None) for i in range(max(map(len, pairs), default=0)) for p, pair in zip(plans, pairs)
                if i < len(pair)]
        for d in dict.fromkeys(d for _, d, _ in jobs if d is not None):  # (here: the forked workers share them)
            self.tracer.shallow(d)
        return jobs

    def _shallow_lower(self, t: Traced) -> int:
        """A lower bound of the full plan's need from one shallow trace (more blocks hold no less)."""
        return int(t.peak_bytes * (1 - PEAK_MARGIN)) + t.context_bytes

    def _skip_deeper(self, job: tuple, shallower) -> bool:
        return isinstance(shallower, Traced) and self._shallow_lower(shallower) > self.budget.bytes

    def _run(self, jobs: list[tuple], check: bool = True, behind: list[tuple] = (),
             skip_over: bool = False) -> list[Traced]:
        """The traces of ``jobs``, kept; those not traced yet run on the worker processes. ``check``:
        raise the first job's error (a plan's UserError, or ShallowFailed when a shallow trace failed
        for another reason: then shallow traces stop); ``behind``: jobs queued after them, in the
        background, for a later call to take."""
        todo = list(dict.fromkeys(j for j in jobs if j not in self._traced))
        after = _after_shallowest(todo, _shares_compiles)
        todo.sort(key=lambda job: job not in after.values())  # (the compiles first: the longest jobs)
        if skip_over:  # each deeper shallow trace after its plan's shallower one (which may make it needless)
            after = {**_after_shallowest([j for j in todo if j[1] is not None], lambda plan: True), **after}
        t0 = time.perf_counter()
        if todo and self.progress is not None:
            kinds = sorted({_kind(j) for j in todo})
            self.progress.rung(f"{self.phase}: {len(todo)} {' and '.join(kinds)} trace{'s' if len(todo) > 1 else ''}")
        for job, result in zip(todo, self.workers.map(todo, after=after, behind=list(behind),
                                                      skip=self._skip_deeper if skip_over else None)):
            if job in self._traced:  # (a search in turns asked it too, and kept it first: counted once)
                continue
            self._traced[job] = result
            if result is SKIPPED:
                continue
            if isinstance(result, Traced):
                self.traces += 1
                self.full_traces += job[1] is None
                self._spend("third depth" if job in self.third_jobs else _kind(job), result.seconds)
            elif job[1] is not None and not isinstance(result, UserError) and job not in self.third_jobs:
                self.shallow_failed = self.shallow_failed or f"{type(result).__name__}: {result}"
        self.seconds_spent += time.perf_counter() - t0
        out = [self._traced[j] for j in jobs]
        for job, result in zip(jobs, out if check else ()):
            if isinstance(result, UserError):
                raise result
            if isinstance(result, Exception):
                if job[1] is None:
                    raise result
                raise ShallowFailed(str(result))
        return out

    def _spend(self, kind: str, seconds: float) -> None:
        entry = self.spent.setdefault(f"{self.phase}: {kind}", [0, 0.0])
        entry[0] += 1
        entry[1] += seconds


def _kind(job: tuple) -> str:
    """A trace job's kind, as :attr:`TraceBook.spent` counts it."""
    kind = "full-depth" if job[1] is None else "shallow"
    return kind + (" (micro-batch)" if job[2] is not None else "")


EXPANDED = ("the chosen plan fits only with expandable segments (allocator: expandable, what "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True sets): with PyTorch's default segments its reserved bytes "
            "are over the budget")


def with_expandable(chosen, book: TraceBook | None) -> list[str]:
    """A chosen plan (a memfit.planner.candidate.Candidate) that fits only with expandable segments carries
    them (NOTE [ Expandable segments where they decide the fit ]); the note that says so, if it does."""
    if chosen is None or book is None or chosen.plan not in book.expands:
        return []
    chosen.plan = book.expanded(chosen.plan)
    return [EXPANDED]
