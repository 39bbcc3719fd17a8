"""What a technique is, and everything memfit asks of one.

A technique is one module of ``memfit.techniques``. It owns one or more plan keys (the YAML
sugar, e.g. ``checkpointing: blocks:every=2``) and holds *sibling config classes*, one per
variant, as torchtitan's ``FullAC`` / ``SelectiveAC`` / ``MemoryBudgetAC``: frozen dataclasses
whose documented fields are the variant's options. A plan value is parsed once into one config;
a :class:`~memfit.plans.Plan` is the composition of one config per technique.

Everything the rest of memfit needs to know about a technique is asked of its config:

============================  =========================================================================
``apply(parts)``              change the step being built (:class:`StepParts`): the model, how the
                              optimizer is built, the loss, the contexts the step holds
``on_load(model, load)``      what loading a checkpoint does for it before the weights arrive (a
                              quantizer quantizes while loading: :mod:`memfit.techniques.loading`)
``check(plan)``               refuse combinations with other techniques (a ``UserError`` with the fix)
``saves_at_most(other, b)``   memory order for the planner's pruning (by ``rank`` unless overridden)
``ordered_in(plan)``          whether that order holds in a plan (e.g. not for offloaded states)
``adds_work``                 only adds work: a calibrated factor below 1 is timing noise
``warmup_seconds(g, plan)``   one-time seconds before the first step on GPU presets (compiling)
``export(into)``              Hugging Face ``TrainingArguments`` / Lightning ``Trainer`` arguments, and
                              what they cannot carry (memfit's callback applies it)
``from_arguments(given)``     the reverse: the config a trainer's own arguments run (the integrations)
``ablations()``               "without me": the configs the end-of-run report compares against
``label(batch_size)``         the compact label in ``Plan.short()``
``frugal(ctx)``               the next setting that uses less memory, for OOM adaptation
``escalation(ctx)``           when adaptation asks for it (the technique's ``escalation`` unless moved)
``resolve(device)``           a concrete config for a device (``precision: auto``)
``trace_context()``           what a fake-tensor trace of it needs (a library's real code path)
``notes()``                   what an estimate of it approximates
============================  =========================================================================

The module registers a :class:`Technique` as ``TECHNIQUE``: its keys (name, default, doc, CLI
parsing), how to parse their values into a config, which values the planner tries (``search``)
and when OOM adaptation turns to it (``escalation``). The optimizer variants of the key
``optimizer`` answer a few questions more, about an optimizer alone (memfit.techniques.
optimizer_variant's ``OptimizerVariant``).

Adding a technique (the one place that says how):

1. Its module in ``memfit/techniques/``, opening with a docstring that teaches its memory and
   compute trade-off; one frozen config dataclass per variant (a subclass of :class:`Config`,
   documented fields), answering what the table above asks where the default does not fit; and
   ``TECHNIQUE = register(Technique(name, keys, parse, ...), *config_classes)``. ``memfit.
   techniques`` finds it by that name.
2. Its keys as fields of :class:`~memfit.plans.Plan` (``memfit/plans.py``), each defaulting to its
   ``Key``: where they stand among the fields is when ``build_step`` applies the config. The CLI's
   plan flags, ``build_step``, the planner's search space, time model and pruning, the exports, the
   report's ablations and OOM adaptation all come from ``memfit.plans.TECHNIQUES``.
3. Its test under ``tests/unit/techniques/``: the memory it saves, measured independently of the
   code under test, and gradients equal to the step without it (or within a stated bound).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from memfit.errors import UserError


@dataclass(frozen=True)
class Key:
    """One plan key: its name in YAML, JSON and on the command line (``--name`` with ``_`` as ``-``)."""

    name: str
    default: Any
    doc: str
    """One line; also the CLI help."""
    annotation: str = "str"
    """The type shown in a plan's schema."""
    from_text: Callable[[str], Any] = str
    """Command-line text -> plan value (raises UserError naming the flag)."""
    metavar: str = ""


@dataclass(frozen=True)
class Technique:
    """A technique module's registration (``TECHNIQUE`` at module level)."""

    name: str
    keys: tuple[Key, ...]
    parse: Callable[[dict[str, Any]], Config]
    """The plan values of ``keys`` -> the config (raises UserError naming the key and what is allowed)."""
    search: Callable[[SearchContext], list] | None = None
    """The plan values the planner tries (single-key techniques); None: not searched."""
    escalation: int | None = None
    """OOM adaptation turns to this technique in this order (lower first); None: never. A config
    may move itself in some plans (:meth:`Config.escalation`)."""
    depends_on_model: bool = False
    """Some models cannot take some values (e.g. no repeated blocks to checkpoint)."""

    @property
    def default(self) -> Config:
        return self.config({k.name: k.default for k in self.keys})

    def config(self, values: dict[str, Any]) -> Config:
        """Parse this technique's plan values; a config object given as the value is taken as is."""
        if len(self.keys) == 1:
            value = values[self.keys[0].name]
            if isinstance(value, Config) and value.technique is self:
                return value
        cfg = self.parse(values)
        assert cfg.technique is self, (self.name, type(cfg))
        return cfg


class Config:
    """Base of every technique's config classes (frozen dataclasses). Defaults: does nothing,
    saves nothing, costs nothing, maps to nothing."""

    technique: ClassVar[Technique]
    """Set by :func:`register` for every config class of a technique module."""
    rank: ClassVar[int | None] = 0
    """Memory-saving rank within the technique (higher saves more); None: not comparable."""
    adds_work: ClassVar[bool] = False
    """Only adds work (recompute, copies): a calibrated factor below 1 is timing noise."""
    warms_up: ClassVar[bool] = False
    """Costs time once before the first step (compiling): the calibrated model measures it."""
    numerics: ClassVar[str | None] = None
    """How this config changes the numbers the update computes, in a few words (e.g. "4-bit AdamW
    states"); None: it computes what the workload's own step computes (up to kernel rounding)."""

    # -- what the plan holds -----------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        """The plan values of the technique's keys for this config."""
        raise NotImplementedError

    @property
    def text(self) -> Any:
        """The value of a single-key technique's key (what the planner and reports show)."""
        (value,) = self.values().values()
        return value

    @property
    def is_default(self) -> bool:
        return self == self.technique.default

    def unimplemented(self) -> str | None:
        """Why this version cannot run this config yet (None: it can)."""
        return None

    # -- building the step -------------------------------------------------------------------
    def resolve(self, device) -> Config:
        """The concrete config for ``device`` (e.g. ``precision: auto``); raises if unsupported."""
        return self

    def choices(self, device) -> list[Config]:
        """The concrete configs the planner chooses from for this value on ``device`` (a value that
        leaves the choice to the planner, e.g. ``ema: {device: auto}``, gives several)."""
        return [self]

    def check(self, plan) -> None:
        """Refuse combinations with the plan's other techniques (UserError with the fix)."""

    def build_context(self) -> contextlib.AbstractContextManager:
        """Entered around the workload's ``model()`` call (e.g. bf16-pure builds the weights in bf16,
        so that an fp32 copy of the model never takes device memory)."""
        return contextlib.nullcontext()

    def on_load(self, model, load) -> None:
        """What a checkpoint's load does for this config before the weights arrive, on the model
        built on the meta device (a workload that loads as a checkpoint, :mod:`memfit.techniques.loading`):
        a quantizer replaces the layers it quantizes while loading and registers how in ``load``."""

    def apply(self, parts: StepParts) -> None:
        """Change the step being built."""

    def trace_context(self) -> contextlib.AbstractContextManager:
        """Entered around a fake-tensor trace of a step with this config."""
        return contextlib.nullcontext()


    def notes(self) -> list[str]:
        """What an estimate of this config approximates (shown in its report)."""
        return []

    # -- planning ----------------------------------------------------------------------------
    def saves_at_most(self, other: Config, batch_size: int) -> bool:
        """True if this config saves no more memory than ``other`` (values of equal rank but
        different kind are not comparable)."""
        if self == other:
            return True
        return self.rank is not None and other.rank is not None and self.rank < other.rank

    def states_aside(self) -> Config:
        """This config with what it does to the trained parameters' gradients and optimizer states left
        out (the technique's default where that is all it does): the planner compares plans so where a
        plan too big by more than those could ever save rules out others (NOTE [ Failures too big for
        any optimizer choice ] in memfit.planner.failures)."""
        return self

    def ordered_in(self, plan) -> bool:
        """Whether :meth:`saves_at_most` orders this config's device memory inside ``plan`` (the
        optimizer's state precision does not once the states live on the host). Where it does not,
        the planner compares the config by equality only."""
        return True

    def warmup_seconds(self, graph: GraphSize, plan) -> float:
        """One-time seconds this config adds before the first step of ``plan`` runs on a GPU preset
        (compiling; ``graph``: the sizes of what is compiled), not counted in the step time."""
        return 0.0

    def frugal(self, ctx: AdaptContext) -> tuple[Config, str] | None:
        """A config that uses less memory and what to call the change, for OOM adaptation."""
        return None

    def escalation(self, ctx: AdaptContext) -> int | None:
        """When OOM adaptation asks this config for a more frugal one (lower first; None: never): the
        technique's ``escalation``, unless the plan moves it (a compiled plan lowers its activation
        memory budget before it splits the batch)."""
        return self.technique.escalation

    # -- reporting ---------------------------------------------------------------------------
    def label(self, batch_size: int | None) -> str | None:
        """Compact label in ``Plan.short()`` (None: not shown)."""
        return None

    def ablations(self) -> list[tuple[str, Config]]:
        """(name, config without this technique) pairs for the report of what each saved."""
        return []

    def export(self, into: Export) -> None:
        """Add this config's Hugging Face and Lightning arguments, or what does not map, to ``into``."""

    @classmethod
    def from_arguments(cls, given: Export) -> Config | None:
        """The reverse of :meth:`export`: the config that a trainer's own arguments run (``given.hf``:
        the ``TrainingArguments``' values, ``given.lightning``: the Lightning ``Trainer``'s), or None
        where they say nothing about this technique (the trainer's default: the plan decides)."""
        return None


def register(technique: Technique, *classes: type[Config]) -> Technique:
    """Attach ``technique`` to its config classes; returns it (``TECHNIQUE = register(...)``)."""
    for cls in classes:
        cls.technique = technique
    return technique


def choice(key: str, value: Any, allowed: tuple[str, ...] | list[str]) -> str:
    """``value`` if it is one of ``allowed``, else the plan error naming the key and the choices."""
    if value not in allowed:
        raise UserError(f"plan: {key} {value!r} is not valid; choose one of {', '.join(allowed)}")
    return value


def whole_number(flag: str):
    """CLI text -> int, or a UserError naming ``flag``."""
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise UserError(f"{flag} {text!r} is not a whole number") from None
    return parse


# -- what techniques act on and are asked with ---------------------------------------------------

class NoState:
    """A step part with nothing to update or keep (e.g. the EMA of a plan without one)."""

    def update(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class StepParts:
    """The step under construction. ``build_step`` makes it from the workload, lets every config
    of the plan ``apply`` to it in order, then builds the optimizer and the TrainStep from it."""

    model: Any
    """The nn.Module, built on the step's device (fake tensors when tracing)."""
    device: Any
    """The memfit Device the step is for."""
    device_type: str
    """Where the tensors live ('cpu' or 'cuda'; see memfit.devices.tensor_device)."""
    batch_size: int
    placement: Any
    """HostPlacement: copies to host memory, reported to the step's observer."""
    loss_fn: Callable
    """loss(model, batch) -> scalar tensor."""
    optimizer_factory: Callable
    """params -> optimizer: the workload's, wrapped by optimizer techniques."""
    precision: Any = None
    """The precision config: autocast(device_type), grad_scaler(device_type), prepare_batch(batch)."""
    micro_batch_size: int = 0
    num_micro_batches: int = 1
    make_optimizer: Callable = field(default=lambda params, factory: factory(params))
    """(params, factory) -> the step's optimizer (plain, stepped in backward, offloaded states)."""
    updates_in_backward: bool = False
    """Parameters are updated during backward (an interrupted backward cannot be retried)."""
    contexts: list = field(default_factory=list)
    """Context factories held around forward and backward (backward may recompute)."""
    forward_contexts: list = field(default_factory=list)
    """Context factories held around forward only (e.g. saved-tensor hooks)."""
    recompute_contexts: list = field(default_factory=list)
    """Context factories entered again around each recomputation in backward."""
    before_backward: list = field(default_factory=list)
    """Hooks ``hook(index, count)`` run before micro-batch ``index`` of ``count`` starts its backward."""
    before_update: list = field(default_factory=list)
    """Hooks ``hook(step)`` run after backward, before the optimizer step."""
    after_update: list = field(default_factory=list)
    """Hooks ``hook()`` run after the optimizer step."""
    ema: Any = field(default_factory=NoState)
    """An object with update(), state_dict() and load_state_dict() kept in checkpoints."""
    plan: Any = None
    """The plan being applied (a technique may read another's config, e.g. compile reads the
    activation memory budget of ``checkpointing: budget:F``)."""
    loaded: bool = False
    """The model was loaded as a checkpoint (built on the meta device, each weight materialised in
    its final form): the plan's ``on_load`` conversions are done (memfit.techniques.loading)."""
    finalizers: list = field(default_factory=list)
    """``finalize(parts)`` hooks run after every config has applied itself (e.g. compiling the
    whole loss once chunking and checkpointing have wrapped it)."""


@dataclass(frozen=True)
class SearchContext:
    """What the planner knows when it asks a technique which values to try."""

    model: Any
    """The workload's model built on the meta device (structure only, no memory)."""
    device: Any
    batch_size: int
    options: dict = field(default_factory=dict)
    """Planner options, e.g. ``optimizers``: the optimizer variants to consider."""
    notes: list = field(default_factory=list)
    """Values left out because they cannot run here, and why (techniques append)."""
    narrowed: list = field(default_factory=list)
    """Keys whose values a heuristic left out, which a search where nothing fits tries again whole (NOTE [ Swap
    searched when nothing fits ] in memfit.planner.search; techniques append)."""


@dataclass(frozen=True)
class GraphSize:
    """The size of the graphs a compiled plan compiles, in ATen ops as the planner's op recorder
    counts them (memfit.planner.opcost): what compile time is predicted from on GPU presets."""

    forward_ops: int = 0
    """Ops of the whole forward (the graph ``compile: full`` compiles)."""
    block_ops: int = 0
    """Ops of one repeated block's forward (the graph ``compile: blocks`` compiles once)."""


@dataclass
class Export:
    """Arguments for Hugging Face ``TrainingArguments`` and Lightning's ``Trainer`` that those
    classes accept unchanged (and kohya-ss sd-scripts' config), and what they cannot carry, so nothing
    is silently dropped:
    ``*_unmapped`` lists plan settings memfit's callback for that trainer applies (written as plan
    keys, ``loss_chunks: 4``); ``*_notes`` lists what the user's own code sets (how the model is
    loaded, the DataLoader's batch size)."""

    batch_size: int
    """One device's batch: the plan's global batch over its ranks (all of it unless sharded)."""
    hf: dict = field(default_factory=dict)
    hf_unmapped: list = field(default_factory=list)
    hf_notes: list = field(default_factory=list)
    lightning: dict = field(default_factory=dict)
    lightning_unmapped: list = field(default_factory=list)
    lightning_notes: list = field(default_factory=list)
    kohya: dict = field(default_factory=dict)
    """kohya-ss sd-scripts' arguments (memfit.integrations.kohya_export: the model family's adjustments)."""
    kohya_unmapped: list = field(default_factory=list)
    kohya_notes: list = field(default_factory=list)
    ai_toolkit: dict = field(default_factory=dict)
    """ai-toolkit's job fields, by ``section.key`` of its training process (``train.dtype``, ``model.quantize``;
    memfit.integrations.ai_toolkit_export)."""
    ai_toolkit_unmapped: list = field(default_factory=list)
    ai_toolkit_notes: list = field(default_factory=list)
    axolotl: dict = field(default_factory=dict)
    """axolotl's config fields (memfit.integrations.axolotl_export: the model's own, Liger's slices)."""
    axolotl_unmapped: list = field(default_factory=list)
    axolotl_notes: list = field(default_factory=list)
    trains_adapter: bool = False
    """The plan trains an adapter (axolotl's ``bf16`` then keeps it in fp32 over a bf16 model)."""

    def not_carried(self, config: Config | str, *, hf: bool = True, lightning: bool = True, kohya: bool = True,
                    ai_toolkit: bool | None = None, axolotl: bool = True) -> None:
        """No trainer's arguments carry ``config`` (its plan keys are listed) or ``what`` (but those told);
        ``ai_toolkit``: as ``kohya`` unless told (both train diffusion models from a config file); ``axolotl``:
        not carried unless told, where the technique writes axolotl's fields."""
        what = config if isinstance(config, str) else "; ".join(
            f"{key}: {_plain_text(value)}" for key, value in config.values().items())
        if hf:
            self.hf_unmapped.append(what)
        if lightning:
            self.lightning_unmapped.append(what)
        if kohya:
            self.kohya_unmapped.append(what)
        if kohya if ai_toolkit is None else ai_toolkit:
            self.ai_toolkit_unmapped.append(what)
        if axolotl:
            self.axolotl_unmapped.append(what)

    def in_lightning_module(self, what: str) -> None:
        """``what`` has no Lightning ``Trainer`` argument."""
        self.lightning_unmapped.append(what)


def _plain_text(value: Any) -> str:
    """A plan value as the plan file writes it: ``true``, ``[activations]``, ``{decay: 0.999}``."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_plain_text(v) for v in value) + "]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_plain_text(v)}" for k, v in value.items()) + "}"
    return str(value)


@dataclass(frozen=True)
class AdaptContext:
    """What OOM adaptation knows when it asks a technique for a more frugal setting."""

    plan: Any
    batch_size: int
    """The samples the step runs (one rank's share of the global batch when sharded)."""
    model: Any
    """The running step's model (its structure decides, e.g., whether blocks exist)."""
    fits: Callable | None = None
    """fits(plan) -> bool: does the estimate predict the plan fits? None: unknown."""
    coupled_samples: str | None = None
    """Why the step's samples depend on each other (memfit.workload.WorkloadInfo), or None."""
