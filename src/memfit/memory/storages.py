"""LiveStorages: the storages a dispatch mode has seen and that are still alive.

Memory belongs to storages, not tensors: views share their base's storage, so a storage is
keyed by its identity (``untyped_storage()._cdata``), and an op whose outputs alias its inputs
(views, in-place and ``out=`` ops: :func:`returns_alias`) makes no new memory. A
``TorchDispatchMode`` (the :class:`~memfit.memory.tracker.MemoryTracker`, the
:class:`~memfit.memory.guard.BudgetGuard`) shows every op's outputs to :meth:`LiveStorages.see`,
which calls its owner's hooks: ``allocated`` for a storage seen for the first time, ``freed``
when it dies.

Why weak references: to learn when a storage is freed, something must watch it, and a strong
reference would keep every tensor of the step alive, changing the very memory being measured
(on fake tensors it would hold no bytes but would still never report a free). A
``weakref.ref`` holds nothing, and its callback runs the moment the storage is deallocated,
which is exactly the free. Views, ``.detach()`` and ``.data`` keep the storage alive, so the
free is booked when the last tensor on the storage goes, as the allocator sees it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

Allocated = Callable[[torch.Tensor, int, Any, bool], Any]
"""``allocated(tensor, nbytes, func, on_host) -> token``: a storage was seen (``func`` is the op
that returned it, or None). The token is kept with the storage and given back to the other hooks."""


class _StorageRef(weakref.ref):
    """A weak reference to a storage that remembers its key and the size it was booked at."""

    __slots__ = ("key", "nbytes")


# NOTE [ Resized storages ]
# A storage seen again may have changed size in place (``resize_``, an ``out=`` op that grew its
# output): same key, new ``nbytes``. It is booked as a free of the old size followed by an
# allocation of the new one; the weak reference of the old size is dropped, so only the latest one
# reports the free.
#
# NOTE [ Host placement ]
# Techniques that copy tensors to host memory (offload, EMA on the host) report them through
# :meth:`LiveStorages.host`. A live storage's owner is told through ``hosted``; a storage placed on
# the host before it was seen, or resized there, is handed to ``allocated`` with ``on_host=True``.
# The placement is remembered (weakly) for as long as the storage lives.
class LiveStorages:
    """The live storages a dispatch mode has seen, by weak reference, each with its owner's token.

    Hooks (called synchronously; a storage's free runs from its weak reference's callback):

    - ``allocated(tensor, nbytes, func, on_host) -> token``: a new storage, or a new size of a
      resized one (see NOTE [ Resized storages ]).
    - ``freed(token)``: the storage was deallocated, or resized away from the size booked under
      this token.
    - ``hosted(token) -> token``: a live storage was placed in host memory (see NOTE [ Host
      placement ]); its return value replaces the token. Default: the token is kept.
    """

    def __init__(self, allocated: Allocated, freed: Callable[[Any], None],
                 hosted: Callable[[Any], Any] | None = None):
        self.live: dict[int, tuple[Any, weakref.ref]] = {}
        """Storage key -> (token, weak reference), for every storage seen and still alive."""
        self._allocated = allocated
        self._freed = freed
        self._hosted = hosted
        self._died = self._on_death  # one bound method for every reference
        self._on_host: dict[int, weakref.ref] = {}  # storages placed on the host, while they live
        self.hosting = 0
        """Inside :meth:`on_host` blocks: storages made there are the host's (a step's work on the host)."""

    def see_outputs(self, out, func) -> None:
        """Show the outputs of the ATen op ``func``; none are new if they alias its inputs."""
        alias = _ALIAS_CACHE.get(func)  # returns_alias, without a call per op
        if alias or (alias is None and returns_alias(func)):
            return
        if isinstance(out, torch.Tensor):  # the common case, without flattening
            self.see(out, func)
        else:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.see(t, func)

    def see(self, t: torch.Tensor, func=None) -> None:
        """Book ``t``'s storage (a DTensor's: its local shard's) if it is new, or was resized since it
        was seen."""
        t = local_tensor(t)
        if hasattr(t, "__tensor_flatten__"):  # a wrapper subclass holds no bytes itself
            for held in byte_holders(t):
                self.see(held, func)
            return
        st = t.untyped_storage()
        key = st._cdata
        entry = self.live.get(key)
        nbytes = st.nbytes()
        if entry is not None:
            if nbytes == entry[1].nbytes:
                return
            self._freed(entry[0])  # see NOTE [ Resized storages ]
            if nbytes == 0:  # resized away (FSDP2 frees unsharded parameters so): booked again when it grows
                del self.live[key]
                return
        ref = _StorageRef(st, self._died)
        ref.key = key
        ref.nbytes = nbytes
        if self.hosting and key not in self._on_host:
            self._on_host[key] = weakref.ref(st, lambda _ref, key=key: self._on_host.pop(key, None))
        self.live[key] = (self._allocated(t, nbytes, func, key in self._on_host), ref)

    def token(self, t: torch.Tensor):
        """The token of ``t``'s storage (a DTensor's: its local shard's), or None if it is not live here."""
        entry = self.live.get(local_tensor(t).untyped_storage()._cdata)
        return None if entry is None else entry[0]

    def tokens(self, t: torch.Tensor) -> list:
        """The tokens of the storages holding ``t``'s bytes that are live here (see :func:`byte_holders`)."""
        return [tok for held in byte_holders(t) if (tok := self.token(held)) is not None]

    @contextlib.contextmanager
    def on_host(self):
        """Storages made inside the block live in host memory (work a step does on the host)."""
        self.hosting += 1
        try:
            yield
        finally:
            self.hosting -= 1

    def host(self, tensors) -> None:
        """These tensors' storages live in host memory (see NOTE [ Host placement ])."""
        for t in (held for x in tree_leaves(tensors) if isinstance(x, torch.Tensor) for held in byte_holders(x)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key in self._on_host:
                    continue
                self._on_host[key] = weakref.ref(st, lambda _ref, key=key: self._on_host.pop(key, None))
                entry = self.live.get(key)
                if entry is not None and self._hosted is not None:
                    self.live[key] = (self._hosted(entry[0]), entry[1])

    def _on_death(self, ref: _StorageRef) -> None:
        entry = self.live.get(ref.key)
        if entry is not None and entry[1] is ref:  # not a size that was resized away
            del self.live[ref.key]
            self._freed(entry[0])


_ALIAS_CACHE: dict = {}


def returns_alias(func) -> bool:
    """True if the op's outputs alias its inputs (views, in-place and out= ops): no new memory."""
    hit = _ALIAS_CACHE.get(func)
    if hit is None:
        # lift_fresh "returns its input", but that input is a tensor just made from Python data
        # (torch.tensor(...)) that no op has shown us yet
        hit = _ALIAS_CACHE[func] = (func not in (aten.lift_fresh.default, aten.lift_fresh_copy.default)
                                    and any(r.alias_info is not None for r in func._schema.returns))
    return hit


def byte_holders(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes on this rank: a DTensor's local shard, the inner
    tensors of a wrapper subclass (torchao's quantized optimizer states: codes, scales, code map),
    recursively, else ``t`` itself."""
    t = local_tensor(t)
    if not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [held for name in names for held in byte_holders(getattr(t, name))]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s bytes on this rank: a DTensor's local shard (FSDP2's parameters,
    gradients and optimizer states), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t
