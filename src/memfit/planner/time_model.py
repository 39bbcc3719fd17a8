"""The one interface the search asks step times of, and the estimate both models share.

A plan's step time comes from one of two models: on the CPU, short real steps of the plan's own
TrainStep (memfit.planner.cost: the base plan and each technique value alone, timed here); on a
GPU preset, the ops the plan's own step runs, priced by the op-level roofline (memfit.planner.
gpu_time over memfit.planner.timing). A time model says nothing of memory: the search climbs an
evidence ladder for that (memfit.planner.ladder), built beside the model. Timing every candidate would take minutes, so both start
from the same *factor estimate*: the base plan's time times the ratio each of the plan's values
had alone (:func:`factor_estimate`; values are assumed to combine multiplicatively). The CPU's
estimate is final; the GPU model replaces it by the plan's own ops when the search visits it
(:meth:`StepTimeModel.is_estimate`).

Compile time is one-time, not part of the step (:meth:`StepTimeModel.warmup`); the planner counts
it per step only when told how long the run is (:meth:`StepTimeModel.per_step`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

from memfit.plans import Plan


def factor_estimate(base_seconds: float, keys: Iterable[Hashable], factors: Mapping[Hashable, float]) -> float:
    """``base_seconds`` times the factor of each key (1 for a key without one), in key order."""
    t = base_seconds
    for key in keys:
        t *= factors.get(key, 1.0)
    return t


class StepTimeModel:
    """What the search asks of a time model (memfit.planner.cost's and memfit.planner.gpu_time's)."""

    excluded: list[str]
    """Technique values left out of the space because they failed for this workload."""

    def predict(self, plan: Plan) -> float:
        """The plan's steady step seconds."""
        raise NotImplementedError

    def warmup(self, plan: Plan) -> float:
        """One-time seconds before the plan's first step (compiling)."""
        raise NotImplementedError

    def is_estimate(self, plan: Plan) -> bool:
        """The plan's time is the factor estimate, not yet its own (measured or traced)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def step_notes(self, plan: Plan) -> list[str]:
        """What the report says of the plan's predicted time beyond its figure (none by default)."""
        return []

    def per_step(self, plan: Plan, steps: int | None) -> float:
        """Seconds per step over a run of ``steps`` steps (compile time spread over them); None: a
        run long enough for compile time not to count."""
        return self.predict(plan) + (self.warmup(plan) / steps if steps else 0.0)

    def factor_between(self, plan: Plan, measured: Plan) -> float | None:
        """What ``plan``'s time is to ``measured``'s, by the factors of the values each has that the other lacks, where
        ``plan``'s time is an estimate and ``measured``'s is not (NOTE [ A simpler plan timed from the chosen one ] in
        memfit.planner.simpler); None where the model has no such factors."""
        return None

    def newly_measured(self) -> list[Plan]:
        """Plans measured since the last call, whose figures may change other plans' estimates
        (none where estimates are final)."""
        return []

    def estimate_depends_on(self, plan: Plan, measured: list[Plan]) -> bool:
        """Whether ``plan``'s estimate may have changed now that ``measured`` are."""
        return False

    def prepare(self, ahead: list[Plan] | None = ()) -> None:
        """Measure what the estimates need (before the first ``predict``). ``ahead``: plans the walk
        may measure first, which idle workers may trace meanwhile (None: nothing is traced for the
        walk before it starts)."""

    def close(self) -> None:
        """Release what the model holds."""
