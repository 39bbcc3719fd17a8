"""The default plan and each searched value alone: what a GPU-preset search measures before its walk.

Tracing every candidate would take minutes (672 plans for GPT-2), so every plan starts with an
estimate built from a few measured plans: the default plan (the *base*) and the base with each
searched value alone (or, for a value that compiles per weight dtype, that value at the precision
with the smallest weights against that precision alone). The time model takes each value's ratio of
step times from these pairs (memfit.planner.gpu_time), the ladder's estimate rung each value's
saving of the budget (memfit.planner.gpu_ladder). A value whose traces show that it does not suit
the workload leaves the search space, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable

from memfit.errors import UserError
from memfit.planner.space import SearchSpace
from memfit.planner.traces import TraceBook
from memfit.plans import Plan, technique_of, with_what_it_needs


def adds_work(key: tuple[str, object]) -> bool:
    """The value only adds work (``Config.adds_work``), judged alone (``budget:F`` needs a compile
    mode in a Plan)."""
    name, value = key
    if name == "micro_batch_size":
        return False
    return technique_of(name).config({name: value}).adds_work


def _weight_bytes(n_params: int, plan: Plan) -> int:
    """Every parameter in the plan's weight dtype (Precision.weights: fp32 or bf16)."""
    return n_params * (4 if plan.config("precision").weights == "fp32" else 2)


def _plans_of(first: list[Plan], pairs) -> list[Plan]:
    """``first``, then the plans of the (with, without) ``pairs``, each once."""
    return list(dict.fromkeys([*first, *(plan for pair in pairs for plan in pair)]))


class Baseline:
    """The base plan and the values measured alone beside it (see the module docstring)."""

    def __init__(self, book: TraceBook, space: SearchSpace, fixed: dict | None = None) -> None:
        """``fixed``: plan fields outside the search space that every candidate has (ema, ...)."""
        self.book, self.space = book, space
        self.fixed = dict(fixed or {})
        self.base: Plan | None = None
        self.pairs: dict[tuple[str, object], tuple[Plan, Plan]] = {}
        """(technique, value) -> (the plan with it, the plan it is measured against), for the values
        that suit the workload."""
        self.savings: dict[tuple[str, object], int] = {}
        """(technique, value) -> bytes of the budget saved alone (negative: saves)."""
        self.micro: list[int] = []
        """The micro-batch sizes searched that split the batch."""
        self.excluded: list[str] = []
        """Values left out of the space because they failed for this workload, and why."""
        self._keys: dict[Plan, frozenset] = {}

    def technique_keys(self, plan: Plan) -> frozenset:
        """The plan's (technique, value) pairs that differ from the base, with its micro-batch size
        where it splits the batch."""
        keys = self._keys.get(plan)
        if keys is None:
            keys = {(name, getattr(plan, name)) for name in self.space.values if getattr(plan, name) != getattr(self.base, name)}
            micro = plan.micro_batches(self.book.target.batch_size)[0]
            if micro != self.book.rank_batch:
                keys.add(("micro_batch_size", micro))
            keys = self._keys[plan] = frozenset(keys)
        return keys

    def precision_alone(self, precision) -> Plan | None:
        """The base at ``precision``, where it was measured."""
        try:
            plan = self.base.replace(precision=precision)
        except UserError:
            return None
        return plan if self.book.is_measured(plan) else None

    def measure(self, ahead: list[Plan] | None, seconds: Callable[[Plan], float]) -> None:
        """Measure the base and each searched value alone (values that do not suit the workload
        leave the space, with the reason in ``excluded``). ``ahead``: plans the walk may measure
        first, queued behind (NOTE [ The walk's first traces behind the measuring ]; None: nothing
        is queued for the walk); ``seconds``: a measured plan's step time (the time model's)."""
        book = self.book
        self.base = self._base_plan()
        alone = {}
        for name, values in self.space.values.items():
            for value in values:
                plan = self._alone(name, value)
                if plan is not None and plan != self.base:
                    alone[(name, value)] = plan
        self.micro = [m for m in self.space.micro_batches if m != book.rank_batch]
        elsewhere = self._measured_elsewhere(alone)  # NOTE [ Compiled updates measured at the smallest weights ]
        pairs = {key: elsewhere.get(key, (plan, self.base)) for key, plan in alone.items()}
        walk_first = self._walk_first_jobs(ahead, self.micro) if ahead is not None else []
        if self._may_fit_alone():  # NOTE [ Work-adding values when the default plan fits ]
            others = {k: pair for k, pair in pairs.items() if not adds_work(k)}
            book.trace_shallow(_plans_of([self.base], others.values()),
                               behind=[*book.jobs(_plans_of([], pairs.values())), *walk_first])
            if self._fastest_fits(others, seconds):
                walk_first = []  # (dropped with the work-adding values: the walk takes the plan that fits)
                left = [k for k in alone if adds_work(k)]
                for name, value in left:
                    self.space.values[name].remove(value)
                    del alone[(name, value)], pairs[(name, value)]
                if left:
                    self.space.notes.append(
                        f"{', '.join(sorted({n for n, _ in left}))} not searched: these values only add work, and the "
                        "fastest of the default plan and each other value alone fits (by its full trace)")
        book.trace_shallow(_plans_of([self.base], pairs.values()), behind=walk_first)
        book.measure(self.base)
        for (name, value), (with_value, without) in pairs.items():
            try:
                m, ref = book.measure(with_value), book.measure(without)
            except UserError as e:
                self.space.values[name].remove(value)
                self.excluded.append(f"{name}={value}: {e}")
                continue
            self.pairs[(name, value)] = (with_value, without)
            self.savings[(name, value)] = m.used_lower - ref.used_lower

    def _base_plan(self) -> Plan:
        precisions = self.space.values.get("precision", [])
        half = next((p for p in precisions if p in ("bf16", "fp16")), None)
        first = {name: values[0] for name, values in self.space.values.items() if values}
        return Plan(**{**first, **self.fixed, **({"precision": half} if half else {})})

    def _alone(self, name: str, value) -> Plan | None:
        """The base with ``value`` (or, when it cannot run alone, with the first other searched value
        that lets it run: ``budget:F`` with a compile mode)."""
        found = with_what_it_needs(name, value, ((k, v) for k, vs in self.space.values.items() for v in vs), self.base)
        return found[0] if found else None

    # NOTE [ The walk's first traces behind the measuring ]
    # The search hands :meth:`Baseline.measure` the plans the walk takes first whatever is measured
    # before it: the maximal plans that do not split the batch (NOTE [ Maximal plans first when nothing
    # measured fits ] in memfit.planner.walk) and the base's step at each micro-batch size (a split plan's
    # estimated saving). Their shallow pairs are queued behind the values alone (memfit.planner.workers),
    # so a worker the measuring leaves idle (another one compiling, say) traces them, and the walk takes
    # the results. Where the fastest of the default plan and each value alone fits, they are dropped with
    # the work-adding values (``Workers.cancel``); a trace already running finishes. Only shallow pairs
    # are queued (a full trace left running would hold a worker the walk needs for seconds), the walk's
    # rounds, which replace the queue, keep the base's traces queued, and the searches of ``--methods``
    # (which share the cores) queue none. Measured: docs/planner-notes.md.
    def _walk_first_jobs(self, ahead: list[Plan], micro: list[int]) -> list[tuple]:
        """The shallow pairs of ``ahead`` and the base's at each micro-batch size in ``micro`` (what
        a split plan's estimate asks for)."""
        pair = self.book.depths(self.base)
        if not pair:
            return []
        paired = [p for p in ahead if self.book.depths(p)]
        return [*self.book.jobs(paired), *((self.base, d, m) for m in micro for d in pair)]

    # NOTE [ Work-adding values when the default plan fits ]
    # A value that only adds work (``Config.adds_work``: checkpointing's recompute, offload's copies, a
    # chunked loss's loop) cannot make a plan faster. So where the default plan may fit (its weights,
    # and their gradients where all of them train, are within the budget), the default and the values
    # that do not only add work are measured first. When the fastest of those (the default, or one
    # value alone where the values faster than the default are all of one technique, so that no two
    # combine) fits by its own full trace, no plan can beat it: every other combination is estimated
    # slower, and the work-adding values are not measured at all (left out, with a note). Where it does
    # not fit, the device or the host's memory (``--host-memory``: checkpointing shrinks what an
    # offload holds there), the rest are measured as before. Measured: docs/planner-notes.md.
    def _may_fit_alone(self) -> bool:
        """Whether the default plan's weights (and, where every weight trains, their gradients) are
        within the budget (quantized base weights: assumed): else it cannot fit, and nothing is gained
        by asking first."""
        if self.book.world > 1:
            return False
        if not self.base.config("base_weights").is_default:  # (quantized: most weights take a byte or less)
            return True
        trains_all = self.base.config("adapter").is_default
        return _weight_bytes(self.book.n_params, self.base) * (2 if trains_all else 1) <= self.book.budget.bytes

    def _fastest_fits(self, others: dict, seconds: Callable[[Plan], float]) -> bool:
        """The fastest of the default plan and each value alone in ``others`` ((name, value) -> (plan
        with it, plan without it)) fits by its full trace, and no plan can be faster (the values
        faster than the default's are of one technique: no two combine; a value measured at another
        precision that is faster there leaves the fastest plan alone unknown)."""
        book = self.book
        try:
            book.measure(self.base)
            base = seconds(self.base)
            faster = []
            for (name, _), (plan, without) in others.items():
                try:
                    book.measure(plan), book.measure(without)
                except UserError:  # (left out below, with the reason)
                    continue
                if without != self.base and seconds(plan) < seconds(without):
                    return False
                if seconds(plan) < base:
                    faster.append((seconds(plan), name, plan))
            if len({name for _, name, _ in faster}) > 1:
                return False
            best = min(faster, key=lambda x: x[0])[2] if faster else self.base
            if book.measure(best).used_lower > book.budget.bytes or book.budget.host_over(book.measure(best).host_bytes):
                return False  # (over the host's memory: a work-adding value may hold less there)
            book.cancel_queued()  # (the work-adding values queued behind: likely not needed now)
            full = book.confirm(best)
            return full.used_bytes <= book.budget.bytes and not book.budget.host_over(full.host_bytes)
        except UserError:
            return False

    # NOTE [ Compiled updates measured at the smallest weights ]
    # An optimizer that compiles a graph per parameter shape and weight dtype (torchao's update,
    # ``OptimizerVariant.compiles_per_weight_dtype``) costs seconds of a worker per graph on a cold cache,
    # where any other value alone traces in half a second. Where the searched precisions hold weights of
    # two dtypes (bf16 autocast keeps fp32 weights, bf16-pure bf16 ones), such a value is measured once,
    # at the precision alone with the smallest weights that may fit, against that precision alone: its
    # ratio and saving carry to the other precisions' estimates, and a plan with the update at the other
    # weight dtype compiles only if the walk reaches it. Where the base's weights exceed the budget, this
    # also keeps the update from being compiled for weights no plan can hold. Measured:
    # docs/planner-notes.md.
    def _measured_elsewhere(self, alone: dict) -> dict:
        """(name, value) -> (plan with it, plan without it) for the values alone that compile per
        weight dtype (torchao's update), measured at the searched precision with the smallest
        weights that may fit, against that precision alone, where the base's weights are larger."""
        fitting = [(_weight_bytes(1, plan), key[1], plan) for key, plan in alone.items()
                   if key[0] == "precision" and self._weights_fit(plan)
                   and _weight_bytes(1, plan) < _weight_bytes(1, self.base)]
        if not fitting:
            return {}
        _, precision, reference = min(fitting, key=lambda x: x[0])
        out = {}
        for key, plan in alone.items():
            if key[0] != "precision" and plan.config("optimizer").compiles_per_weight_dtype:
                try:
                    out[key] = (plan.replace(precision=precision), reference)
                except UserError:
                    continue
        return out

    def _weights_fit(self, plan: Plan) -> bool:
        """Whether the plan's weights alone (each parameter in its weight dtype) are within the budget
        (sharded ranks hold a part: always, there)."""
        return self.book.world > 1 or _weight_bytes(self.book.n_params, plan) <= self.book.budget.bytes
