"""The GPU presets' evidence ladder: four rungs over one trace book (memfit.planner.traces).

1. :class:`Estimate` (every candidate, no trace of its own): the base plan's lower bound plus each
   value's saving alone (memfit.planner.baseline). It spares the search the traces of plans
   estimated well over the budget.
2. :class:`ShallowTrace` (the plans the walk visits, fastest first): a shallow trace pair (2 and 3
   blocks, memfit.planner.shallow) extrapolated to full depth: its allocated peak plus the CUDA
   context is a lower bound of what the budget counts (the caching allocator reserves at least what
   is allocated): above the budget, the plan is too big.
3. :class:`DeepStream` (a plan about to be confirmed): the pair's allocations replayed at full depth
   through the allocator model (memfit.memory.deep_stream): the reserved bytes, without a full trace.
4. :class:`FullTrace` (the plan chosen): the deep stream checked by a trace at a third depth (NOTE
   [ The deep stream checked at a third depth ] in memfit.planner.deep_figures), or where that misses or
   does not line up, one full trace, the same as ``memfit estimate``: reserved bytes at full depth.
   Only a plan with this rung's evidence is chosen.

So the chosen plan's figures are those of its own full trace, or of its deep stream checked at a third
depth (equal to the full trace's on every plan checked). The rungs say nothing of time: the
time model prices the same book's ops (memfit.planner.gpu_time).
"""

from __future__ import annotations

from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.planner.baseline import Baseline
from memfit.planner.candidate import Evidence, Fidelity
from memfit.planner.ladder import DeepRung, Ladder
from memfit.planner.traces import Measured, TraceBook
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.techniques.swap_blocks import resident_weight_bytes


def _of(m: Measured, budget: Budget) -> Evidence:
    """A measured plan's evidence: its allocator side, and the managed bytes the budget holds beside it
    (NOTE [ Managed memory over the budget ] in memfit.memory.budget); on the host, its copies there and
    the managed pages the card has no room for."""
    fidelity, allocator = (Fidelity.FULL, m.used_bytes) if m.full else (Fidelity.LOWER_BOUND, m.used_lower)
    return Evidence(fidelity, used_bytes=budget.counted(allocator, m.managed_bytes), peak_bytes=m.peak_bytes,
                    managed_bytes=m.managed_bytes, host_bytes=m.host_bytes + budget.paged_out(allocator, m.managed_bytes))


class Estimate:
    """The base's lower bound plus each of the plan's values' saving alone."""

    fidelity = Fidelity.ESTIMATE

    def __init__(self, book: TraceBook, baseline: Baseline) -> None:
        self.book, self.baseline = book, baseline
        self.savings: dict[tuple[str, int], int] = {}
        """("micro_batch_size", size) -> bytes saved by the base split so (traced when first asked for)."""
        self.resident: dict[tuple, int] = {}
        """A plan's weight keys -> the weights it keeps on the device (:meth:`_resident_weights`)."""

    def evaluate(self, plan: Plan) -> Evidence | None:
        if self.book.is_measured(plan):
            return None
        return Evidence(Fidelity.ESTIMATE, used_bytes=self.used(plan))  # (the allocator side: managed bytes never put it over)

    def free(self, plan: Plan) -> bool:
        """The estimate needs no trace (a micro-batch size's saving is traced when first asked for)."""
        micro = plan.micro_batches(self.book.target.batch_size)[0]
        return micro == self.book.rank_batch or ("micro_batch_size", micro) in self.savings

    def used(self, plan: Plan) -> int:
        """What the plan is estimated to need of the budget without a trace of its own: the
        default's lower bound plus each value's saving alone. Savings on different parts (optimizer
        states, activations) add up; two on the same part (activations) save less together than
        the sum: the estimate errs low (a product of the fractions each leaves errs high where the
        parts differ, and hid the fastest plan at a tight budget), but never under the weights the plan
        keeps (NOTE [ The weights under an estimate ]). It only spares the search the traces of plans
        well over the budget."""
        base = self.book.measured[self.baseline.base]
        if not self.free(plan):  # the base's step at the plan's micro-batch size, traced
            micro = plan.micro_batches(self.book.target.batch_size)[0]
            try:
                saved = self.book.lower_bound(self.baseline.base, micro) - base.used_lower
            except UserError:  # unknown: no estimate spares this plan's trace
                saved = -base.used_lower
            self.savings[("micro_batch_size", micro)] = saved
        alone = self.baseline.savings
        estimate = base.used_lower + sum(self.savings.get(key, alone.get(key, 0)) for key in self.baseline.technique_keys(plan))
        return max(estimate, self._resident_weights(plan) + self.book.target.device.context_bytes)

    # NOTE [ The weights under an estimate ]
    # Savings measured alone add up low, and more than the parts they save can hold: with a saving of 8
    # of Mixtral's 32 blocks swapped and the others', plans that keep 69 GiB of weights on a 24 GB card
    # were estimated to fit, and traced at full depth (swapped plans have no shallow pair). Nor do
    # savings on activations alone stop at the activations: a LoRA of Llama-2-7B at batch 16 x 2048 on
    # a 12 GB card (13.5 GB of bf16 weights, none swapped) was estimated under the budget with micro-
    # batches, offloaded activations and checkpointing together, whose savings alone (each a share of
    # 100 GiB and more of activations) summed to more than all but the weights; 11 of the 61 plans its
    # search traced were such, 2-5x over the budget, before its trace limit. So no estimate is under
    # what the plan keeps of the weights on the device (every weight but the swapped blocks', in 16 bits
    # or the base weights' format: a lower bound of what it allocates) plus the CUDA context. (Sharded
    # plans hold a share of them: no floor there.)
    def _resident_weights(self, plan: Plan) -> int:
        """What ``plan`` keeps of the weights on the device, at least (NOTE [ The weights under an estimate ])."""
        return self.resident_weights(plan) or 0

    def resident_weights(self, plan: Plan) -> int | None:
        """What ``plan`` keeps of the weights on the device, at least; None where they are sharded (a rank holds a
        share of them)."""
        if self.book.world > 1:
            return None
        adapter = not plan.config("adapter").is_default
        key = (plan.swap_blocks, str(plan.base_weights), adapter)
        if key not in self.resident:
            self.resident[key] = resident_weight_bytes(self.book.tracer.meta_model, plan.base_weights, plan.swap_blocks,
                                                       adapter=adapter)
        return self.resident[key]


# NOTE [ The deeper trace of a plan over the budget at the shallower depth ]
# A model with more blocks holds no less at its peak (more weights, gradients, states and
# activations), so a plan whose shallower trace alone (2 blocks, less the extrapolation's margin)
# is over the budget is over it at full depth: its deeper trace cannot change the verdict. The walk
# measures plans two at a time (NOTE [ The next plan measured alongside ] in memfit.planner.walk):
# both shallower traces run first, side by side, and each deeper one runs only if its plan is still
# in the running. A plan ruled out so keeps the shallower trace's peak as its lower bound ("needs at
# least") and its estimated time. The values measured alone before the walk keep both traces: their
# savings and ratios are taken from the pair. Measured: docs/planner-notes.md.
class ShallowTrace:
    """A shallow trace pair (full depth when the model is shallow, or a shallow trace failed)."""

    fidelity = Fidelity.LOWER_BOUND

    def __init__(self, book: TraceBook) -> None:
        self.book = book

    def evaluate(self, plan: Plan) -> Evidence:
        return _of(self.book.measure(plan), self.book.budget)


class DeepStream(DeepRung):
    """The shallow pair's allocations replayed at full depth (NOTE [ Allocations at full depth ])."""

    def __init__(self, book: TraceBook) -> None:
        super().__init__()
        self.book = book

    def evaluate(self, plan: Plan) -> Evidence | None:
        used = self.book.deep_used(plan)
        if used is None:
            return None
        managed = self.book.measured[plan].managed_bytes
        return Evidence(Fidelity.DEEP, used_bytes=self.book.budget.counted(used, managed), managed_bytes=managed)


class FullTrace:
    fidelity = Fidelity.FULL

    def __init__(self, book: TraceBook) -> None:
        self.book = book

    def evaluate(self, plan: Plan) -> Evidence:
        return _of(self.book.confirm(plan), self.book.budget)


class GpuLadder(Ladder):
    """Estimate, shallow trace, deep stream, full trace (the module docstring)."""

    def __init__(self, book: TraceBook, baseline: Baseline) -> None:
        self.book = book
        self.estimate, self.first, self.deep, self.full = Estimate(book, baseline), ShallowTrace(book), \
            DeepStream(book), FullTrace(book)
        self.spare_workers = book.workers.count - 1

    @property
    def traces(self) -> int:
        return self.book.traces

    def evidence(self, plan: Plan) -> Evidence | None:
        m = self.book.measured.get(plan)
        return None if m is None else _of(m, self.book.budget)

    def full_evidence(self) -> list[tuple[Plan, Evidence]]:
        return [(p, _of(m, self.book.budget)) for p, m in list(self.book.measured.items()) if m.full]

    def has_full_trace(self, plan: Plan) -> bool:
        return self.book.has_full_trace(plan)

    def traced(self, plan: Plan) -> bool:
        return self.book.is_measured(plan) or self.book.has_shallow_traces(plan)

    def prefetch(self, plans: list[Plan], behind: list[Plan] = ()) -> None:
        with silenced_warnings():
            self.book.trace_full(plans, behind=self.book.jobs(list(behind)))

    def queue(self, plans: list[Plan]) -> None:
        self.book.queue_shallowest(plans)

    def measure_together(self, plans: list[Plan], skip_over: bool = False) -> None:
        if plans:
            self.book.trace_shallow(plans, skip_over=skip_over)
