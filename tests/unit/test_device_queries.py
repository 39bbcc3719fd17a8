"""A fake tensor's device, asked from C++ (``prim.device``), is answered by the first memfit mode asked
(NOTE [ Device queries ] in memfit.device_queries): the same answer fake mode gives, and the modes below
it are not asked; a tensor subclass is still handed down."""

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.device_queries import PRIM_DEVICE
from memfit.memory.tracker import MemoryTracker


class _Asked(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_the_tracker_answers_a_fake_tensors_device_as_fake_mode_does_and_asks_no_mode_below():
    with FakeTensorMode() as fake:
        x = torch.empty(2, 3, device="cpu")
        below = _Asked()
        with below, MemoryTracker():
            asked = PRIM_DEVICE(x)
            y = x * 2  # (an op is handed down as before)
        assert asked == torch.device("cpu")
        assert PRIM_DEVICE not in below.ops and torch.ops.aten.mul.Tensor in below.ops
        with in_kernel_invocation_manager(fake):  # inside a kernel fake mode says meta, and so does the tracker
            with MemoryTracker():
                assert PRIM_DEVICE(y) == torch.device("meta")


class _Subclass(FakeTensor):  # (as memfit's fake 4-bit parameters are made: memfit.techniques.bnb_kernels)
    pass


def test_a_subclass_device_query_is_handed_down():
    with FakeTensorMode():
        x = torch.empty(2)
        x.__class__ = _Subclass
        below = _Asked()
        with below, MemoryTracker():
            assert PRIM_DEVICE(x) == torch.device("cpu")
        assert PRIM_DEVICE in below.ops
