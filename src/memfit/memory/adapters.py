"""Adapters that make a fake-tensor trace take the code path a real run takes."""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch

from memfit.memory.grouped_mm import grouped_mm_meta


# NOTE [ Libraries that branch on fake tensors ]
# Hugging Face transformers treats a ``FakeTensor`` as "tracing" (``is_tracing`` ->
# ``is_fake_tensor``) and then takes the export-safe path, e.g. it materialises a [B, 1, T, T]
# attention mask that a real run skips. memfit's fake trace exists to predict the real run, so
# while it runs, transformers' fake-tensor detection answers False; data-dependent reads it then
# makes are answered by fake mode (constants) or listed as approximations. The patch is undone on
# exit and only touches transformers if it is already imported. A test fails loudly if the
# function moves.
@contextlib.contextmanager
def real_code_paths():
    with contextlib.ExitStack() as stack:
        module = sys.modules.get("transformers.utils.import_utils")
        if module is not None and hasattr(module, "is_fake_tensor"):
            stack.enter_context(_patched(module, "is_fake_tensor", lambda x: False))
        stack.enter_context(_patched(torch.utils, "swap_tensors", _fake_swappable(torch.utils.swap_tensors)))
        stack.enter_context(grouped_mm_meta())  # NOTE [ Grouped GEMM on fake tensors ]
        yield


# NOTE [ Module conversions on fake tensors ]
# ``Module.to`` / ``_apply`` on a module of fake parameters swaps each parameter with its converted
# copy (``torch.utils.swap_tensors``), and the swap refuses any tensor with a weak reference.
# FakeTensorMode's converter memo holds one on every fake tensor made by ``Parameter(...)`` (a
# ``detach``), so a plain ``Linear(4, 4).to("cpu")`` fails under fake mode ("_apply(): Couldn't
# swap Linear.weight"; pytorch#148977, #184976). PEFT moves every new adapter to its base layer's
# device with ``.to``, so no PEFT model could be built on fake tensors. While a fake trace runs,
# a swap of fake tensors first drops them from the converter's memo (a cache of real -> fake
# conversions: dropping an entry only costs a conversion later); every other swap is untouched.
# A test fails loudly if torch stops using ``torch.utils.swap_tensors`` here or fixes it.
#
# What a technique's own library needs on fake tensors is the technique's business
# (``Config.trace_context``, e.g. NOTE [ bitsandbytes tables on fake tensors ]).
def _fake_swappable(swap):
    """See NOTE [ Module conversions on fake tensors ]."""
    from torch._subclasses.fake_tensor import FakeTensor

    def swap_tensors(t1, t2):
        if _same_tensor(t1, t2):
            return None  # a conversion that changed nothing (``.to`` of what is already there): keep t1
        for t in (t1, t2):
            if isinstance(t, FakeTensor) and weakref.getweakrefcount(t):
                memo = t.fake_mode.fake_tensor_converter.tensor_memo
                for key in [k for k, ref in memo.data.items() if ref() is t]:
                    del memo[key]
        return swap(t1, t2)
    return swap_tensors


def _same_tensor(t1, t2) -> bool:
    """``t2`` is ``t1`` again: same storage, place, shape, strides and dtype."""
    return (isinstance(t1, torch.Tensor) and isinstance(t2, torch.Tensor) and t1.device == t2.device
            and t1.dtype == t2.dtype and t1.shape == t2.shape and t1.stride() == t2.stride()
            and t1.storage_offset() == t2.storage_offset()
            and t1.untyped_storage()._cdata == t2.untyped_storage()._cdata)


@contextlib.contextmanager
# NOTE [ RNG states ]
# ``torch.utils.checkpoint`` saves the CPU generator's state (``torch.get_rng_state()``, 5056 bytes)
# at every checkpointed call and keeps it until backward recomputes the call: a tensor made by no
# ATen op, so no dispatch mode sees it (the profiler does: 15 KiB over three checkpointed blocks of a
# small model, 1% of its step). On a CPU target both traces show it to the tracker
# (``rng_states_seen``), under ``other``; on a GPU target it is host memory and not the card's.
# Kernels whose meta kernel refuses what their real kernel runs get an implementation for the trace
# (NOTE [ Grouped GEMM on fake tensors ] in memfit.memory.grouped_mm).
def rng_states_seen(tracker):
    """See NOTE [ RNG states ]."""
    get = torch.get_rng_state

    def get_rng_state():
        state = get()
        tracker.storages.see(state)
        tracker.label(state, "other")  # checkpoint's bookkeeping, not an activation
        return state
    with _patched(torch, "get_rng_state", get_rng_state):
        yield


FSDP_BUFFER_METHODS = ("unshard", "wait_for_unshard", "post_backward")


# NOTE [ FSDP2's buffers ]
# FSDP2 gathers each block's parameters into unsharded buffers before its forward and backward, and
# reduce-scatters its gradients out of unsharded ones after its backward, inside its parameter
# groups' ``unshard`` / ``wait_for_unshard`` / ``post_backward``. What those allocate is booked as
# ``communication`` (``fsdp_buffers``, on fake and real tensors alike); a sharded gradient that comes
# out of it is labelled a gradient after the step. The unsharded parameters are freed and allocated
# again by resizing their storages in place (``free_storage`` / ``alloc_storage``), which no
# dispatch mode sees: the tracker is shown each resize. A test fails loudly if these move.
@contextlib.contextmanager
def fsdp_buffers(tracker, sharded: bool):
    """See NOTE [ FSDP2's buffers ] (``sharded``: the step uses FSDP2; else nothing is touched)."""
    if not sharded:
        yield
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    group = _fsdp_param_group.FSDPParamGroup
    with contextlib.ExitStack() as stack:
        for name in FSDP_BUFFER_METHODS:
            stack.enter_context(_patched(group, name, _booked_as_communication(getattr(group, name), tracker)))
        stack.enter_context(fsdp_resizes(tracker.storages))
        yield


@contextlib.contextmanager
def fsdp_resizes(storages):
    """FSDP2's in-place storage resizes shown to ``storages`` (a LiveStorages: the CPU budget
    guard's, in a sharded run), which would otherwise keep counting every freed gathered buffer."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    with contextlib.ExitStack() as stack:
        for module in (_fsdp_param, _fsdp_param_group):
            for name in ("alloc_storage", "free_storage"):
                if hasattr(module, name):
                    stack.enter_context(_patched(module, name, _resize_seen(getattr(module, name), storages)))
        yield


def _resize_seen(resize, storages):
    """FSDP2 frees and re-allocates unsharded parameters by resizing their storages in place
    (``storage.resize_``, which no dispatch mode sees): ``storages`` are shown the new size."""
    def wrapper(tensor):
        resize(tensor)
        storages.see(tensor)
    return wrapper


def _booked_as_communication(method, tracker):
    def wrapper(*args, **kwargs):
        with tracker.born_as("communication"):
            return method(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def _patched(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
