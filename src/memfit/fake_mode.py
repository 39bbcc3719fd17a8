"""The fake-tensor mode memfit's traces run under.

NOTE [ CUDA availability asked once a trace ]
PyTorch's ``FakeTensorMode`` asks ``torch.cuda.is_available()`` each time it dispatches an op outside its
cache and each time it is entered (``avoid_device_init``): hundreds of thousands of times in a plan's
traces. The question is cheap (1 us) until something in the process sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1``,
which Lightning does when it is imported (``lightning.fabric``, to keep forks usable): each answer then
opens NVML (``dlopen`` of libnvidia-ml, 40 us here without a driver), as in a trace inside a Lightning script
(memfit's own callback estimates in the user's process) and in the whole test suite, whose Lightning tests
import it at collection: 682,232 NVML loads in one profiled run of the suite, 3% of its profiled time.
Whether this process has a usable CUDA device does not change while a trace runs, so memfit's mode asks
once, when it is made, and answers every later question with that.
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.untraced_imports import imports_outside_the_trace


class TraceFakeMode(FakeTensorMode):
    """A ``FakeTensorMode`` that asks whether CUDA is usable once (NOTE [ CUDA availability asked once
    a trace ]), under which modules imported for the first time load outside it (NOTE [ Modules loaded during a
    trace ] in memfit.untraced_imports)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._avoid_device_init = FakeTensorMode.avoid_device_init.fget(self)

    @property
    def avoid_device_init(self) -> bool:
        return self._avoid_device_init

    def __enter__(self):
        imports_outside_the_trace().__enter__()  # NOTE [ Modules loaded during a trace ]
        try:
            return super().__enter__()
        except BaseException:
            imports_outside_the_trace().__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            imports_outside_the_trace().__exit__(None, None, None)


def fake_mode() -> TraceFakeMode:
    """The mode a trace runs under: real tensors it meets are taken as constants (a model's buffers made
    before the trace, a workload's own tensors)."""
    return TraceFakeMode(allow_non_fake_inputs=True)
