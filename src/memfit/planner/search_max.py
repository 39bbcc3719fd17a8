"""``memfit plan --batch-size max`` (or ``--seq-len``, ``--resolution``): two answers.

1. **The largest value under any plan.** A plan that saves no more memory than one that does not fit
   cannot fit (memfit.planner.feasibility), so the largest value any plan reaches is the largest that
   one of the *maximal* plans reaches (those no other plan out-saves everywhere; micro-batches are
   left out: a split batch can grow without bound). Their memory is close to affine in the value
   (NOTE [ The largest value from a line ] in memfit.planner.largest), so each is traced at the two
   smallest values, its line drawn, and the search for the value then traces, at each value, the
   maximal plans their lines put within ``NEAR`` of the budget (the others are taken as over it).
   The value found fits by a full trace of one maximal plan, and the next one by none traced.
2. **The fastest.** Throughput (tokens, images or samples per second) is what a larger batch buys, and
   what a more frugal plan costs. The planner searches (memfit.planner.search) at the smallest value,
   then at the largest and at halves of it, down to where its fastest plan is the fastest of all plans
   (a smaller value cannot give a faster plan; nor can a plan too big at the smallest value: NOTE
   [ Plans too big at the smallest value ]), each search walking only the plans that could beat the
   best throughput found before it (NOTE [ The smallest value first ]); the value and plan of the highest
   throughput are then pushed to that plan's own largest value (exact, as ``estimate`` finds it), and
   searched there once more. A split plan one search found too big, the searches at smaller values
   take as failed untraced (NOTE [ Plans too big at a larger batch ]); ``max``'s own traces run in a
   process of their own, so that its searches keep their trace workers (NOTE [ Traces of one's own
   in a process of their own ] in memfit.planner.side_by_side).

A search per value is seconds for a small model and a minute or more for a 7B one: ``max`` costs
about log2(N) + 2 searches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memfit.devices import Device, get_device
from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate_target
from memfit.planner.candidate import Candidate, Status
from memfit.planner.feasibility import maximal
from memfit.planner.largest import Largest, find_largest
from memfit.planner.search import PlanResult, plan
from memfit.planner.side_by_side import in_own_process
from memfit.planner.sized import Sized, largest_estimate
from memfit.planner.space import candidates, default_space, model_facts
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.step import batch_bytes
from memfit.target import checkpoint_fields
from memfit.units import fmt_bytes

NEAR = 1.10
"""A maximal plan whose line puts it above the budget by more than this factor is not traced at a value."""


@dataclass
class LargestPlan:
    """Both answers of ``plan ... max`` (the module docstring)."""

    sized: Sized
    budget_bytes: int
    largest: Largest
    """The largest value under any plan."""
    largest_plan: Plan | None
    """The maximal plan that fits at ``largest.value``."""
    best: PlanResult | None = None
    """The planner's search at the value of highest throughput (None: nothing fits)."""
    best_value: int | None = None
    throughput: float | None = None
    unit: str = "samples/s"
    searched: list[tuple[int, PlanResult]] = field(default_factory=list)
    """Every search, by value."""

    def to_json(self) -> dict:
        return {"axis": self.sized.axis.key, "best_value": self.best_value, "throughput": self.throughput,
                "throughput_unit": self.unit, "best": self.best.to_json() if self.best else None,
                "largest": self.largest.to_json(),
                "largest_plan": self.largest_plan.to_dict() if self.largest_plan else None,
                "searched": [{"value": v, "chosen": r.chosen.plan.to_dict() if r.chosen else None,
                              "step_seconds": r.chosen.seconds if r.chosen else None,
                              "throughput": throughput(self.sized, v, r.chosen.seconds) if r.chosen else None,
                              "trace_limited": r.limited, "slower_than": r.slower_than}
                             for v, r in self.searched]}


def throughput_unit(sized: Sized, value: int) -> str:
    info = sized.workload_at(value).info
    return "tokens/s" if info.text_lm and info.seq_len else "images/s" if info.resolution else "samples/s"


def throughput(sized: Sized, value: int, seconds: float) -> float:
    """Tokens (language models), images (image generation) or samples per second at ``value``."""
    s = sized.sizes(value)
    info = sized.workload_at(value).info
    batch = s["batch_size"] or sized.workload_at(value).default_batch_size
    per_sample = info.seq_len if info.text_lm and info.seq_len else 1
    return batch * per_sample / seconds


def plan_largest(sized: Sized, *, budget: str | int | None, device: str | Device, fixed: dict,
                 search: Callable[..., PlanResult] | None = None, **plan_kwargs) -> LargestPlan:
    """Both answers for ``sized``'s free size (the module docstring). ``fixed``: the plan fields the user
    gave; ``plan_kwargs``: what :func:`memfit.planner.search.plan` takes besides (optimizers, ...)."""
    dev = get_device(device)
    budget_obj = Budget.resolve(budget, dev)
    search = search or plan
    axis = sized.axis
    if axis.key == "batch_size" and ("micro_batch_size" in fixed or "grad_accum_steps" in fixed):
        raise UserError("--batch-size max finds the largest batch one step holds at once; drop --micro-batch-size "
                        "and --grad-accum-steps (a split batch can grow without bound)")
    fixed = checkpoint_fields(fixed, sized.workload_at(axis.step), dev)  # (a pre-quantized or adapter checkpoint's own)
    tops = maximal_plans(sized, dev, fixed, budget_obj.bytes)
    largest, top = in_own_process(lambda: _largest_any(sized, tops, dev, budget_obj))  # NOTE [ Traces of one's own in a process of their own ]
    out = LargestPlan(sized, budget_obj.bytes, largest, top, unit=throughput_unit(sized, axis.step))
    if largest.value is None:
        return out

    def at(value: int) -> PlanResult:
        for v, r in out.searched:
            if v == value:
                return r
        s = sized.sizes(value)
        known = too_big_at_larger_batches(sized, out.searched, value, dev)  # NOTE [ Plans too big at a larger batch ]
        rates = [throughput(sized, v, r.chosen.seconds) for v, r in out.searched if r.chosen]
        cap = {"slower_than": throughput(sized, value, 1.0) / max(rates)} if rates else {}  # NOTE [ The smallest value first ]
        result = search(sized.workload_at(value), budget=budget, device=dev, batch_size=s["batch_size"],
                        fixed=fixed, **({"too_big": known} if known else {}), **cap, **plan_kwargs)
        out.searched.append((value, result))
        return result

    hopeless = _too_big(at(axis.step)) if largest.value > axis.step else None  # (NOTE [ Plans too big at the smallest value ])
    value = largest.value
    while True:  # the largest value, then halves, until the fastest plan of all fits
        result = at(value)
        if value <= axis.step or result.chosen is not None and _fastest_of_all(result, hopeless):
            break
        value = max(axis.step, value // 2 // axis.step * axis.step)
    scored = [(throughput(sized, v, r.chosen.seconds), v, r) for v, r in out.searched if r.chosen]
    if not scored:
        return out
    _, v, r = max(scored, key=lambda x: x[0])
    if r.chosen.plan.micro_batches(sized.batch_at(v) or 1)[1] == 1 and v < largest.value:
        own = in_own_process(lambda: largest_estimate(sized, r.chosen.plan, dev, budget_obj, first=v)[0])  # (its own largest)
        if own.value is not None and own.value > v:
            again = at(own.value)
            if again.chosen:
                scored.append((throughput(sized, own.value, again.chosen.seconds), own.value, again))
    out.throughput, out.best_value, out.best = max(scored, key=lambda x: x[0])
    return out


def _fastest_of_all(result: PlanResult, hopeless: set[Plan] | None = None) -> bool:
    """No plan faster than the chosen one was too big (but those too big at every value: ``hopeless``): a
    smaller value cannot give a faster plan."""
    chosen = result.chosen
    return not any(c.status is Status.TOO_BIG and c.seconds < chosen.seconds and _unsplit(c.plan) not in (hopeless or ())
                   for c in result.candidates)


# NOTE [ Plans too big at the smallest value ]
# The halving stops where no plan faster than the chosen one was too big. On a card that holds a model
# only with its blocks swapped (a LoRA of Llama-2-7B on a 12 GB card), every unswapped plan is faster and
# too big at every value, so it halved down to the smallest: log2(N) searches of two minutes and more each
# (stopped after 19 minutes). A plan too big at the smallest value is too big at every larger one (memory
# grows with the value; a micro-batch of a split plan is at least the smallest value), so the smallest
# value is searched, and its plans too big there no longer keep the halving going.
#
# NOTE [ The smallest value first ]
# A search at a value is of use only for a plan whose throughput beats the best found so far: at a
# value of N samples, a step faster than N samples / that throughput (``slower_than`` of memfit.planner.
# search: plans estimated no faster are not walked, nor traced). So the smallest value, the cheapest
# search, runs first, and each later one walks only what could win. The LoRA of Llama-2-7B at 2048 tokens
# on a 12 GB card runs at 1,063 tokens/s at batch 1; at batch 16 (the largest) its search traced 61
# plans, 54 of them estimated slower than 30.8 s (16 x 2048 / 1,063), and hit its trace limit.
# Measured: docs/planner-notes.md.
def _too_big(result: PlanResult) -> set[Plan]:
    """The plans of a search too big for the budget (or saving no more than one that is), unsplit."""
    return {_unsplit(c.plan) for c in result.candidates if c.status in (Status.TOO_BIG, Status.PRUNED)}


def _unsplit(plan: Plan) -> Plan:
    """The plan with its batch whole (a micro-batch of a split plan needs what the whole plan needs at that size)."""
    return plan.replace(micro_batch_size=None, grad_accum_steps=UNSPLIT.grad_accum_steps)


UNSPLIT = Plan()


# NOTE [ Plans too big at a larger batch ]
# A plan that splits a batch into micro-batches of m holds, at any batch that m divides, what it holds at
# a larger one, but for the larger batch's inputs: one micro-batch's activations at a time beside the
# same weights, gradients and states (the micro-batches' ops repeat: NOTE [ Repeated micro-batches,
# traced once ] in memfit.step). So a split plan too big at batch B by more than B's inputs and one
# allocator segment (``SEGMENT_SLACK``: the inputs' segment may leave a different remainder) is too big at
# a smaller batch with the same micro-batches, and the searches at the halves take it as failed without
# tracing it; with it fail the plans it saves at least as much as (the walk's pruning). On a 12 GB card a
# LoRA of Llama-2-7B at 2048 tokens reaches batch 16 only split, and the search at 8 traced again about
# half of the split plans the search at 16 had ruled out. Measured: docs/planner-notes.md.
SEGMENT_SLACK = 20 << 20
"""The caching allocator's segment for a mid-sized block (1-10 MiB): what the inputs' own segment can
shift the reserved bytes by beyond their size."""


def too_big_at_larger_batches(sized: Sized, searched: list[tuple[int, PlanResult]], value: int, device: Device
                              ) -> dict[Plan, tuple[int, str]]:
    """The split plans that the searches at larger batches found too big with micro-batches that divide
    batch ``value``: plan -> (a lower bound of its need at ``value``, why), for
    :func:`memfit.planner.search.plan`'s ``too_big`` (NOTE [ Plans too big at a larger batch ])."""
    if sized.axis.key != "batch_size":
        return {}
    out: dict[Plan, tuple[int, str]] = {}
    for v, result in searched:
        if v <= value:
            continue
        slack = batch_bytes(sized.target(v, None, device)) + SEGMENT_SLACK
        for c in result.candidates:
            if c.status is not Status.TOO_BIG or c.used_bytes is None or c.used_bytes - slack <= result.budget_bytes:
                continue
            m, n = c.plan.micro_batches(v)
            if n == 1 or m >= value or value % m:
                continue
            need = c.used_bytes - slack
            if c.plan not in out or need > out[c.plan][0]:
                out[c.plan] = (need, f"needs at least {fmt_bytes(need)}: {fmt_bytes(c.used_bytes)} at batch {v} in "
                                     f"the same micro-batches of {m}, less that batch's inputs (not traced at this batch)")
    return out


def maximal_plans(sized: Sized, device: Device, fixed: dict, budget_bytes: int | None = None) -> list[Plan]:
    """The maximal plans of the default search space (memfit.planner.space), with the user's fixed
    fields, that do not split the batch. ``budget_bytes``: what the space's values that matter only when
    the weights fill the budget look at (``swap_blocks``: a LoRA of Llama-2-7B on a 12 GB card fits only
    with blocks swapped, and without them ``max`` answered that nothing fits)."""
    value = sized.axis.step
    target = sized.target(value, None, device)
    bs = target.batch_size
    with silenced_warnings():
        facts = model_facts(target.workload)
    space = default_space(facts, device, bs, budget_bytes=budget_bytes, base_weights=fixed.get("base_weights"))
    space.micro_batches = [bs]
    plans = []
    for p in candidates(space, bs):
        try:
            plans.append(p.replace(**fixed))
        except UserError:
            continue
    plans = list(dict.fromkeys(plans))
    if not plans:
        raise UserError("plan: no valid plan is left with the fields you fixed; remove some of the plan flags")
    return [c.plan for c in maximal([Candidate(p, 0.0) for p in plans], bs)]


def _largest_any(sized: Sized, tops: list[Plan], device: Device, budget: Budget) -> tuple[Largest, Plan | None]:
    """The largest value some plan of ``tops`` fits at (step 1 of the module docstring)."""
    used: dict[tuple[Plan, int], int | None] = {}
    errors: list[str] = []
    best: dict[int, Plan] = {}

    def one(p: Plan, value: int) -> int | None:
        if (p, value) not in used:
            try:
                with silenced_warnings():
                    used[(p, value)] = budget.used_bytes(estimate_target(sized.target(value, p, device)))
            except UserError as e:  # (the plan cannot run at this value: a bound)
                used[(p, value)] = None
                errors.append(str(e))
        return used[(p, value)]

    def measure(value: int) -> int:
        figures = {}
        for p in tops:
            line = _line(sized, p, used)
            if line is not None and line(value) > budget.bytes * NEAR:
                continue
            u = one(p, value)
            if u is not None:
                figures[p] = u
        if not figures:
            raise UserError(errors[-1] if errors else f"no maximal plan runs at {sized.axis.show(value)}")
        p = min(figures, key=figures.get)
        best[value] = p
        return figures[p]

    found = find_largest(sized.axis, measure, budget.bytes, second=sized.second)
    return found, best.get(found.value) if found.value is not None else None


def _line(sized: Sized, p: Plan, used: dict) -> Callable[[int], float] | None:
    """The line of ``p``'s need through its two smallest values traced (None: fewer than two)."""
    points = sorted((v, u) for (q, v), u in used.items() if q == p and u is not None)
    if len(points) < 2:
        return None
    (a, ua), (b, ub) = points[:2]
    x = sized.axis.x
    slope = (ub - ua) / (x(b) - x(a))
    return lambda value: ua + slope * (x(value) - x(a))
