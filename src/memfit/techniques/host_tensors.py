"""Plain tensor attributes of a model built on the meta device, made again on the host.

NOTE [ Plain tensors of a meta build ]
A module may keep tensors that are neither parameters nor buffers: Qwen-Image's rotary table
(``QwenEmbedRope.pos_freqs``, complex, made in ``__init__`` with ``torch.arange``, ``torch.outer``
and ``torch.polar``, and moved to the device in each forward), or a list of them (Lumina2's
``freqs_cis``, one table per axis). diffusers' ``from_pretrained`` builds
under accelerate's ``init_empty_weights``, which sends only parameters to the meta device, so such a
tensor is real, on the host, with its values. Built under ``torch.device("meta")`` (memfit's load:
memfit.techniques.loading), it is meta, and the first forward fails to copy it ("Cannot copy out
of meta tensor"); no checkpoint holds it, and no initialiser knows it.

So the meta build runs under :class:`BuildRecord`, a function mode that notes each call that
makes a meta tensor (its function, arguments and order). After the build, each plain meta tensor
attribute is made again on the host by replaying, in their order, the calls its value came from
(in-place calls included: a tensor's writer is the last call that returned it or wrote into it, and a
write through a view is a write into all that share its storage), with every meta
tensor among the arguments replaced by its replayed value and a meta ``device`` by the host. The
values are those the library's own build gives; the memory is the host's, as the library's is
(what reaches the device is the forward's own copy). A plain tensor made from a parameter or a
buffer (whose values come from a checkpoint) is not replayed: it stays meta, and its forward
fails as before.

NOTE [ Buffers of a meta build ]
A buffer's values come from a checkpoint or the library's own build: a non-persistent rotary table
(Wan's ``freqs_cos``), an index table (Swin's ``relative_position_index``), or a persistent one that
no initialiser covers (SD3's sin-cos ``pos_embed``, computed in ``__init__``). memfit has no
checkpoint, and its load makes each buffer empty on the device (memfit.techniques.loading), where a
stand-in fill would leave noise or zeros. So the same replay gives each buffer the build computed its
value, made on the host before the load (:meth:`BuildRecord.buffer_values`) and copied into the
buffer once it is on the device, in its dtype there: what a checkpoint's copy would bring, no
device memory beyond the buffer itself. It comes before the library's own initialisation, which
has the last word, as in an eager build; a buffer made with ``torch.empty`` (Gemma 4's ``std_scale``,
filled by ``_init_weights``) is not replayed, and one the replay cannot make (it raises) is left to
the initialiser. The replay runs in the build's default dtype (bf16 under ``bf16-pure``), and drops each
value after the last call that reads it, as the build's own Python does: its host peak is the build's
(SD3.5's 906 MB position table peaks at 3.4 GiB on the host either way; kept whole, 6.8). On a CPU
device the host is the device, and the replay's tensors count there, in the prediction as in the
profiler's measurement. A GPU preset traced on this CPU's fake tensors skips it (memfit.step): fake
values matter to no one, and the device never sees the host's work.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

HOST = torch.device("cpu")
UNINITIALISED = ("empty", "new_empty")
"""Calls whose tensors have no values (``torch.empty``, ``empty_like``, ``Tensor.new_empty``)."""


class BuildRecord(TorchFunctionMode):
    """The calls of a meta build that made meta tensors (see NOTE [ Plain tensors of a meta build ])."""

    def __init__(self) -> None:
        super().__init__()
        self.dtype = torch.get_default_dtype()
        """The build's default dtype (``bf16-pure`` builds in bf16): the replay's too."""
        self.calls: list[tuple] = []
        """(function, args, kwargs, outputs, the calls each meta argument came from)."""
        self.writer: dict[int, int] = {}
        """``id`` of a meta tensor -> the index of the last call that returned it or wrote into it (``calls``
        holds every recorded tensor, so an id stays its own)."""
        self.stored: dict[int, int] = {}
        """A meta storage -> the index of the last call that returned or wrote a tensor on it: a write through
        a view (``x.view(2, 4)[0] = 9``) is a write into every tensor that shares its storage."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = [t for t in tree_flatten(out)[0] if _is_meta(t)]
        if getattr(func, "__name__", "") == "__setitem__" and args and _is_meta(args[0]):
            made.append(args[0])  # (``t[0] = 1`` writes ``t`` and returns nothing)
        if _is_meta(kwargs.get("out")):
            made.append(kwargs["out"])
        if made:
            read = [t for t in tree_flatten((args, kwargs))[0] if _is_meta(t)]
            deps = {self.writer[id(t)] for t in read if id(t) in self.writer}
            deps |= {self.stored[_storage(t)] for t in read if _storage(t) in self.stored}
            index = len(self.calls)
            self.calls.append((func, args, kwargs, out, tuple(deps)))
            for t in made:
                self.writer[id(t)] = index
                self.stored[_storage(t)] = index
        return out

    def host_tensors(self, model: torch.nn.Module) -> None:
        """Replace each plain meta tensor attribute of ``model``'s modules by its value on the host."""
        values = self.host_values(model)
        for module in model.modules():
            for name, v in list(vars(module).items()):
                if isinstance(v, torch.Tensor) and id(v) in values:
                    setattr(module, name, values[id(v)])
                elif type(v) in (list, tuple) and any(id(x) in values for x in v):
                    setattr(module, name, type(v)(values.get(id(x), x) for x in v))

    def host_values(self, model: torch.nn.Module, device: torch.device = HOST) -> dict[int, torch.Tensor]:
        """``id`` of each plain meta tensor attribute of ``model``'s modules -> its value made on the host
        (or on ``device``: where a model built as written makes it), under the modes of now (fake tensors in
        a trace); those made from a parameter or a buffer are left out (see the NOTE)."""
        return self._replayed(model, [t for t in plain_tensors(model) if _is_meta(t)], device)

    def buffer_values(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Each meta buffer of ``model`` the build computed (from no parameter and no other buffer) -> its
        value made on the host, by name (NOTE [ Buffers of a meta build ])."""
        named = dict(model.named_buffers(remove_duplicate=False))
        computed = [b for b in named.values() if _is_meta(b) and id(b) in self.writer and not any(
            getattr(self.calls[i][0], "__name__", "").startswith(UNINITIALISED)
            for i in self._closure(b))]  # (an ``empty`` one's values are its initialiser's)
        try:
            values = self._replayed(model, computed, HOST)
        except Exception:  # noqa: BLE001 - one at a time: a buffer the replay cannot make is left to the initialiser
            values = {}
            for b in computed:
                try:
                    values.update(self._replayed(model, [b], HOST))
                except Exception:  # noqa: BLE001
                    pass
        return {name: values[id(b)] for name, b in named.items() if id(b) in values}

    def _replayed(self, model: torch.nn.Module, tensors: list[torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
        owned = {id(t) for t in [*model.parameters(), *model.buffers()]}
        wanted = [t for t in tensors if id(t) in self.writer]
        needed: set[int] = set()
        for t in wanted:
            calls = self._closure(t)
            if not any(id(x) in owned and x is not t for i in calls for x in tree_flatten(self.calls[i][3])[0]
                       if _is_meta(x)):
                needed |= calls  # (else made from a parameter or a buffer: left as it is)
        before = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            return self._run(needed, wanted, device)
        finally:
            torch.set_default_dtype(before)

    def _run(self, needed: set[int], wanted: list[torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
        """The calls ``needed``, in order, on ``device``; each value is dropped after the last call that reads
        it, as the build's own Python drops it (unless ``wanted``): the replay holds no more than the build."""
        order = sorted(needed)
        last: dict[int, int] = {}
        """``id`` of a recorded meta tensor -> the last call of ``order`` that reads it."""
        for i in order:
            for x in tree_flatten(self.calls[i][1:3])[0]:
                if _is_meta(x):
                    last[id(x)] = i
        kept = {id(t) for t in wanted}
        real: dict[int, torch.Tensor] = {}
        with torch.device(device):
            for i in order:
                func, args, kwargs, out, _ = self.calls[i]
                on = tree_map(lambda x: _on(device, x, real), (args, kwargs))
                if any(_is_meta(x) for x in tree_flatten(on)[0]):
                    continue  # (a meta tensor no recorded call made: what it makes stays meta)
                result = func(*on[0], **on[1])
                real.update((id(old), new) for old, new in zip(tree_flatten(out)[0], tree_flatten(result)[0])
                            if _is_meta(old))
                del on, result
                for x in tree_flatten((args, kwargs, out))[0]:
                    if _is_meta(x) and last.get(id(x), -1) <= i and id(x) not in kept:
                        real.pop(id(x), None)
        return {id(t): real[id(t)] for t in wanted if id(t) in real}

    def _closure(self, t: torch.Tensor) -> set[int]:
        """The recorded calls the value of ``t`` (a recorded meta tensor) came from: the last that made or wrote it,
        the last that wrote its storage (through a view, after ``t`` was made), and those they read from."""
        seen: set[int] = set()
        todo = [self.writer[id(t)], *([self.stored[_storage(t)]] if _storage(t) in self.stored else [])]
        while todo:
            i = todo.pop()
            if i not in seen:
                seen.add(i)
                todo.extend(self.calls[i][4])
        return seen


def plain_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors ``model``'s modules hold as plain attributes (neither parameters nor buffers), alone or
    in a list or tuple (Lumina2's ``Lumina2RotaryPosEmbed.freqs_cis``: one rotary table per axis)."""
    owned = {id(t) for t in [*model.parameters(), *model.buffers()]}
    held = [x for m in model.modules() for v in vars(m).values() for x in (v if type(v) in (list, tuple) else (v,))]
    return [t for t in held if isinstance(t, torch.Tensor) and id(t) not in owned]


def _storage(t: torch.Tensor) -> int:
    """The storage ``t`` is a view of (its views share it)."""
    return t.untyped_storage()._cdata


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _on(device: torch.device, x, real: dict):
    if isinstance(x, torch.device) and x.type == "meta" or isinstance(x, str) and x == "meta":
        return device
    if _is_meta(x):
        return real.get(id(x), x)
    return x
