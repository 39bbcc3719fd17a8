"""A candidate plan, the evidence about it, and where the search left it.

The planner learns what a plan needs from evidence of rising cost and fidelity (the *ladder*,
memfit.planner.ladder): an estimate from other plans' traces (free), a shallow trace pair's
allocated peak (a lower bound, a second or two), the shallow traces' allocations replayed at full
depth (the reserved bytes, tenths of a second more), and the top rung: those allocations checked by a
trace at a third depth, or a full fake trace (the reserved bytes as ``memfit estimate`` reports them,
seconds to minutes on a large model). A cheap rung rules a plan
out only when its figure is over the budget by more than the rung's own error (its
:attr:`Fidelity.margin`); only the top rung lets a plan be chosen.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from memfit.plans import Plan


# NOTE [ Candidate status ]
# A candidate's :class:`Status` changes only through :class:`Candidate`'s methods, so every
# change sets its reason too; the planner never compares a status with a string (the architecture
# test checks it). ``Status`` is a ``str`` enum: the JSON and the report see the same words.
class Status(enum.StrEnum):
    NOT_EVALUATED = "not evaluated"
    CHOSEN = "chosen"
    TOO_BIG = "too big"
    PRUNED = "pruned"
    """Saves no more memory than a plan that did not fit (not traced)."""
    SLOWER = "slower"
    UNTRIED = "untried"
    """Predicted faster than the chosen plan and not traced: the search chose a plan asking less of the host within
    1% of it (NOTE [ A technique pays for itself ] in memfit.planner.simpler), or stopped at its trace limit."""
    NOT_WORTH = "not worth it"
    """Fits and is predicted faster than the chosen plan by less than its extra techniques must pay
    (NOTE [ A technique pays for itself ] in memfit.planner.simpler)."""
    INVALID = "invalid"
    """The plan does not suit the workload (its trace raised a UserError)."""


class Fidelity(enum.Enum):
    """How far a figure of :class:`Evidence` can be trusted: each rung's margin is how far above
    the budget its figure must be to rule a plan out."""

    ESTIMATE = enum.auto()
    """From the default plan and each value alone (no trace of its own)."""
    LOWER_BOUND = enum.auto()
    """A shallow trace pair's allocated peak at full depth (+ context): at most what is needed."""
    DEEP = enum.auto()
    """The shallow traces' allocations replayed at full depth through the allocator model
    (memfit.memory.deep_stream): the reserved bytes, equal to a full trace's on every plan seen."""
    FULL = enum.auto()
    """A full fake trace of the plan's own step: what ``memfit estimate`` reports."""
    MEASURED = enum.auto()
    """A real run of the plan's step on this machine (its time)."""

    @property
    def margin(self) -> float:
        return _MARGINS.get(self, 0.0)

    def over(self, used_bytes: int, budget_bytes: int) -> bool:
        """``used_bytes`` rules the plan out at ``budget_bytes``."""
        if self.margin:
            return used_bytes > budget_bytes * (1 + self.margin)
        return used_bytes > budget_bytes


_MARGINS = {Fidelity.ESTIMATE: 0.1, Fidelity.DEEP: 0.005}
"""ESTIMATE: a plan estimated this much over the budget is not traced. DEEP: they equalled the full
traces' on every plan measured, but the model's build differs between a shallow and a full trace
(an earlier version that paired frees by stretch alone was 88 MiB over on 43.7 GB, Llama-2-7B
bf16-pure + adamw8bit)."""


@dataclass(frozen=True)
class Evidence:
    """What one rung of the ladder found about one plan."""

    fidelity: Fidelity
    used_bytes: int | None = None
    """What the budget counts (a lower bound at ``LOWER_BOUND``): reserved + context on a GPU
    preset, device + host on the CPU."""
    peak_bytes: int | None = None
    """Allocated peak."""
    seconds: float | None = None
    """The step time this rung gives (None: it gives none)."""
    compile_seconds: float = 0.0
    """One-time seconds before the first step (a measured run's warm-up)."""
    managed_bytes: int = 0
    """CUDA managed memory (a paged optimizer's states): ``used_bytes`` holds the part that fits
    beside the allocator side (memfit.memory.budget.Budget.counted)."""
    host_bytes: int = 0
    """Peak bytes in host memory (0 where unknown): as :attr:`Candidate.host_bytes`."""

    def over(self, budget_bytes: int) -> bool:
        return self.used_bytes is not None and self.fidelity.over(self.used_bytes, budget_bytes)


@dataclass
class Candidate:
    plan: Plan
    seconds: float
    """Predicted seconds per step, what plans are ranked by: the steady step, plus compile time
    spread over the run when its length is given."""
    step_seconds: float | None = None
    """Predicted steady step time (None: ``seconds``)."""
    compile_seconds: float = 0.0
    """One-time compile seconds before the first step: measured (calibrated) or predicted from the compiled graph size (GPU presets)."""
    status: Status = Status.NOT_EVALUATED
    reason: str = ""
    used_bytes: int | None = None
    """What the budget holds: reserved + context (GPU) or device + host (CPU)."""
    peak_bytes: int | None = None
    managed_bytes: int = 0
    """CUDA managed memory (paged optimizer states), partly in ``used_bytes`` (memfit.memory.budget)."""
    host_bytes: int = 0
    """Peak bytes in the training machine's memory: the step's copies there, and a paged optimizer's
    states paged out (memfit.planner.gpu_ladder); held to ``--host-memory`` (memfit.memory.budget)."""
    recipe: object | None = None
    """The field's recipe this plan is (memfit.planner.field_recipes.FieldRecipe), if any."""
    time_notes: list[str] = field(default_factory=list)
    """What the time model says of the predicted time (the managed pages' migration)."""

    @property
    def open(self) -> bool:
        """Not decided yet (the walk may still visit it)."""
        return self.status is Status.NOT_EVALUATED

    def retime(self, model, steps: int | None) -> None:
        """Take the time model's figures (they change as the plan is measured)."""
        self.seconds, self.step_seconds, self.compile_seconds = model.per_step(self.plan, steps), \
            model.predict(self.plan), model.warmup(self.plan)
        self.time_notes = model.step_notes(self.plan)

    def take(self, evidence: Evidence) -> None:
        self.peak_bytes = evidence.peak_bytes
        self.used_bytes = evidence.used_bytes
        self.managed_bytes = evidence.managed_bytes
        self.host_bytes = evidence.host_bytes

    def reopen(self) -> None:
        self.status, self.reason = Status.NOT_EVALUATED, ""

    def recall(self, evidence: Evidence | None) -> None:
        """Back to what the best evidence at hand says (after a rung's verdict was withdrawn)."""
        self.used_bytes = None if evidence is None else evidence.used_bytes

    def note(self, reason: str) -> None:
        """Say why an open candidate stays open (the trace limit; nothing fits)."""
        self.reason = reason

    def reject(self, reason: str) -> None:
        self.status, self.reason = Status.TOO_BIG, reason

    def prune(self, reason: str) -> None:
        self.status, self.reason = Status.PRUNED, reason

    def invalidate(self, error: Exception) -> None:
        self.status, self.reason = Status.INVALID, str(error)

    def outrun(self, reason: str) -> None:
        self.status, self.reason = Status.SLOWER, reason

    def leave_untried(self, reason: str) -> None:
        self.status, self.reason = Status.UNTRIED, reason

    def choose(self, reason: str | None = None) -> None:
        self.status = Status.CHOSEN
        if reason is not None:
            self.reason = reason
