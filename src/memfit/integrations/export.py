"""Export a plan to Hugging Face ``TrainingArguments`` or Lightning ``Trainer`` arguments.

The keyword arguments are ones ``TrainingArguments(**kwargs)`` / ``Trainer(**kwargs)`` accept
unchanged (tested against the installed transformers, and lightning where it is installed), and
they say what runs: where the trainer's default differs from the plan, the plan's value is written
(``max_grad_norm=0.0``: the Trainer clips at 1.0 by default). Each technique maps itself
(``Config.export``); what the arguments cannot carry is listed as plan keys, and the export names
memfit's callback for that trainer, which applies them; what the user's own code sets (how the model
is loaded, the DataLoader's batch size) is listed as notes. Nothing is silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from memfit.devices import Device, get_device
from memfit.plans import Plan
from memfit.techniques.base import Export

HF_CALLBACK = "memfit.integrations.transformers.MemfitCallback"
HF_TRAINER = "memfit.integrations.transformers.MemfitTrainer"
HF_CALLBACK_APPLIES = ("checkpointing", "attention")
"""Techniques that act on the model alone: the Trainer's callback applies them. A plan with anything
else that TrainingArguments cannot carry changes the step itself, and runs in :data:`HF_TRAINER`."""
HF_STEP_KEYS = ("gradient_accumulation_steps", "bf16", "fp16", "gradient_checkpointing",
                "gradient_checkpointing_kwargs", "torch_compile")
"""What memfit's own step does itself under HF_TRAINER (the arguments must leave them off)."""
LIGHTNING_CALLBACK = "memfit.integrations.lightning.MemfitCallback"
HF_OUTPUT_DIR = "trainer_output"
"""transformers' own default output_dir (4.50 and later); earlier releases require the argument, so
the export writes it: the user changes it to theirs."""


@dataclass(frozen=True)
class TrainerArguments:
    """One trainer's arguments for a plan: what its keyword arguments carry, and the rest."""

    call: str
    """What the arguments are for: ``TrainingArguments`` or ``Trainer``."""
    kwargs: dict
    """Keyword arguments the call accepts unchanged."""
    unmapped: tuple[str, ...]
    """Plan settings the arguments cannot carry (as plan keys): :attr:`callback` applies them."""
    notes: tuple[str, ...]
    """What the user's own code sets (how the model is loaded, the DataLoader's batch size)."""
    callback: str
    """memfit's callback for this trainer (the import path)."""

    def python(self) -> str:
        """The call as a line of Python: ``TrainingArguments(**{"output_dir": "trainer_output", "bf16": True})``
        (strings in double quotes, so the dict reads as JSON too, except for True/False/None)."""
        return f"{self.call}(**{_literal(self.kwargs)})"

    def callback_line(self, plan_file: str | None = None) -> str | None:
        """How to apply what the arguments cannot carry; None when they carry the whole plan."""
        if not self.unmapped:
            return None
        where = "" if plan_file else " (write the plan with memfit plan ... --out plan.yaml)"
        if self.callback == HF_TRAINER:
            return (f"{self.callback}(..., plan={plan_file or 'plan.yaml'!r}) in place of Trainer runs these in memfit's "
                    f"own step{where}")
        return f"{self.callback}(plan={plan_file or 'plan.yaml'!r}) in the Trainer's callbacks applies these{where}"


def _literal(value) -> str:
    """``value`` (plain data) as a Python literal with double-quoted strings."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def export(plan: Plan, batch_size: int, device: Device | str | None = None) -> Export:
    """Every technique's arguments for ``plan`` at ``batch_size`` (global), resolved for ``device``
    (``precision: auto``) when one is given. Arguments of the device go first, so a technique's
    (a sharded plan's ``devices``) take their place."""
    dev = get_device(device) if device is not None else None
    into = Export(plan.config("shard").rank_batch(batch_size),  # per device, as both trainers count it
                  trains_adapter=not plan.config("adapter").is_default)
    into.hf["output_dir"] = HF_OUTPUT_DIR
    if dev is not None:
        if dev.is_gpu:
            into.lightning.update(accelerator="gpu", devices=1)
        else:  # a plan for this machine's CPU runs there
            into.hf["use_cpu"] = True
            into.lightning.update(accelerator="cpu", devices=1)
    for config in plan.techniques:
        (config.resolve(dev) if dev is not None else config).export(into)
    return into


def to_hf(plan: Plan, batch_size: int, device: Device | str | None = None) -> TrainerArguments:
    """The plan as TrainingArguments for a Trainer with :data:`HF_CALLBACK`; or, when the plan
    changes the step itself (what the arguments cannot carry and acts on more than the model), for
    :data:`HF_TRAINER`, whose own step does micro-batching, precision, checkpointing and compile:
    those arguments are left off, the batch per device is the whole batch, and the plan keys for
    them are listed with the rest."""
    into = export(plan, batch_size, device)
    kwargs, unmapped = dict(into.hf), list(into.hf_unmapped)
    dev = get_device(device) if device is not None else None
    configs = [c.resolve(dev) if dev is not None else c for c in plan.techniques if not c.is_default]
    step_side = [c for c in configs if c.technique.name not in HF_CALLBACK_APPLIES and hf_unmapped_of(c, into.batch_size)]
    if not step_side:
        return TrainerArguments("TrainingArguments", kwargs, tuple(unmapped), tuple(into.hf_notes), HF_CALLBACK)
    carried = [k for k in HF_STEP_KEYS if kwargs.pop(k, None) not in (None, False, 1)]
    if "gradient_accumulation_steps" in carried:
        kwargs["per_device_train_batch_size"] = into.batch_size
    values = {k: v for c in configs for k, v in c.values().items()}
    for key in ("micro_batch_size", "precision", "checkpointing", "compile"):
        if key in values and (key != "micro_batch_size" or "gradient_accumulation_steps" in carried) \
                and not any(u.startswith(f"{key}:") for u in unmapped):
            unmapped.append(f"{key}: {values[key]}")
    return TrainerArguments("TrainingArguments", kwargs, tuple(unmapped), tuple(into.hf_notes), HF_TRAINER)


def hf_unmapped_of(config, batch_size: int) -> list:
    """What TrainingArguments cannot carry of this one technique."""
    into = Export(batch_size)
    config.export(into)
    return into.hf_unmapped


def to_lightning(plan: Plan, batch_size: int, device: Device | str | None = None) -> TrainerArguments:
    into = export(plan, batch_size, device)
    kwargs, unmapped, notes = dict(into.lightning), list(into.lightning_unmapped), list(into.lightning_notes)
    if unmapped and kwargs.get("accumulate_grad_batches", 1) != 1:
        # the callback trains with memfit's step, which splits each whole batch into the plan's
        # micro-batches itself (under manual optimization Lightning does not accumulate)
        micro, n = plan.micro_batches(batch_size)
        del kwargs["accumulate_grad_batches"]
        unmapped.append(f"micro_batch_size: {micro}")
        notes = [note for note in notes if not note.startswith("DataLoader(")]
        notes.append(f"DataLoader(batch_size={micro * n}): the plan's whole batch (memfit's step splits it into "
                     f"{n} micro-batches of {micro})")
    return TrainerArguments("Trainer", kwargs, tuple(unmapped), tuple(notes), LIGHTNING_CALLBACK)


def carried_by(to, fixed: dict | None = None):
    """Whether a trainer's config carries a plan (``memfit plan --format kohya|ai-toolkit`` searches only those):
    every setting ``to(plan)`` lists as unmapped is one of the ``fixed`` fields the user gave (theirs to keep, and
    listed). ``to(Plan())`` runs first: a model the trainer does not train is refused before a search."""
    given = set(fixed or {})
    to(Plan())
    return lambda plan: all(setting.split(":", 1)[0] in given for setting in to(plan).unmapped)

