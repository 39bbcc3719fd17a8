"""Target: what one step is, resolved once: a workload, a plan, a global batch size, a device.

``estimate``, ``profile``, ``build_step``, the planner and training all start from what the user
named (a workload spec or object, a plan file or object, a batch size or none, a device name);
:meth:`Target.resolve` turns that into checked objects in one place, and everything below takes
the Target: the same step is described once, not as four values passed along.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.devices import Device, get_device, tensor_device
from memfit.errors import UserError
from memfit.plans import Plan
from memfit.workload import Workload
from memfit.workloads import load_workload


@dataclass(frozen=True, eq=False)
class Target:
    """A workload under a plan at a global batch size on a device (all checked)."""

    workload: Workload
    plan: Plan
    batch_size: int
    device: Device

    @classmethod
    def resolve(cls, workload: Workload | str, plan: Plan | str | None = None, batch_size: int | None = None,
                device: Device | str | None = None, *, seq_len: int | None = None,
                resolution: int | None = None) -> Target:
        """Load and check what the user named. ``plan`` may be a plan file's path; ``batch_size``
        None is the workload's default; ``device`` None is this machine's CPU; ``seq_len`` and
        ``resolution`` size a built-in (tokens; pixels for image-generation models)."""
        wl = load_workload(workload, seq_len=seq_len, resolution=resolution)
        if isinstance(plan, str):
            plan = Plan.load(plan)
        plan = _with_checkpoint_format(plan or Plan(), wl)
        bs = batch_size or wl.default_batch_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
            raise UserError(f"batch size must be a positive whole number, got {batch_size!r}")
        plan.check_implemented()
        plan.micro_batches(bs)
        return cls(wl, plan, bs, get_device(device))

    def with_plan(self, plan: Plan) -> Target:
        """The same workload, batch and device under another plan (checked as :meth:`resolve` does)."""
        plan.check_implemented()
        plan.micro_batches(self.batch_size)
        return dataclasses.replace(self, plan=plan)

    def on(self, device: Device) -> Target:
        return dataclasses.replace(self, device=device)

    @property
    def rank_batch_size(self) -> int:
        """The samples one rank's step runs: the global batch over the plan's ``world_size``."""
        return self.plan.config("shard").rank_batch(self.batch_size)

    @property
    def tensor_device(self) -> str:
        """Where the step's tensors live (see memfit.devices.tensor_device)."""
        return tensor_device(self.device)

    @property
    def precision(self) -> str:
        """The precision the step runs in (``auto`` resolved for the device)."""
        return self.plan.config("precision").resolve(self.device).name

    def describe(self) -> str:
        return f"{self.workload.name} · batch {self.batch_size} · {self.plan.describe()}"


def _with_checkpoint_format(plan: Plan, wl: Workload) -> Plan:
    """A pre-quantized checkpoint's base weights are quantized whatever the plan says: ``as-is``
    means its own format; another format cannot be loaded from it."""
    fmt = wl.info.quantized
    if fmt is None:
        return plan
    ours = plan.replace(base_weights=fmt)
    if plan.config("base_weights").is_default:
        return ours
    if plan.config("base_weights") != ours.config("base_weights"):
        raise UserError(f"{wl.name} is a pre-quantized checkpoint ({fmt}, its config.json's quantization_config): "
                        f"its base weights load as {fmt}, not {plan.base_weights}; drop --base-weights "
                        "(or plan the full-precision checkpoint)")
    return plan
