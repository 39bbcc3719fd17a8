"""EMA: an exponential moving average of the weights, kept where memory is cheap.

The shadow copy costs one fp32 copy of the parameters (N bytes). Kept on the device it competes
with training memory; kept on the host (``device: cpu``) it costs device memory nothing and a
device->host copy of the weights every ``every`` steps. The update is
``shadow = decay * shadow + (1 - decay) * weights``.
"""

from __future__ import annotations

import torch

from memfit.plans import EMAConfig
from memfit.techniques.placement import HostPlacement


class NoEMA:
    def update(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class EMA(NoEMA):
    def __init__(self, model: torch.nn.Module, config: EMAConfig, placement: HostPlacement):
        self.model, self.config, self.placement = model, config, placement
        self.updates = 0
        self.shadow: dict[str, torch.Tensor] = {}

    def _init_shadow(self) -> None:
        for name, p in self.model.named_parameters():
            if self.config.device == "cpu":
                self.shadow[name] = self.placement.to_host(p.detach().float())
            else:
                self.shadow[name] = p.detach().float().clone()

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        if not self.shadow:
            self._init_shadow()
            return
        if self.updates % self.config.every:
            return
        for name, p in self.model.named_parameters():
            s = self.shadow[name]
            src = p.detach()
            if src.device != s.device:
                src = src.to(s.device, non_blocking=False)
            s.lerp_(src.to(s.dtype), 1.0 - self.config.decay)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "shadow": self.shadow}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copy a saved shadow into this EMA's own buffers, so it stays where the plan puts it
        (checkpoints are loaded on the CPU)."""
        self.updates = state["updates"]
        self.shadow = {}
        if state["shadow"]:
            self._init_shadow()
            for name, saved in state["shadow"].items():
                self.shadow[name].copy_(saved)
