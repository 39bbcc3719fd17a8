"""Which module's forward is running, for the memory tracker's attribution of each allocation."""

from __future__ import annotations

import weakref

from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook


# NOTE [ Instrumentation must not keep tensors alive ]
# Torch.utils.module_tracker.ModuleTracker also follows backward by registering hooks on tensors;
# under activation checkpointing those hooks are registered again on recomputed tensors and keep them
# alive until backward ends, which changes the very peak being measured (+30% on a checkpointed MLP).
# Forward hooks hold no tensors. Backward allocations are attributed to the module that was last
# running forward when recomputing, else to "backward".
class ModuleStack:
    """The module whose forward is running (its qualified name), from global forward hooks only
    (NOTE [ Instrumentation must not keep tensors alive ]).
    """

    def __init__(self) -> None:
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._stack: list[str] = []
        self._handles: list = []

    def _name(self, mod) -> str:
        name = self._names.get(mod)
        if name is None:
            root = type(mod).__name__
            for sub_name, sub in mod.named_modules():
                self._names.setdefault(sub, f"{root}.{sub_name}" if sub_name else root)
            name = self._names[mod]
        return name

    def _push(self, mod, args) -> None:
        self._stack.append(self._name(mod))

    def _pop(self, mod, args, out) -> None:
        if self._stack:
            self._stack.pop()

    def current(self) -> str:
        return self._stack[-1] if self._stack else "Global"

    def __enter__(self):
        self._handles = [register_module_forward_pre_hook(self._push),  # (always: also when checkpoint stops a
                         register_module_forward_hook(self._pop, always_call=True)]  # recomputation early)
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._stack.clear()
        return False
