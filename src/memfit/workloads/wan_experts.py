"""Wan 2.2 A14B's two experts in one step, as ai-toolkit trains them (``dit-wan:experts=2``).

Wan 2.2's A14B models (T2V and I2V) denoise with two transformers of Wan 2.1 14B's shape: a high-noise
expert for the first eighth of the timesteps, a low-noise one for the rest. musubi-tuner trains one expert
a run (memfit's ``dit-wan``). ai-toolkit (``arch: wan22_14b``, ``wan22_14b_i2v``) loads both, puts a LoRA on
each (its ``DualWanTransformer3DModel``) and trains them in turns: each batch runs the expert its timesteps
fall in, and the trainer switches which boundary it samples every ``switch_boundary_every`` batches.

Where memory goes. Both experts' weights, both LoRAs, and, once each has trained, both LoRAs' optimizer
states stay; the activations and gradients are one expert's, or both experts' LoRA gradients where a
switch falls between two micro-batches of one step (ai-toolkit switches between batches, accumulated or
not). The two steps memfit traces switch between them, so the second holds the first's states as a long
run does: ``switch=batch`` switches at every batch (ai-toolkit's default, ``switch_boundary_every: 1``),
``switch=step`` only where a step begins (a count of batches that is a multiple of the accumulation),
``switch=none`` trains the first expert alone (``train_low_noise: false``; the other, LoRA and all, is
carried and never runs).

``low_vram=true`` is ai-toolkit's ``low_vram`` for these models: the expert not running waits in host
memory, its frozen weights moved out (``.to("cpu")``) before the other's are moved in, and the caching
allocator emptied; the LoRAs stay on the device. That saves one expert's weights on the card for a copy
of them over the host link at every switch: why ai-toolkit's example switches every 10 batches there.
"""

from __future__ import annotations

import torch

from memfit.errors import UserError
from memfit.techniques.timeline_marks import mark

SWITCHES = ("batch", "step", "none")


class TwoExperts(torch.nn.Module):
    """Two experts of one shape: each forward runs the active one (see the module's docstring)."""

    def __init__(self, make, switch: str = "batch", low_vram: bool = False) -> None:
        super().__init__()
        self.transformer_1, self.transformer_2 = make(), make()
        self.config = self.transformer_1.config
        self.switch, self.low_vram = switch, low_vram
        self.active = 0
        self._ran = False
        self._placement = None
        self._device: torch.device | None = None
        self._marked = False
        self._host: set[int] = set()
        """``id`` of the parameters in host memory now."""

    @property
    def experts(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        return self.transformer_1, self.transformer_2

    # -- ai-toolkit's low_vram: the idle expert's frozen weights in host memory --------------------------
    def memfit_on_load(self, load) -> None:
        """Loading (memfit.step's ``_load``): the idle expert's weights arrive in host memory, as ai-toolkit's
        low_vram leaves both experts there until the first batch moves one in."""
        if self.low_vram:
            load.on_host.update(id(p) for p in self.experts[1 - self.active].parameters())

    def memfit_bind(self, placement, device: torch.device, loaded: bool) -> None:
        """The step is built (memfit.step.build_step): the moves go through its host placement, which tells
        the step's observer what is host memory. ``loaded``: the weights came as a checkpoint's, the idle
        expert's in host memory already (:meth:`memfit_on_load`). Its adapters (trainable) join the device."""
        self._placement, self._device = placement, device
        if not self.low_vram:
            return
        idle = self.experts[1 - self.active]
        if all(p.requires_grad for p in idle.parameters()):
            raise UserError("dit-wan: low_vram=true moves the idle expert's frozen weights to the host, and every "
                            "weight trains; train an adapter (adapter: lora:r=16) or use low_vram=false")
        for p in idle.parameters():
            if p.requires_grad:
                if p.device != device and device.type == "cuda":  # (an adapter made beside a host weight)
                    p.data = p.data.to(device)
                continue
            if not loaded:
                _to(p, placement.to_host)
            self._host.add(id(p))

    def _mark_host(self) -> None:
        """Once, where the step's observer watches: the weights loaded or moved out before it did."""
        if self.low_vram and not self._marked:
            self._placement.mark_host([getattr(o, a) for p in self.experts[1 - self.active].parameters() if id(p) in self._host
                                       for o, a in _parts(p)])
            self._marked = True

    def _move(self, out: torch.nn.Module, into: torch.nn.Module) -> None:
        """ai-toolkit's switch under low_vram: ``out.to("cpu")``, ``into.to(device)``, ``empty_cache()`` (frozen
        weights only: its LoRA modules are not the transformer's children, and stay)."""
        for p in out.parameters():
            if not p.requires_grad:
                _to(p, self._placement.to_host)
                self._host.add(id(p))
        for p in into.parameters():
            if id(p) in self._host:
                _to(p, lambda t: self._placement.to_device(t, self._device))
                self._host.discard(id(p))
        mark("empty_cache")
        if self._device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    # -- a checkpoint resumes with the expert that ran last (memfit.training.checkpoint) ------------------------
    def memfit_state(self) -> dict:
        return {"active": self.active, "ran": self._ran}

    def memfit_restore(self, state: dict) -> None:
        """The expert that ran last; under low_vram its frozen weights are moved in, the other's out."""
        active = int(state["active"])
        if active != self.active and self.low_vram and self._placement is not None:
            self._mark_host()
            self._move(self.experts[self.active], self.experts[active])
        self.active, self._ran = active, bool(state["ran"])

    # -- the step --------------------------------------------------------------------------------------
    def _switches(self) -> bool:
        if not self._ran or self.switch == "none":
            return False
        if self.switch == "batch":
            return True
        trained = [p for p in self.experts[self.active].parameters() if p.requires_grad]
        return all(p.grad is None for p in trained)  # (zero_grad(set_to_none) has begun a step)

    def forward(self, *args, **kwargs):
        if self._placement is not None:
            self._mark_host()
        if self._switches():
            before, self.active = self.active, 1 - self.active
            if self.low_vram and self._placement is not None:
                self._move(self.experts[before], self.experts[self.active])
        self._ran = True
        return self.experts[self.active](*args, **kwargs)


def _parts(p: torch.Tensor) -> list[tuple[object, str]]:
    """The tensors a frozen weight moves with (as ``Module.to`` moves them): its data, and a bitsandbytes weight's
    scales (a 4-bit weight's block absmax, nested ones' too; an 8-bit weight's row scales). memfit's fp8 row scales
    are buffers and stay, a few bytes a row."""
    parts: list[tuple[object, str]] = [(p, "data")]
    state = getattr(p, "quant_state", None)
    if state is not None:
        parts.append((state, "absmax"))
        if getattr(state, "nested", False):
            parts += [(state, "offset"), (state.state2, "absmax")]
    if isinstance(getattr(p, "SCB", None), torch.Tensor):
        parts.append((p, "SCB"))
    return parts


def _to(p: torch.Tensor, move) -> None:
    for owner, attr in _parts(p):
        setattr(owner, attr, move(getattr(owner, attr)))


def experts_options(arch: str, overrides: dict) -> tuple[dict, dict | None]:
    """(the overrides left, the two experts' options or None for one expert) from ``experts=``, ``switch=`` and
    ``low_vram=``."""
    from memfit.workloads.checks import check_value
    overrides = dict(overrides)
    experts = check_value(arch, "experts", overrides.pop("experts", 1), (int,), example=2)
    switch = check_value(arch, "switch", overrides.pop("switch", "batch"), (str,), example="batch")
    low_vram = check_value(arch, "low_vram", overrides.pop("low_vram", False), (bool,), example="true")
    if experts not in (1, 2):
        raise UserError(f"{arch}: experts={experts}: Wan 2.2 A14B has 2 experts (experts=2), one run of musubi-tuner "
                        "trains 1 (experts=1)")
    if switch not in SWITCHES:
        raise UserError(f"{arch}: switch={switch} is not one of {', '.join(SWITCHES)}")
    if experts == 1 and (switch != "batch" or low_vram):
        raise UserError(f"{arch}: switch= and low_vram= are for two experts; add experts=2")
    return overrides, ({"switch": switch, "low_vram": low_vram} if experts == 2 else None)
