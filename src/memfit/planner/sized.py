"""A workload with one of its sizes left free: what ``max`` stands for, and the step at each value.

``--batch-size max``, ``--seq-len max`` or ``--resolution max`` leaves one size to memfit; the others
are the user's (or the workload's defaults). :class:`Sized` builds the step's :class:`Target` at any
value of the free size, and :func:`largest_estimate` finds the largest that fits under one plan
(memfit.planner.largest: a few full traces, each what ``memfit estimate`` reports at that value).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.devices import Device
from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate_target
from memfit.memory.report import MemoryReport
from memfit.planner.largest import Axis, Largest, batch_axis, find_largest, resolution_axis, seq_axis
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target
from memfit.workload import Workload
from memfit.workloads import load_workload

AXES = ("batch_size", "seq_len", "resolution")


@dataclass(frozen=True)
class Sized:
    """A workload (spec or object) with its given sizes and the free one (``axis``)."""

    spec: str | Workload
    axis: Axis
    batch_size: int | None = None
    seq_len: int | None = None
    resolution: int | None = None
    second: int | None = None
    """The second value the search traces (the workload's own size, where the line is drawn better
    than through the two smallest; None: the grid's second)."""
    loaded: Workload | None = None
    """The workload at its fixed sizes, loaded once (the batch's axis: its sizes do not change)."""

    @classmethod
    def of(cls, spec: str | Workload, key: str, *, batch_size: int | None = None, seq_len: int | None = None,
           resolution: int | None = None) -> Sized:
        """``key`` (one of :data:`AXES`) left free; the others as given."""
        if key == "batch_size":
            wl = load_workload(spec, seq_len=seq_len, resolution=resolution)
            return cls(wl, batch_axis(), seq_len=seq_len, resolution=resolution, loaded=wl)
        if not isinstance(spec, str):
            raise UserError(f"{'--seq-len' if key == 'seq_len' else '--resolution'} max rebuilds the workload at each "
                            "value: name a built-in, a model folder or a hub id, not a workload object")
        if key == "seq_len":
            if resolution is not None:
                raise UserError("--seq-len max applies to language models; drop --resolution")
            own = load_workload(spec).info.seq_len
            return cls(spec, seq_axis(), batch_size=batch_size, second=own)
        wl = load_workload(spec, seq_len=seq_len)
        if wl.info.resolution_step is None:
            from memfit.workloads.builtin import IMAGE_BUILDERS
            raise UserError(f"--resolution max applies to the image- and video-generation built-ins "
                            f"({', '.join(IMAGE_BUILDERS)}) and diffusers repositories, not {wl.name}")
        squared = not wl.info.config.get("fixed_width")  # (a Wan clip's width=: only its height grows)
        return cls(spec, resolution_axis(wl.info.resolution_step, squared), batch_size=batch_size, seq_len=seq_len,
                   second=wl.info.resolution)

    def sizes(self, value: int) -> dict:
        return {"batch_size": self.batch_size, "seq_len": self.seq_len, "resolution": self.resolution,
                self.axis.key: value}

    def target(self, value: int, plan: Plan | None, device: Device | str) -> Target:
        """The step at ``value`` of the free size under ``plan`` on ``device``."""
        if self.loaded is not None:
            return Target.resolve(self.loaded, plan, value, device)
        s = self.sizes(value)
        return Target.resolve(self.spec, plan, s["batch_size"], device, seq_len=s["seq_len"], resolution=s["resolution"])

    def workload_at(self, value: int) -> Workload:
        """The workload at ``value`` (the batch's axis: the workload itself)."""
        if self.loaded is not None:
            return self.loaded
        s = self.sizes(value)
        return load_workload(self.spec, seq_len=s["seq_len"], resolution=s["resolution"])

    def batch_at(self, value: int) -> int | None:
        return value if self.axis.key == "batch_size" else self.batch_size


def check_whole_batch(plan: Plan, axis: Axis) -> None:
    """``max`` is what one step holds at once: a plan that splits the batch into micro-batches holds
    a micro-batch at a time, and its batch could grow without bound."""
    if axis.key == "batch_size" and not plan.config("accumulation").is_default:
        raise UserError("--batch-size max finds the largest batch one step holds at once; drop --micro-batch-size "
                        "and --grad-accum-steps (a split batch can grow without bound)")


def largest_estimate(sized: Sized, plan: Plan, device: Device | str, budget: Budget, first: int | None = None
                     ) -> tuple[Largest, MemoryReport]:
    """The largest value of the free size whose step under ``plan`` fits ``budget`` (what it counts:
    :class:`~memfit.memory.budget.Budget`), exact: its full trace fits and the next value's does not
    (memfit.planner.largest). Returns the answer and the report at that value (at the smallest value
    where none fits). ``first``: a value known to fit, to start from (default: the smallest)."""
    check_whole_batch(plan, sized.axis)
    reports: dict[int, MemoryReport] = {}

    def measure(value: int) -> int:
        with silenced_warnings():
            reports[value] = estimate_target(sized.target(value, plan, device))
        return budget.used_bytes(reports[value])

    found = find_largest(sized.axis, measure, budget.bytes, first=first, second=None if first else sized.second)
    return found, reports[found.value if found.value is not None else found.next_value]


def budget_for(spec: str | int | None, device: Device) -> Budget:
    """``--budget`` of estimate's ``max``: as given, else the whole device (what a report's verdict says)."""
    return Budget.of_device(device) if spec is None else Budget.resolve(spec, device)
