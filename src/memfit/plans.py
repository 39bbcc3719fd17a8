"""Plan: *how* to train a workload. Plain, frozen, serialisable data; never holds live objects.

A plan is the composition of one config per technique (``memfit.techniques``): each key of a
plan file is the YAML sugar of a technique's config, parsed once when the plan is made, and
validated against the other techniques. A plan file (YAML or JSON) holds any subset of the keys;
unknown keys and bad values are errors naming the key and the allowed values::

    precision: fp32          # fp32 | bf16 | fp16 | bf16-pure | auto
    micro_batch_size: null   # null = whole batch
    grad_accum_steps: 1
    checkpointing: none      # none | blocks | blocks:every=N | selective | budget:FRACTION
    optimizer: adamw         # adamw | adamw8bit | adafactor | sgd
    optimizer_in_backward: false
    offload: []              # any of: optimizer_states (or optimizer_states:step=device), activations
    loss_chunks: 0           # chunked cross-entropy when > 0
    attention: auto          # auto | sdpa | math | chunked
    ema: null                # e.g. {decay: 0.999, device: auto, every: 1}
    compile: none            # none | blocks | full
    bf16_update: nearest     # nearest | stochastic | kahan (with bf16-pure)
    world_size: 1            # ranks; > 1 shards with FSDP2 (shard: auto | none | fsdp)
    reshard_after_forward: true    # FSDP2 options: also shard_param_dtype, shard_reduce_dtype,
    shard_offload: false           # (none | bf16 | fp16 | fp32)

The keys are the techniques' own (``Technique.keys``): a new technique module adds its keys to
:class:`Plan`, to plan files and to the command line (``--key``) by itself. A value may also be
given as the technique's config object: ``Plan(checkpointing=BlocksAC(every=2))``.

Micro-batching: with a global batch of B samples, ``micro_batch_size`` m splits it into B/m
micro-batches whose gradients are accumulated before one optimizer step; ``grad_accum_steps`` k
is the other way to say the same (m = B/k). Give one or the other, or both when they agree.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from memfit.errors import UserError
from memfit.techniques import BY_NAME, TECHNIQUES
from memfit.techniques.base import Config, Key, Technique


class _PlanMethods:
    """What every Plan does; the fields come from the techniques (see :data:`Plan`)."""

    # -- parsing, once ---------------------------------------------------------------------
    def __post_init__(self) -> None:
        configs = {t.name: t.config({k.name: getattr(self, k.name) for k in t.keys}) for t in TECHNIQUES}
        for cfg in configs.values():
            for key, value in cfg.values().items():  # the canonical value (e.g. offload as a sorted tuple)
                object.__setattr__(self, key, value)
        object.__setattr__(self, "_configs", configs)
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
        probe = dataclasses.replace(self)  # a valid plan to read the other keys from while checking
        object.__setattr__(probe, "_configs", configs)
        for key, value in values.items():
            object.__setattr__(probe, key, value)
        for name, cfg in configs.items():
            try:
                cfg.check(probe)
            except UserError:
                if name == config.technique.name:
                    raise
                values.update(BY_NAME[name].default.values())
        return Plan(**values)

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
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_dict(self) -> dict[str, Any]:
        return {name: _plain(value) for name, value in self._values().items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "plan") -> Plan:
        if not isinstance(data, dict):
            raise UserError(f"{source}: a plan must be a mapping of keys to values, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
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
                            f"{str(e).splitlines()[0]}") from None
        return cls.from_dict(data or {}, source=f"plan file {p.name}")

    def save(self, path: str | Path) -> None:
        p = Path(path)
        try:
            p.write_text(json.dumps(self.to_dict(), indent=2) + "\n" if p.suffix == ".json" else self.to_yaml())
        except OSError as e:
            raise UserError(f"cannot write the plan to {str(p)!r} ({e.strerror}); choose a writable path") from None

    # -- text ------------------------------------------------------------------------------
    def short(self, batch_size: int | None = None) -> str:
        """Compact label, e.g. 'bf16 mb2 ckpt=blocks adamw8bit inbw chunks=8'."""
        return " ".join(label for cfg in self.techniques if (label := cfg.label(batch_size)))

    def describe(self) -> str:
        """Short text of the non-default fields, e.g. 'precision=bf16, micro_batch_size=2'."""
        default = Plan()
        parts = [f"{f.name}={_show(getattr(self, f.name))}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != getattr(default, f.name)]
        return ", ".join(parts) or "defaults (fp32, whole batch)"


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


def keys() -> tuple[Key, ...]:
    """Every plan key, in plan order."""
    return tuple(k for t in TECHNIQUES for k in t.keys)


def technique_of(key: str) -> Technique:
    """The technique that owns plan key ``key``."""
    return next(t for t in TECHNIQUES if any(k.name == key for k in t.keys))


Plan = dataclasses.make_dataclass(
    "Plan", [(k.name, k.annotation, dataclasses.field(default=k.default, metadata={"key": k})) for k in keys()],
    bases=(_PlanMethods,), frozen=True)
Plan.__module__ = __name__
Plan.__doc__ = ("How to train a workload: one config per technique, from plan keys "
                f"({', '.join(k.name for k in keys())}). See memfit.plans.")
