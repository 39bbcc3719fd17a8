"""EMA: an exponential moving average of the weights, kept where memory is cheap.

The shadow copy costs one fp32 copy of the trained parameters (N bytes): a LoRA's adapter alone, as
ai-toolkit's and diffusers' EMA keep it (a frozen weight is its own average; copying FLUX.1's 12B frozen
weights in fp32 would take 44 GiB). Kept on the device it competes
with training memory; kept on the host (``device: cpu``) it costs device memory nothing and a
device->host copy of the weights every ``every`` steps. The update is
``shadow = decay * shadow + (1 - decay) * weights``.

``device: auto`` (the default) is the fastest place that meets the memory the plan asks for: the
planner tries both and keeps the device unless that does not fit the budget; without a planner (no
budget) it is the device. The shadow stays fp32: with a decay near 1 each update moves it by about
(1 - decay) of the difference, below bf16's resolution (1/256), so a bf16 shadow would stop moving.

Off the step's critical path (``device: cpu``): at each update the weights are copied into pinned
host buffers (allocated once) on a side stream, and a worker thread waits for that copy and lerps
them into the shadow while the next step runs. The step only enqueues the copies; it waits for
the previous average only before overwriting the buffers it reads (the next update) and before
the shadow is read (a checkpoint). The price: a second host copy of the weights (the buffers).
On a CPU the copy is a plain one (there are no streams), and the thread and ordering are the same
code, tested against the synchronous update bit for bit.

With FSDP2 sharding each rank keeps the average of its own shards (1/N of the copy): the update
is elementwise, so averaging the shards is averaging the weights.

Plan key ``ema``: null (:class:`NoEMA`) or a mapping (:class:`EMA`), e.g.
``{decay: 0.999, device: auto, every: 1}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass

import torch
import yaml

from memfit.errors import UserError
from memfit.techniques.base import Config, Export, Key, Technique, register
from memfit.techniques.placement import HostPlacement, doing
from memfit.units import parse_key_values


class WeightAverage(Config):
    """The plan key ``ema``: a moving average of the weights, or none."""


@dataclass(frozen=True)
class NoEMA(WeightAverage):
    """No moving average."""

    def values(self) -> dict:
        return {"ema": None}


@dataclass(frozen=True)
class EMA(WeightAverage):
    """Shadow weights updated every ``every`` optimizer steps."""

    decay: float = 0.999
    """Shadow weight decay per update."""
    device: str = "auto"
    """Where the shadow weights live: cpu, the training device, or auto (the planner's choice;
    the device without one)."""
    every: int = 1
    """Update the shadow weights every N optimizer steps."""

    def __post_init__(self) -> None:
        decay_ok = isinstance(self.decay, (int, float)) and not isinstance(self.decay, bool) and 0 < self.decay < 1
        every_ok = isinstance(self.every, int) and not isinstance(self.every, bool) and self.every >= 1
        if not decay_ok or not every_ok or self.device not in ("auto", "cpu", "device"):
            raise UserError(f"plan: ema needs 0 < decay < 1, a whole number every >= 1 and device auto, cpu or device; "
                            f"got decay={self.decay!r}, every={self.every!r}, device={self.device!r}")
        object.__setattr__(self, "decay", float(self.decay))

    def values(self) -> dict:
        return {"ema": self}

    @property
    def placed(self) -> str:
        """Where the shadow lives: cpu or device (auto without a planner: the device, the fastest)."""
        return "device" if self.device == "auto" else self.device

    def choices(self, device) -> list[EMA]:
        if self.device != "auto":
            return [self]
        on_device = dataclasses.replace(self, device="device")
        return [on_device, dataclasses.replace(self, device="cpu")] if device.is_gpu else [on_device]

    def saves_at_most(self, other, batch_size: int) -> bool:
        return isinstance(other, EMA) and (self.placed == "device" or other.placed == "cpu")

    def apply(self, parts) -> None:
        parts.ema = ShadowWeights(parts.model, self, parts.placement)
        parts.after_update.append(parts.ema.update)

    def label(self, batch_size):
        return "ema"

    def ablations(self):
        if self.placed == "device":
            return []
        return [("EMA on cpu", dataclasses.replace(self, device="device"))]

    def export(self, into: Export) -> None:
        ours = self.placed == "device" and self.every == 1  # (ai-toolkit's EMA: on the device, every step)
        into.not_carried(self, ai_toolkit=not ours)
        if ours:
            into.ai_toolkit["train.ema_config"] = {"use_ema": True, "ema_decay": self.decay}


class ShadowWeights:
    """The EMA's shadow copy of the parameters and its update (a checkpointed state)."""

    def __init__(self, model: torch.nn.Module, config: EMA, placement: HostPlacement):
        self.model, self.config, self.placement = model, config, placement
        self.updates = 0
        self.shadow: dict[str, torch.Tensor] = {}
        self.background = _Background(placement) if config.placed == "cpu" else None
        """The host copies and the averaging thread (``device: cpu``)."""

    def _averaged(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters the shadow averages: those that train (see the module docstring)."""
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]

    def _init_shadow(self) -> None:
        for name, p in self._averaged():
            local = _local(p)
            if self.config.placed == "cpu":
                self.shadow[name] = self.placement.to_host(local.float())
                if self.background is not None:  # its pinned buffers, made with the shadow: the steady state
                    self.background.buffers[name] = self.placement.to_host(local)
            else:
                self.shadow[name] = local.float().clone()

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        if not self.shadow:
            self._init_shadow()
            return
        if self.updates % self.config.every:
            return
        weights = {name: _local(p) for name, p in self._averaged()}
        if self.background is not None:  # (a fake trace allocates the same, and averages at once)
            self.background.average(weights, self.shadow, 1.0 - self.config.decay, at_once=_fake(weights))
            return
        for name, src in weights.items():
            s = self.shadow[name]
            if src.device != s.device:
                src = src.to(s.device, non_blocking=False)
            s.lerp_(src.to(s.dtype), 1.0 - self.config.decay)

    def wait(self) -> None:
        """Until the shadow holds every update made so far."""
        if self.background is not None:
            self.background.wait()

    def state_dict(self) -> dict:
        """The shadow (each rank's shards when sharded) and the number of updates."""
        self.wait()
        return {"updates": self.updates, "shadow": self.shadow}

    def sharded_state_dict(self) -> dict:
        """:meth:`state_dict` with each shard as a DTensor of its parameter's layout (what
        Distributed Checkpoint saves, and reshards when a run resumes at another world size);
        before the first update, shadows of zeros to load into."""
        from torch.distributed.tensor import DTensor
        self.wait()
        shadow = self.shadow or {name: torch.zeros_like(_local(p), dtype=torch.float32) for name, p in self._averaged()}
        params = dict(self.model.named_parameters())
        return {"updates": self.updates, "shadow": {
            name: DTensor.from_local(t, params[name].device_mesh, params[name].placements, run_check=False,
                                     shape=params[name].shape, stride=params[name].stride())
            if isinstance(params[name], DTensor) else t for name, t in shadow.items()}}

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict) -> None:
        """Load what :meth:`sharded_state_dict` gave, filled by Distributed Checkpoint."""
        from torch.distributed.tensor import DTensor
        self.load_state_dict({"updates": state["updates"], "shadow": {
            name: t.to_local() if isinstance(t, DTensor) else t for name, t in state["shadow"].items()}
            if state["updates"] else {}})

    @torch.no_grad()
    def load_whole_state_dict(self, state: dict) -> None:
        """Load a one-process EMA (whole tensors) into sharded parameters' shadows: each rank keeps
        its shards (``distribute_tensor`` with the parameter's layout)."""
        from torch.distributed.tensor import DTensor, distribute_tensor
        params = dict(self.model.named_parameters())
        shadow = {}
        for name, t in state["shadow"].items():
            p = params.get(name)
            if p is None or not p.requires_grad:  # (an older checkpoint's shadow of a frozen weight: the weight)
                continue
            shadow[name] = distribute_tensor(t.to(p.device), p.device_mesh, p.placements).to_local() if isinstance(
                p, DTensor) else t
        self.load_state_dict({"updates": state["updates"], "shadow": shadow})

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copy a saved shadow into this EMA's own buffers, so it stays where the plan puts it
        (checkpoints are loaded on the CPU)."""
        self.wait()
        self.updates = state["updates"]
        self.shadow = {}
        if state["shadow"]:
            self._init_shadow()
            for name, saved in state["shadow"].items():
                if name in self.shadow:  # (an older checkpoint's shadow of a frozen weight: the weight itself)
                    self.shadow[name].copy_(saved)
            fresh = [name for name in self.shadow if name not in state["shadow"]]
            if fresh:  # (the run that saved it trained fewer parameters: an adapter added, a layer unfrozen)
                warnings.warn(f"EMA: the checkpoint holds no average of {len(fresh)} trained parameter(s) "
                              f"({fresh[0]}{', ...' if len(fresh) > 1 else ''}); their averages start from the "
                              "current weights", stacklevel=2)


class _Background:
    """Weights copied to pinned host buffers on a side stream, averaged into the shadow by one
    worker thread once the copy is done (see the module's docstring)."""

    def __init__(self, placement: HostPlacement):
        self.placement = placement
        self.buffers: dict[str, torch.Tensor] = {}
        self.pending = None
        self.stream = None
        self.pool = None

    def average(self, weights: dict[str, torch.Tensor], shadow: dict[str, torch.Tensor], weight: float,
                at_once: bool = False) -> None:
        self.wait()  # the previous average has read the buffers this copy overwrites
        with doing("background"):
            copied = self._copy(weights)
            if at_once:
                self._lerp(copied, shadow, weight)
                return
        if self.pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-ema")
        self.pending = self.pool.submit(self._lerp, copied, shadow, weight)

    def _copy(self, weights: dict[str, torch.Tensor]):
        """Enqueue the copies; returns what the thread waits on before reading the buffers (an
        event on CUDA, None where the copy is done when this returns)."""
        cuda = next(iter(weights.values())).is_cuda
        if cuda and self.stream is None:
            self.stream = torch.cuda.Stream()
        if cuda:
            self.stream.wait_stream(torch.cuda.current_stream())  # the optimizer step wrote the weights
        with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
            for name, w in weights.items():
                if name not in self.buffers:
                    self.buffers[name] = self.placement.to_host(w)  # (pinned, once)
                else:
                    self.buffers[name].copy_(w, non_blocking=True)
            if not cuda:
                return None
            done = torch.cuda.Event()
            done.record(self.stream)
        for w in weights.values():  # the weights may change only after the copy has read them
            w.record_stream(self.stream)
        return done

    @torch.no_grad()
    def _lerp(self, copied, shadow, weight) -> None:
        if copied is not None:
            copied.synchronize()
        for name, s in shadow.items():
            s.lerp_(self.buffers[name].to(s.dtype), weight)

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()  # (an error in the thread is raised here)


def _fake(weights: dict[str, torch.Tensor]) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return any(is_fake(w) for w in weights.values())


def _local(p: torch.Tensor) -> torch.Tensor:
    """The parameter's own values on this rank: its shard when sharded (a DTensor)."""
    from torch.distributed.tensor import DTensor
    return p.to_local().detach() if isinstance(p, DTensor) else p.detach()


def _text(value: str):
    """--ema decay=0.999,device=cpu,every=1 | --ema '{decay: 0.999, device: cpu}' | --ema null."""
    if value in ("null", "none", ""):
        return None
    if "=" in value:
        return parse_key_values(value, "--ema", example="--ema decay=0.999,device=cpu")
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"--ema {value!r} is not a valid mapping ({problem}); write e.g. "
                        "--ema decay=0.999,device=cpu or --ema '{decay: 0.999, device: cpu}'") from None


def parse(values: dict) -> WeightAverage:
    value = values["ema"]
    if value is None:
        return NoEMA()
    if isinstance(value, EMA):
        return value
    if not isinstance(value, dict):
        raise UserError(f"plan: ema must be null or a mapping like {{decay: 0.999, device: cpu, every: 1}}, "
                        f"got {value!r}")
    allowed = {f.name for f in dataclasses.fields(EMA)}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise UserError(f"plan: ema has unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(allowed))}")
    return EMA(**value)


TECHNIQUE = register(
    Technique("ema", (Key("ema", None, "Exponential moving average of the weights.", annotation="EMA | None",
                          from_text=_text, metavar="EMA"),),
              parse),
    WeightAverage, NoEMA, EMA)
