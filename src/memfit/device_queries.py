"""``tensor.device`` on a fake tensor, answered by the first of memfit's dispatch modes that is asked.

NOTE [ Device queries ]
A fake tensor's device lives in Python (``FakeTensor.fake_device``), so every time C++ asks for it (the
autograd engine for each gradient, TensorIterator, ``empty_like``...) the dispatcher calls the mode stack
with ``prim.device``: more than half of all dispatches in a trace. Each of memfit's modes (the kernel
model, the tracker, the op recorder, the fake 4-bit kernels, the routing modes) would hand it down with
``func(*args)``: a Python frame, dynamo's disable wrapper and a redispatch per mode, for a question none
of them changes. Fake mode answers it from the tensor alone (``_device_handler`` in
torch/_subclasses/fake_tensor.py: ``meta`` inside a kernel, else the fake device), so the first memfit
mode that sees it answers the same from the same tensor, ``args[0].device``, and the modes below are not
asked. Only an exact ``FakeTensor``: a tensor subclass (a 4-bit weight, a DTensor, a low-bit optimizer
state) is handed down as before. torch.utils.checkpoint's selective-checkpointing modes ignore
``prim.device`` too (``SAC_IGNORED_OPS``), so they lose nothing by not seeing it.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

PRIM_DEVICE = torch.ops.prim.device.default
"""The op a device query dispatches; a mode answers it with ``args[0].device`` where
``type(args[0]) is FakeTensor`` (NOTE [ Device queries ])."""

__all__ = ["PRIM_DEVICE", "FakeTensor"]
