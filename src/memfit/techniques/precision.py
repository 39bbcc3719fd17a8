"""Precision: autocast (bf16, fp16 + GradScaler) and pure bf16.

Memory/compute trade-off. Autocast keeps fp32 master weights, gradients and optimizer states and
runs matmuls/convolutions in 16 bits: activations saved for backward are mostly 16-bit (about
half the bytes), but each weight is also cast to 16 bits per use (a temporary copy, cached for
the forward pass), so a model dominated by weights and optimizer states saves little. Tensor
cores make 16-bit matmuls several times faster on GPUs. fp16's narrow range needs a GradScaler
to keep small gradients from flushing to zero; bf16 has fp32's range and needs none.
``bf16-pure`` casts the weights themselves: parameters, gradients and optimizer states all take
half the bytes, at the cost of update precision (small updates can be lost to rounding).

``auto`` picks bf16 where the device supports it, fp16 otherwise, fp32 on a device with neither.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from memfit.devices import Device
from memfit.errors import UserError


@dataclass(frozen=True)
class PrecisionConfig:
    mode: str = "fp32"
    """fp32 | bf16 | fp16 | bf16-pure | auto."""


def resolve_mode(mode: str, device: Device) -> str:
    """Turn ``auto`` into a concrete mode and check the device supports the one asked for."""
    if mode == "auto":
        return "bf16" if device.bf16 else "fp16" if device.fp16 else "fp32"
    if mode in ("bf16", "bf16-pure") and not device.bf16:
        raise UserError(f"precision {mode}: {device.name} has no bf16 support; use fp16 or auto")
    if mode == "fp16" and not device.fp16:
        raise UserError(f"precision fp16: {device.name} has no fp16 support; use fp32 or auto")
    return mode


class NoScaler:
    """GradScaler's interface for precisions that need no loss scaling."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FP32:
    """Full precision: the do-nothing precision."""

    name = "fp32"

    def __init__(self, device_type: str):
        self.device_type = device_type

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def grad_scaler(self):
        return NoScaler()

    def prepare_batch(self, batch):
        """The batch as the model expects it (unchanged, except for bf16-pure)."""
        return batch


class Autocast(FP32):
    """fp32 weights, 16-bit compute under ``torch.autocast``."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        super().__init__(device_type)
        self.dtype = dtype
        self.name = "bf16" if dtype == torch.bfloat16 else "fp16"

    def autocast(self) -> contextlib.AbstractContextManager:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ctx = torch.autocast(self.device_type, dtype=self.dtype)
        if self.device_type == "cuda" and not torch.cuda.is_available():
            # NOTE [ Fake CUDA autocast ]: predicting for a GPU preset traces on fake CUDA tensors
            # on a machine without a GPU; torch.autocast then disables itself. The CUDA autocast
            # op lists (which ops run in 16 bits) are what the prediction needs, so keep it on.
            ctx._enabled = True
        return ctx

    def grad_scaler(self):
        if self.dtype == torch.float16:
            if self.device_type == "cuda" and not torch.cuda.is_available():
                # GradScaler("cuda") disables itself without a GPU; see NOTE [ Fake CUDA autocast ].
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    scaler = torch.amp.GradScaler("cuda")
                scaler._enabled = True
                return scaler
            return torch.amp.GradScaler(self.device_type)
        return NoScaler()


class BF16Pure(FP32):
    """Weights, gradients and optimizer states in bf16 (no fp32 master copy)."""

    name = "bf16-pure"

    def prepare_batch(self, batch):
        """Floating-point inputs follow the weights into bf16 (integer ids and labels stay)."""
        from torch.utils._pytree import tree_map
        return tree_map(lambda x: x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point()
                        else x, batch)

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        # Replace parameters one by one (keeping tied weights tied) rather than model.to(): the
        # latter swaps tensors in place, which fails for tied parameters on fake tensors.
        converted: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_floating_point():
                    continue
                if id(p) not in converted:
                    converted[id(p)] = torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=p.requires_grad)
                module._parameters[name] = converted[id(p)]
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_floating_point():
                    module._buffers[name] = b.to(torch.bfloat16)
        return model


def build_precision(mode: str, device: Device, device_type: str | None = None) -> FP32:
    """The precision technique for ``mode`` on ``device`` (whose dtype support decides ``auto``);
    ``device_type`` is where the tensors live (see memfit.step.tensor_device)."""
    mode = resolve_mode(mode, device)
    device_type = device_type or device.kind
    if mode == "fp32":
        return FP32(device_type)
    if mode == "bf16":
        return Autocast(device_type, torch.bfloat16)
    if mode == "fp16":
        return Autocast(device_type, torch.float16)
    return BF16Pure(device_type)
