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
from memfit.workloads.checkpoint_formats import by_card, format_on


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
        dev = get_device(device)
        plan = as_checkpoint(plan or Plan(), wl, dev, trained=plan is not None)  # (None: the workload alone)
        bs = batch_size or wl.default_batch_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
            raise UserError(f"batch size must be a positive whole number, got {batch_size!r}")
        plan.check_implemented()
        plan.micro_batches(bs)
        return cls(wl, plan, bs, dev)

    def with_plan(self, plan: Plan) -> Target:
        """The same workload, batch and device under another plan (checked as :meth:`resolve` does)."""
        plan = as_checkpoint(plan, self.workload, self.device)
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


def as_checkpoint(plan: Plan, wl: Workload, device=None, trained: bool = True) -> Plan:
    """``plan`` on what the workload's checkpoint is on ``device``. A pre-quantized checkpoint's base weights are
    quantized whatever the plan says: ``as-is`` means its own format; another format cannot be loaded
    from it (a fine-grained FP8 one loads in full precision on a card without FP8 kernels: NOTE [ FP8
    checkpoints by card ] in memfit.workloads.checkpoint_formats). An adapter checkpoint trains its own adapter
    (NOTE [ Adapter checkpoints ] in memfit.workloads.adapter_folders): ``none`` means it; another adapter is not
    it. A pre-quantized checkpoint without an adapter trains nothing of its quantized weights: one line, as
    transformers' Trainer refuses it (``trained`` False: the workload's facts are wanted, not a step). Every plan of
    a target passes here, the planner's candidates too."""
    stored = format_on(wl.info.quantized, device)
    for key, ours, what, fix in (
            ("base_weights", stored,
             "a pre-quantized checkpoint ({}, its config.json's quantization_config)",
             "drop --base-weights (or plan the full-precision checkpoint)"),
            ("adapter", wl.info.adapter, "an adapter checkpoint ({}, its adapter_config.json)",
             "drop --adapter (or plan its base model)")):
        if ours is None:
            continue
        theirs = plan.replace(**{key: ours})
        if plan.config(key).is_default:
            plan = theirs
        elif plan.config(key) != theirs.config(key):
            raise UserError(f"{wl.name} is {what.format(ours)}: its {key} is {ours}, not {getattr(plan, key)}; {fix}")
    if trained and stored is not None and plan.config("adapter").is_default:  # (transformers' validate_quantization_for_training)
        if by_card(wl.info.quantized):  # (first the reason, which is the card's: fit's cell shows the start)
            raise UserError(f"its weights load in float8 on this card (it has FP8 kernels: compute capability 8.9 or "
                            f"later) and are frozen: {wl.name} is an FP8 checkpoint that transformers' Trainer refuses "
                            "to fine-tune without an adapter; add --adapter lora:r=16, or train it fully on an earlier "
                            "card (where it loads in bf16) or from its bf16 release")
        raise UserError(f"{wl.name} is a pre-quantized checkpoint ({stored}): its quantized weights are frozen, and "
                        "transformers' Trainer refuses to fine-tune it without an adapter (\"You cannot perform "
                        "fine-tuning on purely quantized models\"); add --adapter lora:r=16")
    return plan


def as_exported(plan: Plan, wl: Workload, device=None) -> tuple[Plan, list[str]]:
    """``plan`` as a trainer's config carries it for ``wl`` on ``device``, and what to say of what it leaves to the
    checkpoint: a fine-grained FP8 checkpoint's ``fp8`` is its own format, which ``from_pretrained`` loads on that
    card whatever the config sets (NOTE [ FP8 checkpoints by card ] in memfit.workloads.checkpoint_formats), not
    kohya's ``--fp8_base`` to ask of the trainer."""
    stored = format_on(wl.info.quantized, device)
    if not by_card(wl.info.quantized) or plan.base_weights != stored:
        return plan, []
    return plan.replace(base_weights="as-is"), [f"base_weights {stored}: the checkpoint's own format (its config.json's "
                                                "quantization_config); from_pretrained loads it so, nothing to set"]


def checkpoint_fields(fixed: dict | None, wl: Workload, device=None) -> dict:
    """The plan fields a search on ``device`` fixes, with what the workload's checkpoint fixes there
    (:func:`as_checkpoint`: a pre-quantized checkpoint's ``base_weights``, an adapter checkpoint's ``adapter``) added."""
    fixed = dict(fixed or {})
    plan = as_checkpoint(Plan().replace(**fixed), wl, device)
    stored = format_on(wl.info.quantized, device)
    return {**fixed, **{k: getattr(plan, k) for k, ours in (("base_weights", stored),
                                                            ("adapter", wl.info.adapter)) if ours is not None}}
