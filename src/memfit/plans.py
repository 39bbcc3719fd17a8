"""Plan: *how* to train a workload. Plain, frozen, serialisable data; never holds live objects.

A :class:`Plan` is the composition of one config per technique (``memfit.techniques``): each of
its fields is a plan key, the YAML sugar of a technique's config, parsed once when the plan is
made and validated against the other techniques. A plan file (YAML or JSON) holds any subset of
the keys; unknown keys and bad values are errors naming the key and the allowed values. Each key's
values are documented once, by its technique's :class:`~memfit.techniques.base.Key` (shown by
``memfit plan --help`` and in docs/plans.md). A value may also be given as the technique's config
object: ``Plan(checkpointing=BlocksAC(every=2))``.

The order of Plan's fields is the build order: ``build_step`` applies the techniques' configs in
it, the planner and the reports list them in it.

Micro-batching: with a global batch of B samples, ``micro_batch_size`` m splits it into B/m
micro-batches whose gradients are accumulated before one optimizer step; ``grad_accum_steps`` k
is the other way to say the same (m = B/k). Give one or the other, or both when they agree.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import UserError, parse_problem
from memfit.techniques import FOUND, KEYS
from memfit.techniques.base import Config, Key, Technique
from memfit.techniques.ema import EMA


def _key(name: str) -> Any:
    """A Plan field for plan key ``name``: its technique's default, and the Key in the metadata."""
    _, key = KEYS[name]
    return dataclasses.field(default=key.default, metadata={"key": key})


@dataclass(frozen=True)
class Plan:
    """How to train a workload: one config per technique, in build order (see :mod:`memfit.plans`)."""

    allocator: str = _key("allocator")                  # techniques/allocator.py: default | expandable
    base_weights: str = _key("base_weights")            # techniques/base_weights.py: as-is | nf4 | fp4 | int8
    adapter: str = _key("adapter")                      # techniques/adapter.py: none | lora:... | dora:...
    precision: str = _key("precision")                  # techniques/precision.py
    micro_batch_size: int | None = _key("micro_batch_size")  # techniques/accumulation.py
    grad_accum_steps: int = _key("grad_accum_steps")
    compile: str = _key("compile")                      # techniques/compile.py
    checkpointing: str = _key("checkpointing")          # techniques/checkpointing.py
    swap_blocks: int = _key("swap_blocks")              # techniques/swap_blocks.py
    optimizer: str = _key("optimizer")                  # techniques/optimizers.py (+ its variants)
    optimizer_in_backward: bool = _key("optimizer_in_backward")  # techniques/in_backward.py
    shard: str = _key("shard")                          # techniques/sharding.py (FSDP2)
    world_size: int = _key("world_size")
    reshard_after_forward: bool = _key("reshard_after_forward")
    shard_param_dtype: str = _key("shard_param_dtype")
    shard_reduce_dtype: str = _key("shard_reduce_dtype")
    shard_offload: bool = _key("shard_offload")
    offload: tuple[str, ...] = _key("offload")          # techniques/offload.py
    loss_chunks: int = _key("loss_chunks")              # techniques/chunked_loss.py
    attention: str = _key("attention")                  # techniques/attention.py
    ema: EMA | None = _key("ema")                       # techniques/ema.py
    max_grad_norm: float | None = _key("max_grad_norm")  # techniques/grad_clip.py
    bf16_update: str = _key("bf16_update")              # techniques/bf16_update.py
    _configs: dict[str, Config] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    # -- parsing, once ---------------------------------------------------------------------
    def __post_init__(self) -> None:
        _quantized_adapter(self)
        configs = {t.name: _parsed(t, {k.name: getattr(self, k.name) for k in t.keys}) for t in TECHNIQUES}
        for cfg in configs.values():
            # the canonical value (e.g. offload as a sorted tuple): the frozen-dataclass idiom for
            # normalising fields at construction; nothing changes a Plan after it is made
            for key, value in cfg.values().items():
                object.__setattr__(self, key, value)
        self._configs.update(configs)
        for cfg in configs.values():
            cfg.check(self)

    def config(self, technique: str) -> Config:
        """The config of one technique (by name: ``plan.config("checkpointing")``)."""
        return self._configs[technique]

    @property
    def techniques(self) -> tuple[Config, ...]:
        """One config per technique, in plan order (the order ``build_step`` applies them)."""
        return tuple(self._configs.values())

    def with_config(self, config: Config) -> Plan:
        """This plan with ``config`` in place of its technique's current one."""
        return Plan(**{**self._values(), **config.values()})

    def without(self, config: Config) -> Plan:
        """This plan with ``config`` in place of its technique's, and every other technique that
        then no longer applies (e.g. ``bf16_update`` without bf16-pure) back at its default."""
        values = {**self._values(), **config.values()}
        configs = {t.name: t.config({k.name: values[k.name] for k in t.keys}) for t in TECHNIQUES}
        probe = _Unchecked(values, configs)  # the plan's values to read while checking each config
        for name, cfg in configs.items():
            try:
                cfg.check(probe)
            except UserError:
                if name == config.technique.name:
                    raise
                values.update(BY_NAME[name].default.values())
        return Plan(**values)

    @property
    def numerics(self) -> tuple[str, ...]:
        """How this plan's updates differ from the workload's own step (bf16 weights, low-bit optimizer
        states, stochastic rounding, quantized base weights), one phrase per technique; empty: none."""
        return tuple(cfg.numerics for cfg in self.techniques if cfg.numerics)

    def check_implemented(self) -> None:
        """Refuse what this version cannot run yet (the schema has it so that plan files stay stable)."""
        for cfg in self.techniques:
            reason = cfg.unimplemented()
            if reason:
                raise UserError(reason)

    def micro_batches(self, batch_size: int) -> tuple[int, int]:
        """(micro_batch_size, number of micro-batches) of one rank's share of a global batch (all of it
        unless sharded); raises if it does not divide."""
        return self.config("accumulation").micro_batches(self.config("shard").rank_batch(batch_size))

    # -- (de)serialisation -----------------------------------------------------------------
    def _values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def to_dict(self) -> dict[str, Any]:
        return {name: _plain(value) for name, value in self._values().items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "plan") -> Plan:
        if not isinstance(data, dict):
            raise UserError(f"{source}: a plan must be a mapping of keys to values, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(str(k) for k in set(data) - names)  # (a YAML key can be null or a number)
        if unknown:
            raise UserError(f"{source}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(names))}")
        try:
            return cls(**data)
        except UserError as e:
            raise UserError(f"{source}: {str(e).removeprefix('plan: ')}") from None
        except TypeError as e:
            raise UserError(f"{source}: {e}") from None

    def replace(self, **changes: Any) -> Plan:
        return Plan.from_dict({**self._values(), **changes})

    def to_yaml(self) -> str:
        import yaml
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        if p.is_dir():
            raise UserError(f"plan file {str(p)!r} is a folder; give the path to a .yaml or .json plan")
        if not p.is_file():
            raise UserError(f"plan file {str(p)!r} not found; give the path to a .yaml or .json plan")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"plan file {str(p)!r} is not text (byte {e.start} is not UTF-8); give a .yaml or "
                            ".json plan") from None
        except OSError as e:
            raise UserError(f"cannot read plan file {str(p)!r} ({e.strerror}); check its permissions") from None
        try:
            if p.suffix == ".json":
                data = json.loads(text)
            else:
                import yaml
                data = yaml.safe_load(text)
        except Exception as e:  # noqa: BLE001 - any parse error is the user's file
            raise UserError(f"plan file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                            f"{parse_problem(e)}") from None
        return cls.from_dict(data or {}, source=f"plan file {p.name}")

    def save(self, path: str | Path) -> None:
        from memfit.secrets import redact
        p = Path(path)
        try:
            p.write_text(redact(json.dumps(self.to_dict(), indent=2) + "\n" if p.suffix == ".json" else self.to_yaml()))
        except OSError as e:
            raise UserError(f"cannot write the plan to {str(p)!r} ({e.strerror}); choose a writable path") from None

    # -- text ------------------------------------------------------------------------------
    def short(self, batch_size: int | None = None) -> str:
        """Compact label, e.g. 'bf16 mb2 ckpt=blocks adamw8bit inbw chunks=8'."""
        return " ".join(label for cfg in self.techniques if (label := cfg.label(batch_size)))

    def changed(self) -> dict[str, Any]:
        """The fields whose values differ from a default plan's (the workload's own step)."""
        default = Plan()
        return {name: value for name, value in self._values().items() if value != getattr(default, name)}

    def describe(self) -> str:
        """Short text of the non-default fields, e.g. 'precision=bf16, micro_batch_size=2'."""
        parts = [f"{name}={_show(value)}" for name, value in self.changed().items()]
        return ", ".join(parts) or "defaults (fp32, whole batch)"


def _parsed(technique: Technique, values: dict[str, Any]) -> Config:
    """``technique``'s config of ``values``; a value it refuses that another tool's name stands in ends its error
    with the value meant (memfit.synonyms)."""
    try:
        return technique.config(values)
    except UserError as e:
        from memfit.synonyms import meant
        if not meant(values):
            raise
        raise UserError(f"{e}{meant(values)}") from None


# NOTE [ qlora as an adapter ]
# People ask for QLoRA by name: ``--adapter qlora``, ``adapter: qlora:r=64``. It is two keys here, a LoRA (or DoRA)
# adapter over 4-bit base weights, as ``--methods qlora`` plans it: ``qlora:OPTIONS`` is ``lora:OPTIONS`` with
# ``base_weights: nf4`` (the QLoRA paper's format; ``nf4:double_quant=true`` or ``fp4`` given beside it are kept),
# and ``qdora`` the same over DoRA. Other base weights beside it contradict it: one line.
def _quantized_adapter(plan: Plan) -> None:
    """``adapter: qlora:...``/``qdora:...`` as the adapter and base weights it means (the note above)."""
    text = plan.adapter
    if not isinstance(text, str) or text.partition(":")[0] not in ("qlora", "qdora"):
        return
    adapter = text[1:]
    base = plan.base_weights
    if base is None or base == "as-is":
        base = "nf4"
    elif not (isinstance(base, str) and base.partition(":")[0] in ("nf4", "fp4")):
        raise UserError(f"plan: adapter {text} is a LoRA over 4-bit base weights, and base_weights is {_show(base)}; "
                        f"write adapter: {adapter} to keep base_weights {_show(base)}, or leave base_weights out")
    object.__setattr__(plan, "adapter", adapter)
    object.__setattr__(plan, "base_weights", base)


def _plain(value: Any) -> Any:
    """A plan value as YAML/JSON data."""
    if isinstance(value, tuple):
        return list(value)
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return value


def _show(v: Any) -> str:
    if isinstance(v, tuple):
        return "[" + ",".join(v) + "]"
    return str(v)


class _Unchecked:
    """Plan values and configs not yet checked against each other: what ``Config.check`` reads."""

    def __init__(self, values: dict[str, Any], configs: dict[str, Config]) -> None:
        self.__dict__.update(values)
        self._configs = configs

    def config(self, technique: str) -> Config:
        return self._configs[technique]

    @property
    def techniques(self) -> tuple[Config, ...]:
        return tuple(self._configs.values())


def _in_plan_order() -> tuple[Technique, ...]:
    """The techniques in the order of Plan's fields; every technique's keys are fields, together."""
    fields = [f.name for f in dataclasses.fields(Plan) if f.init]
    missing = sorted(set(KEYS) - set(fields))
    assert not missing, f"plan keys {missing} are not fields of Plan: add them in memfit/plans.py"
    ordered: list[Technique] = []
    for name in fields:
        technique, _ = KEYS[name]
        if technique not in ordered:
            ordered.append(technique)
    for t in ordered:
        at = fields.index(t.keys[0].name)
        assert fields[at:at + len(t.keys)] == [k.name for k in t.keys], f"{t.name}'s keys must be adjacent fields"
    return tuple(ordered)


TECHNIQUES: tuple[Technique, ...] = _in_plan_order()
"""Every technique, in plan (build) order."""
BY_NAME: dict[str, Technique] = dict(FOUND)
"""Technique name -> technique."""


def keys() -> tuple[Key, ...]:
    """Every plan key, in plan order."""
    return tuple(k for t in TECHNIQUES for k in t.keys)


def with_what_it_needs(name: str, value: Any, others, base: Plan | None = None) -> tuple[Plan, dict] | None:
    """``base`` (None: the default plan) with ``name=value``, or, when that is no plan, with the first
    other field of ``others`` (``(key, value)`` pairs) that lets it be one (``budget:0.5`` needs a
    compile mode); and the other field added (``{}`` for none). None: no such field."""
    make = Plan if base is None else base.replace
    try:
        return make(**{name: value}), {}
    except UserError:
        pass
    for other, v in others:
        if other != name:
            try:
                return make(**{name: value, other: v}), {other: v}
            except UserError:
                continue
    return None


def technique_of(key: str) -> Technique:
    """The technique that owns plan key ``key``."""
    return KEYS[key][0]
