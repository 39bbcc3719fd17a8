"""Offload optimizer states and saved activations to host memory.

Optimizer states (2N bytes for AdamW) are touched once per step, so the optimizer can live in host
memory and step there, overlapped with backward: gradients go out as backward makes them, a worker
thread updates each parameter's host copy, and the parameter comes back on a side stream
(memfit.techniques.offload_optimizer). The device keeps neither the states nor all the gradients,
at the cost of 2N bytes over the host link per step and the host CPU's update.
``optimizer_states:step=device`` keeps the update on the device instead: each parameter's states
visit it for the update, after backward (twice the link traffic, no host CPU time, every gradient
kept until the update). The planner tries both on GPU presets.

Saved activations are written once in forward and read once in backward; the saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``) move each one larger than ``min_bytes`` to host
memory when autograd saves it and bring it back, fetched ahead, when backward needs it. Parameters
are never offloaded (they stay on the device anyway). The values round-trip exactly.

With checkpointing the hooks see what the checkpoints keep for backward: each checkpointed block's
input (with ``selective``, what its policy saves too) and the saved tensors outside the blocks
(embedding, final norm, head, loss). What a block saves inside goes to the checkpoint's own hooks
and is dropped; its recomputation in backward saves under the checkpoint's hooks too, so those
tensors stay on the device, where backward uses them at once (NOTE [ Checkpoints under
saved-tensor hooks ] in memfit.techniques.checkpointing), while the next blocks' inputs are
fetched. On the tests' 2-layer GPT-2 (batch 4 x 64, fp32) ``blocks`` keeps 131,588 bytes of
activations on the device at the peak, ``blocks`` with offload 516, the host holding 845,824:
one input per block (65,536) and what is saved outside the blocks
(tests/unit/techniques/test_offload_blocks.py). A tensor saved twice unchanged (log_softmax's
output, saved again by nll_loss: the logits) goes to the host once; that halved the host bytes.

``activations:blocks=K`` offloads only what is saved inside the first K repeated blocks (in forward
order). Their copies out overlap the later blocks' forward and their copies back the later blocks'
backward; the last blocks' and the head's activations have no compute left to hide behind, and
offloading them makes the step wait on the host link. So K is the memory the link can carry for
free: the planner tries half the blocks beside all of them.

Plan key ``offload``: a list of ``optimizer_states`` (:class:`OffloadOptimizerStates`) or
``optimizer_states:step=device`` (:class:`DeviceStepOffload`), and ``activations`` or
``activations:blocks=K`` (:class:`OffloadActivations`); the config is :class:`Offload`.
"""

from __future__ import annotations

import collections
import contextlib
import re
import weakref
from dataclasses import dataclass

import torch

from memfit.errors import UserError
from memfit.techniques.base import (
    AdaptContext,
    Config,
    Export,
    Key,
    SearchContext,
    Technique,
    choice,
    register,
)
from memfit.techniques.checkpointing import find_blocks
from memfit.techniques.offload_optimizer import DeviceStepOffload, OffloadOptimizerStates
from memfit.techniques.placement import HostPlacement

ITEMS = ("optimizer_states", "optimizer_states:step=device", "activations", "activations:blocks=K")
STATES = ("optimizer_states", "optimizer_states:step=device")
LABELS = {"optimizer_states": "off=optimizer", "optimizer_states:step=device": "off=optimizer(device step)",
          "activations": "off=activations"}
_PARTIAL = re.compile(r"^activations:blocks=(\d+)$")


def activation_blocks(item: str) -> int | None:
    """K of an ``activations:blocks=K`` item (None: another item)."""
    m = _PARTIAL.match(item)
    return int(m.group(1)) if m else None


PREFETCH = 2
"""Saved activations fetched ahead of backward's need (each one's device memory, for that long)."""
STASH = 2
"""Offloaded activations kept on the device while their copies to the host are in flight: forward
waits for the oldest copy when more would be (as torchtune's ``max_fwd_stash_size``), so the device
holds at most this many beyond what stays, however slow the link (and the estimate holds the same)."""


class OffloadActivations:
    """Saved-tensor hooks that keep activations on the host between forward and backward.

    Forward numbers each offloaded tensor as autograd saves it and copies it to the host on a side
    stream of its own, after what the compute stream has queued, so forward goes on; the device
    tensor is kept until ``STASH`` later ones are in flight, then the compute stream waits for its
    copy and lets it go. Backward needs them roughly in reverse order, so when it unpacks tensor ``k`` the next ``PREFETCH`` below it start their
    copies back to the device on a side stream; an unpack waits for its own copy's event (or
    copies at once when it was not prefetched). Small tensors (under ``min_bytes``) and parameters
    stay on the device. On a CPU the copies are plain ones: the numbering, the prefetch and the
    ordering are the same code.
    """

    def __init__(self, model: torch.nn.Module, placement: HostPlacement, min_bytes: int = 1024,
                 prefetch: int = PREFETCH, blocks: int | None = None):
        self.placement = placement
        self.blocks = blocks
        """Offload only what is saved inside the first ``blocks`` repeated blocks (None: everything)."""
        self._inside = 0
        if blocks is not None:
            self._watch(model, blocks)
        self.min_bytes, self.prefetch = min_bytes, prefetch
        self._params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.saved: dict[int, tuple[torch.device, torch.Tensor, object]] = {}
        """Offloaded tensors by number: where they came from, their host copy, what a copy back
        waits for (the copy out: None once done)."""
        self.sending: collections.deque = collections.deque()
        """Device tensors whose copies out may be in flight, with what to ``wait()`` on (oldest first)."""
        self.stash = STASH
        self.fetched: dict[int, tuple[torch.Tensor, object]] = {}
        """Tensors on their way back: the device tensor, and the event its copy records (None: done)."""
        self.unpacked: set[int] = set()
        """Numbers backward has had (not fetched ahead again)."""
        self._next = 0
        self._stream = None
        self._seen: dict[tuple, tuple[weakref.ref, int]] = {}
        """(storage, offset, shape, strides, dtype, version) -> (the tensor, its number): the same
        values saved twice (log_softmax's output saved again by nll_loss) go to the host once."""
        self._uses: dict[int, int] = {}
        """Number -> how many saves share it (its copies go with the last)."""
        self._back: dict[int, torch.Tensor] = {}
        """Number -> its device tensor, unpacked for one use, kept for another."""

    def _watch(self, model: torch.nn.Module, count: int) -> None:
        """Count the calls of the first ``count`` repeated blocks in progress (their forward, which a
        block's checkpoint wraps: the input it saves is saved inside the call)."""
        chosen = [b for _, children in find_blocks(model) for b in children][:count]

        def enter(module, args):
            self._inside += 1

        def leave(module, args, out):
            self._inside -= 1
        for block in chosen:
            block.register_forward_pre_hook(enter)
            block.register_forward_hook(leave)

    def _pack(self, t: torch.Tensor):
        if t.untyped_storage().nbytes() < self.min_bytes or t.untyped_storage()._cdata in self._params \
                or isinstance(t, torch.nn.Parameter) or t.device.type == "meta" \
                or (self.blocks is not None and not self._inside):  # (a swapped block's weight: a parameter)
            return t
        key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is not None and seen[1] in self.saved:  # saved again, unchanged
            k = seen[1]
        else:
            k = self._next
            self._next += 1
            self.saved[k] = (t.device, *self._send(t))
            self._seen[key] = (weakref.ref(t), k)
        self._uses[k] = self._uses.get(k, 0) + 1
        return _Offloaded(k, self)

    def _send(self, t: torch.Tensor):
        """Copy ``t`` to the host (on CUDA on the out-stream, after what the compute stream has
        queued); keep ``t`` until ``stash`` later copies are in flight. Returns (the host copy, what
        a copy back waits for: None where the copy is done)."""
        host, event = self.placement.copy_out(t)
        sent = _Copied(event, t.device) if event is not None else None
        self.sending.append((t, sent))
        while len(self.sending) > self.stash:
            self._release()
        return host, sent

    def _release(self) -> None:
        """Let the oldest device tensor in flight go, once the compute stream has waited for its copy
        (its memory is then reused only after the copy has read it)."""
        _, sent = self.sending.popleft()
        if sent is not None:
            sent.wait()

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        while self.sending:  # backward has begun: no copy out is waited for later
            self._release()
        self._seen.clear()  # (and a save in the next forward is a new tensor)
        k = packed.number
        if k in self._back:  # saved twice: the copy back of its first use serves this one
            return self._back.pop(k)
        t, copied = self.fetched.pop(k, None) or self._fetch(k, ahead=False)
        if copied is not None:
            copied.wait()  # (the compute stream waits for the copy; nothing waits on the host)
        if self._uses.get(k, 1) > 1:
            self._back[k] = t  # (held on the device until its other use, as it would be without offload)
        self.unpacked.add(k)
        for j in range(k - 1, k - 1 - self.prefetch, -1):  # what backward needs next
            if j in self.saved and j not in self.fetched and j not in self.unpacked:
                self.fetched[j] = self._fetch(j, ahead=True)
        return t

    def _fetch(self, k: int, *, ahead: bool):
        """Start tensor ``k``'s copy back to its device: (the device tensor, what to ``wait()`` on
        before using it; None when the copy is done)."""
        device, host, sent = self.saved[k]
        if device.type != "cuda" or not ahead:
            if sent is not None:
                sent.wait()  # (the copy out has written the host copy)
            return self.placement.to_device(host, device), None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        # allocated on the compute stream (its pool, as the estimate books it), filled on the side one
        t = torch.empty(host.shape, dtype=host.dtype, device=device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        if sent is not None:
            sent.wait(self._stream)
        with torch.cuda.stream(self._stream):
            t.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        # (no record_stream: the compute stream waits for the copy before ``t`` is used or dropped, so
        # its block is reused in stream order, at once, as the replay of the trace reuses it;
        # record_stream would hold it until the side stream had done every copy queued when it is
        # freed, which the H100 showed as reserved 48% above the prediction: NOTE [ Gradients in flight ])
        return t, _Copied(event, device)

    def forget(self, k: int) -> None:
        """One use of tensor ``k`` is gone with its graph: after the last, drop its copies."""
        self._uses[k] = self._uses.get(k, 1) - 1
        if self._uses[k] > 0:
            return
        del self._uses[k]
        self._back.pop(k, None)
        self.saved.pop(k, None)
        fetched = self.fetched.pop(k, None)
        if fetched is not None and fetched[1] is not None:
            fetched[1].wait()  # (fetched ahead, never used: its copy is ordered before its block's reuse)
        self.unpacked.discard(k)

    def __call__(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class _Copied:
    """A copy on a side stream: ``wait()`` makes the compute stream (or ``stream``) wait for it."""

    def __init__(self, event, device):
        self.event, self.device = event, device

    def wait(self, stream=None) -> None:
        (stream or torch.cuda.current_stream(self.device)).wait_event(self.event)


class _Offloaded:
    """What autograd keeps for an offloaded tensor: its number. When autograd drops it (its graph
    is freed after backward), the host copy and any prefetched copy go too."""

    __slots__ = ("number", "owner", "__weakref__")

    def __init__(self, number: int, owner: OffloadActivations):
        self.number, self.owner = number, owner

    def __del__(self):
        self.owner.forget(self.number)


@dataclass(frozen=True)
class Offload(Config):
    """What lives in host memory between its uses."""

    items: tuple[str, ...] = ()
    """Any of optimizer_states, activations (sorted, no repeats)."""
    adds_work = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", tuple(sorted(set(self.items))))
        if all(s in self.items for s in STATES):
            raise UserError("plan: offload lists optimizer_states twice (stepped on the host and on the device); "
                            "keep one of optimizer_states, optimizer_states:step=device")

    def values(self) -> dict:
        return {"offload": self.items}

    @property
    def states(self) -> str | None:
        """Which optimizer-state offload (an item of STATES), if any."""
        return next((s for s in STATES if s in self.items), None)

    @property
    def activations(self) -> float:
        """How many blocks' activations go to the host: 0, K, or infinity for all of them."""
        if "activations" in self.items:
            return float("inf")
        return next((float(k) for k in map(activation_blocks, self.items) if k is not None), 0.0)

    def check(self, plan) -> None:
        if self.states == "optimizer_states:step=device" and plan.optimizer_in_backward:
            raise UserError("plan: offload: [optimizer_states:step=device] updates after backward, optimizer_in_backward "
                            "during it; use offload: [optimizer_states] (it steps on the host from the same hooks)")

    @property
    def rank(self) -> int:
        return len(self.items)

    def saves_at_most(self, other: Config, batch_size: int) -> bool:
        return (self.states is None or self.states == other.states) and self.activations <= other.activations

    def states_aside(self) -> Config:
        return Offload(tuple(x for x in self.items if x not in STATES)) if self.states else self

    def apply(self, parts) -> None:
        if self.states == "optimizer_states":
            _offload_optimizer(parts)
        elif self.states is not None:
            placement = parts.placement
            parts.make_optimizer = lambda params, factory: DeviceStepOffload(params, factory, placement)
        if self.activations:
            count = None if self.activations == float("inf") else int(self.activations)
            if count is not None:
                _check_blocks(parts.model, count)
            parts.forward_contexts.append(OffloadActivations(parts.model, parts.placement, blocks=count))

    def frugal(self, ctx: AdaptContext):
        if "activations" in self.items:
            return None
        kept = tuple(x for x in self.items if activation_blocks(x) is None)
        return Offload((*kept, "activations")), "offload: activations"

    def label(self, batch_size):
        return " ".join(LABELS.get(o) or f"off=activations({activation_blocks(o)} blocks)" for o in self.items) or None

    def ablations(self):
        return [(f"offload {item}", Offload(tuple(x for x in self.items if x != item))) for item in self.items]

    def export(self, into: Export) -> None:
        if self.items == ("activations",):  # (sd-scripts, axolotl: each checkpointed block's input on the host)
            into.kohya["cpu_offload_checkpointing"] = into.axolotl["activation_offloading"] = True
        if self.items:
            into.not_carried(self, kohya=self.items != ("activations",), ai_toolkit=True,
                             axolotl=self.items != ("activations",))


def _offload_optimizer(parts) -> None:
    """The step's optimizer steps on the host (memfit.techniques.offload_optimizer): from each
    gradient's hook, unless clipping or fp16 loss scaling need every gradient first."""
    placement, built = parts.placement, []
    eager = parts.plan.max_grad_norm is None and not parts.plan.config("precision").scaled

    def make(params, factory):
        built.append(OffloadOptimizerStates(params, factory, placement, eager=eager))
        return built[-1]
    parts.make_optimizer = make
    parts.before_backward.append(lambda index, count: built[-1].backward_starts(index, count))
    parts.before_update.append(lambda step: built[-1].wait_for_gradients())
    if eager:
        parts.updates_in_backward = True


def _check_blocks(model: torch.nn.Module, count: int) -> None:
    blocks = sum(len(children) for _, children in find_blocks(model))
    if not blocks:
        raise UserError("plan: offload: activations:blocks=K offloads the first K repeated blocks' activations, and "
                        "the model has no repeated blocks; use offload: [activations]")
    if not 1 <= count <= blocks:
        raise UserError(f"plan: offload: activations:blocks={count}: the model has {blocks} repeated blocks; give "
                        f"1 to {blocks}, or activations for all of them")


def _items_text(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def parse(values: dict) -> Offload:
    offload = values["offload"]
    if isinstance(offload, str):
        offload = (offload,) if offload else ()
    if not isinstance(offload, (list, tuple)):
        raise UserError(f"plan: offload must be a list of {', '.join(ITEMS)}; got {offload!r}")
    for item in offload:
        k = activation_blocks(str(item))
        if k is None:
            choice("offload", item, ITEMS[:-1] + ("activations:blocks=K (K >= 1)",))
        elif k < 1:
            raise UserError(f"plan: offload: {item}: K must be a whole number >= 1 (the first K repeated blocks)")
    if sum(str(x).startswith("activations") for x in offload) > 1:
        raise UserError("plan: offload lists activations twice; keep one of activations, activations:blocks=K")
    return Offload(tuple(offload))


def search(ctx: SearchContext) -> list[tuple[str, ...]]:
    """On GPU presets: each state offload, all activations, and (four blocks or more) the first half
    of the blocks' activations, whose copies have the rest of the model's compute to hide behind (of the
    blocks behind frozen text encoders' stacks, which save none). On the CPU the host *is* the device:
    nothing to gain."""
    if not ctx.device.is_gpu:
        return [()]
    values = [(), ("optimizer_states",), ("optimizer_states:step=device",), ("activations",)]
    lengths = [(len(children), any(p.requires_grad for c in children for p in c.parameters()))
               for _, children in find_blocks(ctx.model)]
    frozen = next((i for i, (_, trains) in enumerate(lengths) if trains), len(lengths))
    ahead = sum(n for n, _ in lengths[:frozen])  # (frozen text encoders' layers first: they save no activations)
    blocks = sum(n for n, _ in lengths) - ahead
    if blocks >= 4:
        values.append((f"activations:blocks={ahead + blocks // 2}",))
    return values


TECHNIQUE = register(
    Technique("offload", (Key("offload", (), "Move to host memory: optimizer_states (stepped on the host), "
                              "optimizer_states:step=device, activations (or activations:blocks=K, the first K "
                              "repeated blocks').",
                              annotation="list[str]", from_text=_items_text, metavar="OFFLOAD"),),
              parse, search=search, escalation=30),
    Offload)
