"""Plan: *how* to train a workload. Plain, frozen, serialisable data; never holds live objects.

A plan file (YAML or JSON) holds any subset of these keys; unknown keys and bad values are
errors naming the key and the allowed values::

    precision: fp32          # fp32 | bf16 | fp16 | bf16-pure | auto
    micro_batch_size: null   # null = whole batch
    grad_accum_steps: 1
    checkpointing: none      # none | blocks | blocks:every=N | selective | budget:FRACTION
    optimizer: adamw         # adamw | adamw8bit | adafactor | sgd
    optimizer_in_backward: false
    offload: []              # any of: optimizer_states, activations
    ema: null                # e.g. {decay: 0.999, device: cpu, every: 1}
    loss_chunks: 0           # chunked cross-entropy when > 0
    attention: auto          # auto | sdpa | math | chunked
    compile: none            # none | blocks | full

Micro-batching: with a global batch of B samples, ``micro_batch_size`` m splits it into B/m
micro-batches whose gradients are accumulated before one optimizer step; ``grad_accum_steps`` k
is the other way to say the same (m = B/k). Give one or the other, or both when they agree.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.errors import UserError

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure", "auto")
OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "sgd")
OFFLOADS = ("optimizer_states", "activations")
ATTENTIONS = ("auto", "sdpa", "math", "chunked")
COMPILES = ("none", "blocks", "full")
BF16_UPDATES = ("nearest", "stochastic", "kahan")
MAX_CHUNKS = 2**31 - 1
_CKPT_RE = re.compile(r"^(none|blocks|blocks:every=(\d+)|selective|budget:([0-9]*\.?[0-9]+))$")

# Plan fields that this version implements in the TrainStep. The others are part of the
# schema (so plan files stay stable) and are refused with a clear message until implemented.
IMPLEMENTED = {"precision", "micro_batch_size", "grad_accum_steps", "checkpointing", "optimizer",
               "optimizer_in_backward", "offload", "ema", "loss_chunks", "attention", "bf16_update"}


@dataclass(frozen=True)
class EMAConfig:
    decay: float = 0.999
    """Shadow weight decay per update."""
    device: str = "cpu"
    """Where the shadow weights live: cpu or the training device."""
    every: int = 1
    """Update the shadow weights every N optimizer steps."""


@dataclass(frozen=True)
class Plan:
    precision: str = "fp32"
    """fp32 | bf16 | fp16 | bf16-pure | auto (bf16 where supported, else fp16, else fp32)."""
    micro_batch_size: int | None = None
    """Samples per forward/backward; None means the whole batch at once."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step."""
    checkpointing: str = "none"
    """Activation checkpointing: none | blocks | blocks:every=N | selective | budget:FRACTION."""
    optimizer: str = "adamw"
    """adamw | adamw8bit | adafactor | sgd."""
    optimizer_in_backward: bool = False
    """Step and free each parameter's gradient as soon as it is accumulated."""
    offload: tuple[str, ...] = ()
    """Move to host memory: optimizer_states, activations."""
    ema: EMAConfig | None = None
    """Exponential moving average of the weights."""
    loss_chunks: int = 0
    """Compute the language-model cross-entropy in this many chunks (0 = off)."""
    attention: str = "auto"
    """auto | sdpa | math | chunked."""
    compile: str = "none"
    """none | blocks | full."""
    bf16_update: str = "nearest"
    """With bf16-pure: how the update is rounded into bf16 weights: nearest | stochastic | kahan."""

    def __post_init__(self) -> None:
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("attention", self.attention, ATTENTIONS)
        _check_choice("compile", self.compile, COMPILES)
        _check_choice("bf16_update", self.bf16_update, BF16_UPDATES)
        if not _CKPT_RE.match(str(self.checkpointing)):
            raise UserError(
                f"plan: checkpointing {self.checkpointing!r} is not valid; "
                "use none, blocks, blocks:every=N, selective or budget:FRACTION (e.g. budget:0.5)")
        if self.checkpointing.startswith("budget:") and not 0 <= float(self.checkpointing[7:]) <= 1:
            raise UserError(f"plan: checkpointing {self.checkpointing!r}: the budget fraction must be in [0, 1]")
        if self.checkpointing.startswith("blocks:every=") and int(self.checkpointing[13:]) < 1:
            raise UserError("plan: checkpointing blocks:every=N needs N >= 1")
        for name in ("grad_accum_steps",):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"plan: {name} must be a whole number >= 1, got {v!r}")
        if self.micro_batch_size is not None and (
                not isinstance(self.micro_batch_size, int) or isinstance(self.micro_batch_size, bool)
                or self.micro_batch_size < 1):
            raise UserError(f"plan: micro_batch_size must be null or a whole number >= 1, got {self.micro_batch_size!r}")
        if not isinstance(self.loss_chunks, int) or isinstance(self.loss_chunks, bool) \
                or not 0 <= self.loss_chunks <= MAX_CHUNKS:
            raise UserError(f"plan: loss_chunks must be a whole number from 0 to {MAX_CHUNKS}, got {self.loss_chunks!r}")
        if not isinstance(self.optimizer_in_backward, bool):
            raise UserError(f"plan: optimizer_in_backward must be true or false, got {self.optimizer_in_backward!r}")
        offload = self.offload
        if isinstance(offload, str):
            offload = (offload,) if offload else ()
        if not isinstance(offload, (list, tuple)):
            raise UserError(f"plan: offload must be a list of {', '.join(OFFLOADS)}; got {offload!r}")
        for item in offload:
            _check_choice("offload", item, OFFLOADS)
        object.__setattr__(self, "offload", tuple(sorted(set(offload))))
        if isinstance(self.ema, dict):
            object.__setattr__(self, "ema", _ema_from_dict(self.ema))
        elif self.ema is not None and not isinstance(self.ema, EMAConfig):
            raise UserError(f"plan: ema must be null or a mapping like {{decay: 0.999, device: cpu, every: 1}}, got {self.ema!r}")
        self._check_combinations()

    # -- validation of combinations -------------------------------------------------------
    def _check_combinations(self) -> None:
        if self.optimizer_in_backward and self.grad_accum_steps > 1:
            raise UserError("plan: optimizer_in_backward steps each gradient as soon as it is ready, so it "
                            "cannot accumulate micro-batches; set grad_accum_steps: 1 or optimizer_in_backward: false")
        if self.optimizer_in_backward and self.micro_batch_size is not None:
            raise UserError("plan: optimizer_in_backward cannot accumulate micro-batches; remove micro_batch_size")
        if self.optimizer_in_backward and "optimizer_states" in self.offload:
            raise UserError("plan: optimizer_in_backward and offload: [optimizer_states] cannot be combined in this "
                            "version; choose one")
        if self.bf16_update != "nearest" and self.precision != "bf16-pure":
            raise UserError(f"plan: bf16_update: {self.bf16_update} applies to precision: bf16-pure only")
        if self.bf16_update != "nearest" and self.optimizer not in ("adamw", "sgd"):
            raise UserError(f"plan: bf16_update: {self.bf16_update} is implemented for adamw and sgd; "
                            f"use bf16_update: nearest with {self.optimizer}")
        if self.optimizer_in_backward and self.precision == "fp16":
            raise UserError("plan: optimizer_in_backward cannot unscale fp16 gradients with a GradScaler "
                            "(inf checks need all gradients); use bf16 or set optimizer_in_backward: false")

    def micro_batches(self, batch_size: int) -> tuple[int, int]:
        """(micro_batch_size, number of micro-batches) for a global batch; raises if it does not divide."""
        if batch_size < 1:
            raise UserError(f"batch size must be >= 1, got {batch_size}")
        k, m = self.grad_accum_steps, self.micro_batch_size
        if m is None:
            if batch_size % k:
                raise UserError(f"batch size {batch_size} is not divisible into grad_accum_steps={k} micro-batches; "
                                f"pick a batch size that is a multiple of {k}")
            return batch_size // k, k
        if batch_size % m:
            raise UserError(f"batch size {batch_size} is not a multiple of micro_batch_size={m}; "
                            f"use a batch size that is a multiple of {m} or another micro_batch_size")
        n = batch_size // m
        if k != 1 and k != n:
            raise UserError(f"micro_batch_size={m} gives {n} micro-batches for batch size {batch_size} but "
                            f"grad_accum_steps={k}; give only one of them")
        return m, n

    def check_implemented(self) -> None:
        if self.checkpointing.startswith("budget:"):
            raise UserError(f"plan: checkpointing={self.checkpointing} (torch.compile's activation memory budget) is "
                            "not implemented in this memfit version yet; use blocks, blocks:every=N or selective")
        default = Plan()
        for f in dataclasses.fields(self):
            if f.name in IMPLEMENTED:
                continue
            if getattr(self, f.name) != getattr(default, f.name):
                raise UserError(f"plan: {f.name}={_show(getattr(self, f.name))} is not implemented in this memfit "
                                f"version yet; remove it from the plan (implemented: {', '.join(sorted(IMPLEMENTED))})")

    # -- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["offload"] = list(self.offload)
        d["ema"] = dataclasses.asdict(self.ema) if self.ema else None
        return d

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
        return Plan.from_dict({**self.to_dict(), **changes})

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

    def short(self, batch_size: int | None = None) -> str:
        """Compact label, e.g. 'bf16 mb2 ckpt=blocks adamw8bit inbw chunks=8'."""
        parts = [self.precision]
        if self.micro_batch_size or self.grad_accum_steps > 1:
            parts.append(f"mb{self.micro_batches(batch_size)[0] if batch_size else self.micro_batch_size}")
        if self.checkpointing != "none":
            parts.append(f"ckpt={self.checkpointing.replace('blocks:every=', 'every')}")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.optimizer_in_backward:
            parts.append("inbw")
        parts += [f"off={o.split('_')[0]}" for o in self.offload]
        if self.loss_chunks:
            parts.append(f"chunks={self.loss_chunks}")
        if self.attention != "auto":
            parts.append(f"attn={self.attention}")
        if self.ema:
            parts.append("ema")
        return " ".join(parts)

    def describe(self) -> str:
        """Short text of the non-default fields, e.g. 'precision=bf16, micro_batch_size=2'."""
        default = Plan()
        parts = [f"{f.name}={_show(getattr(self, f.name))}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != getattr(default, f.name)]
        return ", ".join(parts) or "defaults (fp32, whole batch)"


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"plan: {name} {value!r} is not valid; choose one of {', '.join(allowed)}")


def _ema_from_dict(d: dict) -> EMAConfig:
    allowed = {f.name for f in dataclasses.fields(EMAConfig)}
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise UserError(f"plan: ema has unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(allowed))}")
    cfg = EMAConfig(**d)
    decay_ok = isinstance(cfg.decay, (int, float)) and not isinstance(cfg.decay, bool) and 0 < cfg.decay < 1
    every_ok = isinstance(cfg.every, int) and not isinstance(cfg.every, bool) and cfg.every >= 1
    if not decay_ok or not every_ok or cfg.device not in ("cpu", "device"):
        raise UserError(f"plan: ema needs 0 < decay < 1, a whole number every >= 1 and device cpu or device; "
                        f"got decay={cfg.decay!r}, every={cfg.every!r}, device={cfg.device!r}")
    return dataclasses.replace(cfg, decay=float(cfg.decay))


def _show(v: Any) -> str:
    if isinstance(v, tuple):
        return "[" + ",".join(v) + "]"
    return str(v)
