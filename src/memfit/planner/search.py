"""plan(): the fastest plan that fits, found on predictions.

1. Enumerate the valid plans of the search space (memfit.planner.space).
2. Predict every plan's step time: on the CPU by short real steps (memfit.planner.cost, final);
   on GPU presets by the ops of each plan's own step (memfit.planner.gpu_time: estimated from each
   technique value alone, memfit.planner.baseline, then the plan's own ops, from the shallow traces
   of the plans the walk visits). The time model and the evidence ladder are built side by side:
   on GPU presets over one book of traces (memfit.planner.traces), which both read. Compile
   time is shown beside it, and counted per step when the run's length is given (``steps``: step +
   compile / steps), so a short run can prefer an eager plan.
3. Walk the plans fastest first (memfit.planner.walk, over memfit.planner.ladder's evidence); predict the memory of each with a fake-tensor
   trace of the real TrainStep (on GPU presets: a shallow lower bound first, a full trace, as
   ``estimate`` runs it, for the plan chosen). The first that fits is the answer, and its reason
   names the faster plans it beat on memory and the next ones it beat on time.
4. Prune without tracing: a plan that saves no more memory in any dimension than a plan that
   already did not fit cannot fit either (techniques are assumed not to *add* memory). The
   maximal plans (none saves less than another everywhere) are traced first: when none of them
   fits, nothing does, and the smallest of their footprints is the budget to ask for.

Budget: ``--budget 20GiB``, ``--budget 80%`` of the device, or when omitted the device's capacity
minus headroom (10%); what counts against it is :class:`~memfit.memory.budget.Budget`'s: on a GPU
preset the caching allocator's *reserved* bytes plus the CUDA context; for the CPU, device and
host bytes together (one memory).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from memfit.devices import Device
from memfit.errors import CompileFailed, UserError
from memfit.hosts import host_for
from memfit.memory.budget import Budget
from memfit.memory.reference_kernels import missing_libraries_note
from memfit.planner import cost
from memfit.planner.baseline import Baseline
from memfit.planner.candidate import Candidate, Status
from memfit.planner.feasibility import maximal, splits
from memfit.planner.field_recipes import field_plans, settle_recipes
from memfit.planner.given_fields import check_suits, constrain, unsuited
from memfit.planner.gpu_ladder import GpuLadder
from memfit.planner.gpu_time import GpuStepModel
from memfit.planner.ladder import FakeTrace, Ladder
from memfit.planner.progress import NoProgress
from memfit.planner.roofline import for_host
from memfit.planner.simpler import settle_simpler
from memfit.planner.space import (
    STATE_BYTES_AT_MOST,
    block_input_bytes,
    candidates,
    default_space,
    drop_unused,
    leave_out_optimizer_choices,
    leave_out_states_that_cannot_fit,
    leave_out_weights_that_cannot_fit,
    model_facts,
)
from memfit.planner.time_model import StepTimeModel
from memfit.planner.traces import TraceBook, with_expandable
from memfit.planner.walk import Walk
from memfit.planner.weight_floor import WeightFloor, check_budget_above_weights, leave_out_heavier_than
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target, checkpoint_fields
from memfit.techniques.compile import mode_failed
from memfit.techniques.quantized_experts import quantizes_experts
from memfit.units import fmt_bytes
from memfit.workload import Workload


@dataclass
class PlanResult:
    workload: str
    device: str
    batch_size: int
    budget_bytes: int
    time_model: str
    chosen: Candidate | None
    candidates: list[Candidate] = field(default_factory=list)
    traces: int = 0
    seconds: float = 0.0
    smallest: Candidate | None = None
    """When nothing fits: the plan with the smallest footprint found, and its footprint."""
    run_steps: int | None = None
    """The run's length compile time was spread over (None: not counted)."""
    notes: list[str] = field(default_factory=list)
    """Techniques left out of the search here, and why."""
    trace_seconds: dict = field(default_factory=dict)
    """GPU presets: ``"<phase>: <kind of trace>"`` -> [traces, CPU seconds in the processes that ran them]
    (memfit.planner.traces.TraceBook.spent): where the planning time went."""
    trainable: int | None = None
    """The parameters the plans train (None: not counted, with a search space of the caller's)."""
    seq_len: int | None = None
    """Tokens per sample of a text workload (None: throughput is counted in samples)."""
    least_bytes: int | None = None
    """When no plan was searched: what every plan keeps on the device (memfit.errors.WeightsExceedBudget)."""
    limited: bool = False
    """The trace limit left a faster plan untraced: the plan chosen may not be the fastest that fits."""
    slower_than: float | None = None
    """The step time a plan had to beat to be searched (None: any; nothing chosen: none faster fits)."""
    host_budget_bytes: int | None = None
    """The training machine's memory the plans' host copies were held to (None: not checked)."""
    approximations: list[str] = field(default_factory=list)
    """What every plan's figures assume of this machine (NOTE [ Kernel libraries missing here ])."""

    @property
    def throughput_unit(self) -> str:
        return "tokens/s" if self.seq_len else "samples/s"

    def throughput(self, c: Candidate) -> float:
        """Tokens (text workloads: batch x sequence length) or samples a second at ``c``'s step time."""
        return self.batch_size * (self.seq_len or 1) / c.seconds if c.seconds > 0 else 0.0

    def to_json(self) -> dict:
        def row(c: Candidate) -> dict:
            rate = "tokens_per_second" if self.seq_len else "samples_per_second"
            return {"plan": c.plan.to_dict(), "predicted_step_seconds": c.seconds, rate: self.throughput(c),
                    "steady_step_seconds": c.step_seconds if c.step_seconds is not None else c.seconds,
                    "compile_seconds": c.compile_seconds, "status": c.status.value,
                    "reason": c.reason, "used_bytes": c.used_bytes, "peak_bytes": c.peak_bytes,
                    "changes_numerics": list(c.plan.numerics), "managed_bytes": c.managed_bytes,
                    "host_bytes": c.host_bytes, "recipe": c.recipe.name if c.recipe is not None else None}
        evaluated = [c for c in self.candidates if not c.open]
        return {"workload": self.workload, "device": self.device, "batch_size": self.batch_size,
                "budget_bytes": self.budget_bytes, "host_budget_bytes": self.host_budget_bytes, "time_model": self.time_model, "run_steps": self.run_steps,
                "chosen": row(self.chosen) if self.chosen else None, "traces": self.traces,
                "planning_seconds": self.seconds, "candidates_total": len(self.candidates), "trace_limited": self.limited,
                "smallest": row(self.smallest) if self.smallest else None, "least_bytes": self.least_bytes,
                "notes": self.notes, "approximations": self.approximations,
                "trace_seconds": {k: [n, round(sec, 2)] for k, (n, sec) in self.trace_seconds.items()},
                "ranked": [row(c) for c in evaluated[:50]],
                "field_recipes": [row(c) for c in self.candidates if c.recipe is not None]}


def resolve_budget(budget: str | int | None, device: Device) -> int:
    """The budget in bytes (see :meth:`memfit.memory.budget.Budget.resolve`)."""
    return Budget.resolve(budget, device).bytes


# NOTE [ A searched compile mode the model cannot take ]
# The default plan every value is measured against has the first compile mode searched (memfit.planner.
# baseline): ``--compile-modes blocks`` makes every candidate compiled. Where torch.compile cannot capture
# the model in that mode (a block that breaks the graph, an op Dynamo cannot run on fake tensors), the
# search would end in that error, as ``--compile blocks`` does, although the user asked only which modes
# to try. So the mode is left out and the search runs again with the others, or eager where none is left;
# the report's first note says what broke and what was planned instead. A mode given as a plan field
# (``--compile blocks``) is the user's step, and its failure stays an error.
def plan(workload: Workload | str, *, budget: str | int | None = None, device: str | Device = "cpu",
         batch_size: int | None = None, seq_len: int | None = None,
         optimizers: tuple[str, ...] | None = None, max_traces: int = 60,
         time_model: StepTimeModel | None = None, space=None, fixed: dict | None = None,
         compile_modes: tuple[str, ...] | None = None, steps: int | None = None, progress=None,
         narrow_optimizer: bool = True, alongside: bool = True, host=None, field_recipes: bool = True,
         too_big: dict[Plan, tuple[int, str]] | None = None, slower_than: float | None = None,
         host_memory: str | int | None = None, runs_in: Callable[[Plan], bool] | None = None,
         swap_everywhere: bool = False, search_values: dict | None = None,
         _book: TraceBook | None = None) -> PlanResult:
    """The fastest plan for ``workload`` whose predicted memory fits ``budget`` on ``device``.

    ``fixed``: plan fields the user set (``--precision bf16``); the search covers the others.
    ``compile_modes``: the compile modes to search (None: the device's default). ``steps``: the run's
    length; compile time then counts as compile seconds / steps per step (None: a long run).
    ``progress``: a memfit.planner.progress.PlanProgress to report to (None: nothing shown).
    ``narrow_optimizer``: fix the optimizer's keys where the trained parameters are few (NOTE [ Optimizer
    choices that cannot matter ] in memfit.planner.space); when nothing fits so, plan again without.
    ``alongside``: idle workers trace the next plans' full traces while one is confirmed (False where
    other searches use the cores: memfit.planner.side_by_side). ``host``: the machine that trains, for
    the host part of GPU step times (memfit.hosts: a preset's name, a multiple, or None for the default).
    ``field_recipes``: plan the field's published recipes beside the search's own (memfit.planner.
    field_recipes; GPU presets; False where the report lists no recipe: ``--methods``' table).
    ``too_big``: plans known not to fit, with a lower bound of their need and why (memfit.planner.failures).
    ``slower_than``: seconds a step must beat to be of use (memfit.planner.search_max); plans estimated
    no faster are not walked, and where none faster fits, nothing is chosen. ``host_memory``: the
    training machine's memory for the plans' host copies (memfit.memory.budget.Budget.with_host).
    ``runs_in``: only plans this holds for are searched (the trainer that will run the plan:
    memfit.integrations.kohya_export.runs_in_sd_scripts). ``swap_everywhere``: search ``swap_blocks`` whatever
    the weights' share of the budget (where it was left out by that share and nothing fit, the search is run
    again so: NOTE [ Swap searched when nothing fits ]). ``search_values``: values a trainer runs in place of a
    technique's own (``{"loss_chunks": [0, 32]}``: Liger's slices for axolotl's and LLaMA-Factory's chunked loss).
    """
    progress = progress or NoProgress()
    t0 = time.perf_counter()
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise UserError(f"plan: steps must be a whole number >= 1 (the run's length), got {steps!r}")
    target = Target.resolve(workload, None, batch_size, device, seq_len=seq_len)
    wl, dev, bs = target.workload, target.device, target.batch_size
    fixed = checkpoint_fields(fixed, wl, dev)  # (a pre-quantized or adapter checkpoint's own fields)
    budget_obj = Budget.resolve(budget, dev).with_host(host_memory)
    budget_bytes = budget_obj.bytes
    facts = model_facts(wl)
    world = int(fixed.get("world_size") or 1)
    if world > 1 and not dev.is_gpu:
        raise UserError(f"plan --world-size {world} times sharded plans on GPU presets (on the CPU the planner times "
                        "real steps, which a sharded plan runs in several processes); give --device, e.g. h100-80gb")
    check_budget_above_weights(budget_bytes, facts, dev, world, fixed.get("base_weights"), fixed.get("adapter"))
    if not dev.is_gpu and time_model is None:
        cost.check_real_steps_fit(wl, facts)
    rank_bs = Plan(world_size=world).config("shard").rank_batch(bs)  # (a sharded rank's micro-batches split this)
    custom_space = space is not None
    space = space or default_space(facts, dev, rank_bs, optimizers, compile_modes, budget_bytes=budget_bytes,
                                   base_weights=(fixed or {}).get("base_weights"), run_steps=steps,
                                   coupled_samples=wl.info.coupled_samples, swap_everywhere=swap_everywhere,
                                   block_inputs=lambda: block_input_bytes(wl, facts.model, rank_bs),
                                   search_values=search_values)
    offered = {k: list(v) for k, v in space.values.items()}
    given_fields = dict(fixed or {})
    fixed, constrained = constrain(space, dict(given_fields), dev, rank_bs)
    check_suits(target, constrained, given_fields)
    trainable = None if custom_space else _trainable(target, facts, given_fields)
    narrowed = narrow_optimizer and not custom_space and leave_out_optimizer_choices(  # NOTE [ Optimizer choices that cannot matter ]
        space, trainable, budget_bytes, set(given_fields) | ({"optimizer"} if optimizers else set()))
    given = Plan().replace(**given_fields)
    if not custom_space and world == 1 and given.config("base_weights").is_default:
        leave_out_weights_that_cannot_fit(space, facts, budget_bytes)
    if not custom_space and world == 1 and given.config("adapter").is_default:
        leave_out_states_that_cannot_fit(space, facts, budget_bytes, dev)
    for m in space.micro_batches:
        Plan(micro_batch_size=m if m != rank_bs else None).micro_batches(rank_bs)
    plans = candidates(space, rank_bs)
    if fixed:  # fields outside the search space (ema, bf16_update, ...) apply to every candidate
        kept = []
        for p in plans:
            try:
                kept.append(p.replace(**fixed))
            except UserError:
                continue
        plans = kept
    if runs_in is not None:
        plans = [p for p in plans if runs_in(p)]
    if not plans:
        raise UserError("plan: no valid plan is left with the fields you fixed" + (
            " that the chosen format's trainer runs" if runs_in is not None else "") + "; remove some of the plan flags")
    if dev.is_gpu and world == 1 and not custom_space:  # NOTE [ Plans whose weights alone exceed the budget ]
        plans = leave_out_heavier_than(plans, WeightFloor(facts.model), budget_bytes - dev.context_bytes, space.notes)
    drop_unused(space, plans)
    recipes, recipe_notes = ({}, []) if custom_space or world > 1 or time_model is not None or not field_recipes else \
        field_plans(wl, given_fields, offered, dev, mostly_frozen=trainable is not None and trainable < facts.n_params / 2,
                    n_params=facts.n_params)
    space.notes.extend(recipe_notes)
    known = set(plans)
    plans += [p for p in recipes if p not in known and (runs_in is None or runs_in(p))]
    progress.stage("timing techniques")

    def again_with(**changes) -> PlanResult:  # (this search again, with ``changes``: the user's arguments as given)
        return plan(**{**dict(workload=workload, budget=budget, device=device, batch_size=batch_size, seq_len=seq_len,
                                optimizers=optimizers, max_traces=max_traces, time_model=time_model, fixed=given_fields,
                                compile_modes=compile_modes, steps=steps, progress=progress,
                                narrow_optimizer=narrow_optimizer, alongside=alongside, host=host,
                                field_recipes=field_recipes, too_big=too_big, slower_than=slower_than,
                                host_memory=host_memory, runs_in=runs_in, swap_everywhere=swap_everywhere),
                          **changes})
    book = None
    widen = swap = False
    try:
        with silenced_warnings():
            if time_model is not None:
                model, ladder = time_model, Ladder(FakeTrace(target, budget_obj))
            elif dev.is_gpu:
                book, model, ladder = gpu_search(target, space, facts, budget_obj, fixed, host=host, book=_book)
                book.progress = progress
            else:
                model, ladder = cost.calibrate(target, space, progress=progress), Ladder(FakeTrace(target, budget_obj))
        try:
            result = _search(t0, target, budget_obj, space, plans, constrained, model, ladder, steps, max_traces,
                             progress, alongside, book, recipes, too_big, trainable, slower_than)
            if book is not None:
                result.trace_seconds = book.spent
            widen = narrowed and result.chosen is None and slower_than is None
            swap = not widen and result.chosen is None and slower_than is None and "swap_blocks" in space.narrowed \
                and "swap_blocks" not in given_fields
        finally:
            model.close()
            if book is not None and not (widen or swap):
                book.close()
    except CompileFailed as e:  # NOTE [ A searched compile mode the model cannot take ]
        modes = list(space.values.get("compile") or [])
        if "compile" in given_fields or custom_space or not modes or modes[0] == "none" or not mode_failed(e):
            raise
        left = tuple(m for m in modes if m != modes[0]) or ("none",)
        again = again_with(compile_modes=left)
        instead = "without compile" if left == ("none",) else f"with compile: {', '.join(left)}"
        again.notes.insert(0, f"compile: {modes[0]} left out: {e.what}; planned {instead}")
        again.seconds = time.perf_counter() - t0
        return again
    result.trainable = trainable
    result.approximations = missing_libraries_note(facts.model)  # NOTE [ Kernel libraries missing here ]
    if swap:  # NOTE [ Swap searched when nothing fits ]
        try:
            again = again_with(swap_everywhere=True, _book=book)
        finally:
            if book is not None:
                book.close()
        again.notes.insert(0, "swap_blocks at first (the weights alone leave room for activations); then searched, "
                              "as nothing fit without it")
        again.traces += result.traces if book is None else 0
        again.seconds = time.perf_counter() - t0
        return again
    if widen:  # NOTE [ Optimizer choices that cannot matter ]: no answer is lost (on the same book of traces)
        try:
            again = again_with(narrow_optimizer=False, _book=book)
        finally:
            if book is not None:
                book.close()
        again.traces += result.traces if book is None else 0  # (a book counts its traces: the wide search's has both)
        again.seconds = time.perf_counter() - t0
        return again
    return result


# NOTE [ Swap searched when nothing fits ]
# ``swap_blocks`` is searched where the weights take most of the budget (memfit.techniques.swap_blocks), as
# its traces are costly and a model with room beside its weights fits without it. But a plan also holds what
# its trained parameters need: a LoRA of rank 128 with Prodigy over Z-Image and its Qwen3-4B on a 16 GB card
# keeps 5.4 GB of adapter, gradients and states beside 10 GB of fp8 weights, so nothing fit unswapped and no
# swap was tried. Where nothing fits and the share left swap out, the search runs again with it (on the same
# traces): a slower answer only where there was none.
def gpu_search(target: Target, space, facts, budget: Budget, fixed: dict | None = None, host=None,
               book: TraceBook | None = None) -> tuple[TraceBook, GpuStepModel, GpuLadder]:
    """A GPU preset's search: one book of traces, and the time model and the evidence ladder that
    read it, side by side (``fixed``: plan fields outside the search space that every candidate
    has; ``host``: the training machine, memfit.hosts; ``book``: an earlier search's of the same target,
    whose traces are kept). The caller closes the book (its worker processes)."""
    if book is None:
        book = TraceBook(target, facts, budget, world=int((fixed or {}).get("world_size") or 1))
    book.phase = "before the walk"
    baseline = Baseline(book, space, fixed)
    host = host_for(host, target.device)
    return book, GpuStepModel(book, baseline, k=for_host(host), host=host), GpuLadder(book, baseline)


def _trainable(target: Target, facts, given: dict) -> int:
    """The parameters the plans train: the adapter's (``given``: the fields the user fixed), or the
    model's that require gradients (a model the user froze most of: a PEFT model of their own).
    An adapter's parameters are the same on quantized base weights (a quantized layer keeps the
    linear's features, and the adapter targets the same names), so the count builds the adapter on
    the workload's own weights: quantizing every weight on fake tensors, Qwen2.5-7B's QLoRA search
    spent 2 s more before its first trace. A pre-quantized checkpoint is built as it loads, and quantized experts
    too (an adapter's default targets adapt them where they are not: memfit.techniques.quantized_experts)."""
    from memfit.memory.faketrace import trainable_parameters
    quantized = target.workload.info.quantized is not None or quantizes_experts(given.get("base_weights"))
    kept = ("adapter", "base_weights") if quantized else ("adapter",)
    keys = {k: v for k, v in given.items() if k in kept}
    if Plan(**keys).config("adapter").is_default:
        return sum(p.numel() for p in facts.model.parameters() if p.requires_grad)
    with silenced_warnings():
        return trainable_parameters(target.with_plan(Plan(**keys)))


def _search(t0: float, target: Target, budget_obj: Budget, space, plans: list[Plan], constrained: dict,
            model: StepTimeModel, ladder: Ladder, steps: int | None, max_traces: int, progress,
            alongside: bool = True, book: TraceBook | None = None, recipes: dict | None = None,
            too_big: dict | None = None, trainable: int | None = None, slower_than: float | None = None) -> PlanResult:
    recipes = recipes or {}
    wl, dev, bs, budget_bytes = target.workload, target.device, target.batch_size, budget_obj.bytes
    whole = [c.plan for c in maximal([Candidate(p, 0.0) for p in plans if p not in recipes], bs)
             if not splits(c.plan, bs)] if alongside else None  # (--methods: the searches share the cores)
    with silenced_warnings():
        model.prepare(ahead=whole)  # NOTE [ The walk's first traces behind the measuring ]
    for name, value in constrained.items():
        if not space.values[name]:  # the time model's runs found that the value does not suit the workload
            why = next((x.split(": ", 1)[-1] for x in model.excluded if x.startswith(f"{name}=")), "")
            raise unsuited(wl, name, value, why)
    plans = [p for p in plans if p in recipes or all(getattr(p, n) in v for n, v in space.values.items())]  # after exclusions
    ranked = [Candidate(p, 0.0, recipe=recipes.get(p)) for p in plans]
    for c in ranked:
        c.retime(model, steps)
    walk = Walk(bs, budget_obj, model, ladder, steps, max_traces, progress, alongside)
    walk.failed.states_bytes = None if trainable is None else 2 * STATE_BYTES_AT_MOST * trainable
    walk.failed.known(ranked, too_big or {})
    capped = {id(c) for c in ranked if slower_than is not None and c.open and c.seconds >= slower_than}
    for c in (c for c in ranked if id(c) in capped):  # (not walked, nor among the maximal plans it traces)
        c.outrun(f"estimated no faster than {slower_than:.3g} s, what a step must beat here (not traced)")
    if book is not None:
        book.phase = "walk"
    chosen = walk.run([c for c in ranked if id(c) not in capped])
    with silenced_warnings():  # (memfit.planner.field_recipes: each shown with figures of its own)
        chosen = settle_recipes(walk, [c for c in ranked if c.recipe is not None], chosen)
        chosen = settle_simpler(walk, ranked, chosen)  # NOTE [ A technique pays for itself ]
    if chosen is None and slower_than is None and not any(c.used_bytes is not None for c in ranked):
        invalid = next((c for c in ranked if c.status is Status.INVALID), None)
        reason = invalid.reason.removeprefix("plan: ") if invalid else "no candidate plan is left"
        raise UserError(f"plan: no candidate plan can run {wl.name}: {reason}")
    ranked.sort(key=lambda c: c.seconds)
    expanded_note = with_expandable(chosen, book)
    if chosen is not None:
        label_the_rest(ranked, chosen, model.is_estimate)
        chosen.choose(_why_chosen(chosen, ranked, bs))
    result = PlanResult(workload=wl.name, device=dev.name, batch_size=bs, budget_bytes=budget_bytes,
                        time_model=model.describe(), chosen=chosen, candidates=ranked, traces=walk.traces,
                        seq_len=wl.info.seq_len, limited=walk.limited, slower_than=slower_than,
                        host_budget_bytes=budget_obj.host_bytes,
                        run_steps=steps, notes=[*([wl.info.loaded] if wl.info.loaded else []), *space.notes,
                                                *(f"{x} (left out)" for x in model.excluded), *walk.notes, *expanded_note])
    # NOTE [ The trace limit before a faster plan ]: the walk stopped at ``max_traces`` with nothing chosen, so the
    # smallest plan traced is chosen where it fits: not the fastest that fits (GPT-2 124M, H100 preset, 1.55 GiB,
    # --steps 1000: 250 ms). The reason and a note say so, how many faster plans are untraced, and the flag.
    if chosen is None:  # nothing fits (or the trace limit came first): the smallest footprint seen
        result.smallest = walk.smallest(ranked)
        if result.smallest is not None and result.smallest.used_bytes <= budget_bytes:  # a lower bound erred high
            chosen = result.chosen = result.smallest
            result.notes += with_expandable(chosen, book)
            limit = ""
            if walk.limited:  # NOTE [ The trace limit before a faster plan ]
                faster = sum(1 for c in ranked if c.open and c.used_bytes is None and c.seconds < chosen.seconds
                             and not walk.failed.rule_out(c))  # (not those a failure rules out)
                limit = f"; the trace limit ({max_traces}) came first: {faster} plans predicted faster left untraced, " \
                        f"--max-traces {2 * max_traces} traces more"
            chosen.choose("the smallest plan found, confirmed to fit by a full trace" + limit)
            result.notes += [limit.removeprefix("; ")] if limit else []
        for c in ranked:
            if c.open and c.used_bytes is None:
                c.note(c.reason or "nothing fits: a plan saving at least as much did not fit")
    result.seconds = time.perf_counter() - t0
    return result


def label_the_rest(ranked: list[Candidate], chosen: Candidate, is_estimate) -> None:
    """The plans left open once ``chosen`` is: slower ones as such; one predicted faster was not traced (the
    search chose a lighter plan within 1%, or its trace limit came first), so it is not called slower."""
    for c in ranked:
        if c.open and c is not chosen:
            share, said = c.seconds / chosen.seconds, " (estimated)" if is_estimate(c.plan) else ""
            if share < 1:
                c.leave_untried(f"predicted {share:.4f}x the chosen plan's time{said}, not traced")
            else:
                c.outrun(f"{share:.2f}x the chosen plan's time{said}")


def _why_chosen(chosen: Candidate, ranked: list[Candidate], bs: int) -> str:
    """The alternatives the chosen plan beat and by how much: the faster plans that did not fit, the
    next fastest after it."""
    faster = [c for c in ranked if c.status is Status.TOO_BIG and c.seconds < chosen.seconds]
    slower = [c for c in ranked if c.status is Status.SLOWER][:2]
    parts = ["fastest predicted plan that fits"]
    traced = [c for c in faster if c.used_bytes is not None]
    if traced:
        best = traced[0]
        parts.append(f"{len(faster)} faster plan{'s' if len(faster) > 1 else ''} did not fit (fastest: "
                     f"{best.plan.short(bs)}, {best.seconds / chosen.seconds:.2f}x its time, "
                     f"{fmt_bytes(best.used_bytes)})")
    if slower:
        parts.append("next: " + ", ".join(f"{c.plan.short(bs)} {c.seconds / chosen.seconds:.2f}x" for c in slower))
    return "; ".join(parts)
