"""Kernels this machine does not have: one line naming the op, the module and the fix.

CPUs differ. Without AVX-512 bf16, oneDNN has no bf16 LSTM/GRU kernel ("could not create a
primitive descriptor for the LSTM forward propagation primitive"), and some ATen kernels exist
for fp32 only ("... not implemented for 'BFloat16'"). A fake-tensor estimate still predicts
(meta kernels exist for every dtype; the kernel probe lists the op as not probed), but a real
step (``profile``, ``train``) cannot run. :func:`explain` turns such a RuntimeError into a
:class:`~memfit.errors.UserError` that says which kernel failed, in which module, and what to do.
"""

from __future__ import annotations

import re

import torch

from memfit.errors import UserError

_ONEDNN = re.compile(r"could not create a primitive descriptor for (?:the |an? )?(?P<what>.+?) primitive")
_ATEN = re.compile(r"\"(?P<what>\w+)\" not implemented for '(?P<dtype>\w+)'")

# oneDNN primitives and the ATen ops that reach them (for the message)
_ONEDNN_OPS = {"LSTM": "aten.mkldnn_rnn_layer", "GRU": "aten.mkldnn_rnn_layer", "RNN": "aten.mkldnn_rnn_layer",
               "convolution": "aten.convolution", "matmul": "aten.mm", "inner product": "aten.linear"}


class KernelUnavailable(UserError):
    """A kernel the step needs does not exist on this machine for the dtype it runs in."""


def _module_of(exc: BaseException) -> str | None:
    """The innermost nn.Module whose forward was running when ``exc`` was raised."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and isinstance(owner, torch.nn.Module):
            found = type(owner).__name__
        tb = tb.tb_next
    return found


def explain(exc: BaseException, precision: str) -> KernelUnavailable | None:
    """A user error for a missing kernel, or None if ``exc`` is something else."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError):
        return None
    text = str(exc)
    m = _ONEDNN.search(text)
    if m:
        what = m.group("what")
        op = next((v for k, v in _ONEDNN_OPS.items() if what.lower().startswith(k.lower())), "a oneDNN op")
        kernel = f"{op} ({what}, oneDNN)"
    else:
        m = _ATEN.search(text)
        if not m:
            return None
        kernel = f"aten.{m.group('what')} for {m.group('dtype')}"
    where = _module_of(exc)
    place = f"in module {where}" if where else "in backward"
    cpu = torch.backends.cpu.get_cpu_capability()
    return KernelUnavailable(
        f"this machine has no kernel for {kernel} {place} at precision {precision} (CPU capability {cpu}); "
        f"keep that module in fp32 (run its forward under torch.autocast(device_type, enabled=False)) "
        f"or use --precision fp32")
