"""Per-op rules for memory that kernels allocate inside one op, unseen by a storage tracker.

See NOTE [ What a storage tracker cannot see ] in tracker.py. A rule maps (args, kwargs) to the
bytes of scratch memory the kernel holds while it runs; the tracker books them as a transient
``temporaries`` record around the op. Rules are per device kind, because CPU (oneDNN, ATen) and
CUDA (cuDNN, cuBLAS) kernels allocate differently. Each rule names where its size comes from.
"""

from __future__ import annotations

from memfit.devices import Device

CPU_RULES: dict = {}
CUDA_RULES: dict = {}


def rules_for(device: Device) -> dict:
    return CUDA_RULES if device.is_gpu else CPU_RULES
