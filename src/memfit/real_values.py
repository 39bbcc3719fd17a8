"""Real values of a fake trace's small integer and boolean tensors.

NOTE [ Real values of small integer tensors ]
A fake tensor has a shape and no values, and some of a step's code reads values of integer tensors:
DeBERTa's classification loss keeps the labelled rows (``(labels >= 0).nonzero()``), a CTC loss
counts each transcript's labels, a vision-language model finds its image tokens (``input_ids ==
image_token_id``), a check compares a label with the vocabulary (``labels.max() >= vocab_size``).
Those values come from the batch, whose integer tensors (token ids, labels, lengths, positions) are
small beside the activations, and from host data (SpecAugment's mask, drawn with numpy and lifted
with ``torch.tensor``).

So the tracker keeps a real twin of each such tensor (at most :data:`LIMIT` elements): a tensor lifted
from host data is its own twin; an integer factory (``randint``, ``arange``, ``zeros``, ``full``) makes
one (``randint`` from a generator of its own: the trace's random streams are untouched, and a real step
draws other values of the same kind); and an op whose tensor arguments all have twins gets one by
running on them (an in-place op updates them; an in-place op with an argument without a twin drops the
twin it would have changed). Outputs over the limit and floating-point outputs get none; each tensor
of a tuple (``unbind``'s) gets its own.
One more value is known without a twin: a draw from a normal distribution (``randn``, and its casts
and views) is never exactly 0, so its ``== 0`` is all False, a twin of one value expanded
(no memory, whatever its size): SmolVLM keeps the tiles whose pixels are not all 0, every one of a
synthetic batch's, as in a real run. And a uniform draw (``rand``) is above 0 but once in 2**24 (fp32): its
``> 0`` is all True (PEFT's LoKr and LoHa layers apply their update where ``torch.rand(1) > module_dropout``,
0 by default: every step but one in 16 million of a real run's).

The tracker then answers from the twins what fake mode cannot know: a scalar read (``.item()``,
``bool(t)``) is the twin's value, not an assumption; ``nonzero``, ``masked_select`` and an index by a
boolean mask take the twin's count; CTC's ``log_alpha`` the longest target. The trace then follows the
path a real step with such a batch follows, and sizes what it sizes. Whatever has no twin (a mask
computed from activations) is answered as before: NOTE [ Sizes a fake tensor cannot know ] in
memfit.memory.assumed_sizes, NOTE [ Assumed scalars ] in memfit.memory.tracker.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten

LIMIT = 1 << 22
"""The most elements a tensor with a twin has (4M: a batch's token ids and labels are far fewer)."""
_VALUED = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_RANDINT = frozenset({aten.randint.default, aten.randint.low, aten.randint.generator, aten.randint.low_generator})
_FACTORIES = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
                        aten.ones.default, aten.full.default, aten.scalar_tensor.default})
_LIFTS = frozenset({aten.lift_fresh.default, aten.lift_fresh_copy.default})
_SKIP = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default})
_DRAWN = frozenset({aten.randn.default, aten.randn.generator, aten.randn_like.default})
"""Draws from a normal distribution: never exactly 0 (a uniform ``rand`` in fp32 is, once in 2**24)."""
_UNIFORM = frozenset({aten.rand.default, aten.rand.generator, aten.rand_like.default})
"""Draws from a uniform distribution on [0, 1)."""
_KEEPS_DRAWN = frozenset({aten._to_copy.default, aten.view.default, aten._unsafe_view.default, aten.clone.default,
                          aten.reshape.default, aten.contiguous.default})


class RealValues:
    """The twins of one trace (see the module's NOTE)."""

    def __init__(self, seed: int = 0):
        self._twins: dict[int, torch.Tensor] = {}  # id(fake tensor) -> its real twin
        self._drawn: set[int] = set()  # id(fake tensor) drawn from a normal distribution (randn)
        self._uniform: set[int] = set()  # id(fake tensor) drawn from a uniform distribution on [0, 1) (rand)
        self._gen = torch.Generator().manual_seed(seed)

    def of(self, t) -> torch.Tensor | None:
        """``t``'s twin, or None."""
        return self._twins.get(id(t)) if isinstance(t, torch.Tensor) else None

    def after(self, func, args, kwargs, out) -> None:
        """After ``func`` made ``out`` on fake tensors: give ``out`` a twin where one follows."""
        if func in _SKIP:
            return
        if func in _DRAWN or func in _KEEPS_DRAWN and args and id(args[0]) in self._drawn:
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                self._mark_drawn(out)
            return
        if func in _UNIFORM or func in _KEEPS_DRAWN and args and id(args[0]) in self._uniform:
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                self._mark_drawn(out, self._uniform)
            return
        if func is aten.gt.Scalar and id(args[0]) in self._uniform and args[1] <= 0 and _valued(out, constant=True):
            with _disable_current_modes():  # (a uniform draw is above 0: the module's NOTE)
                self._keep(out, torch.ones((), dtype=torch.bool).expand(out.shape))
            return
        if func is aten.eq.Scalar and id(args[0]) in self._drawn and args[1] == 0 and _valued(out, constant=True):
            # (a normal draw is never exactly 0: SmolVLM finds padding images by their zeros)
            with _disable_current_modes():
                self._keep(out, torch.zeros((), dtype=torch.bool).expand(out.shape))
            return
        if func in _LIFTS:
            src = args[0] if args else None
            if type(src) is torch.Tensor and _valued(out):
                self._keep(out, src)
            return
        if func in _RANDINT:
            if _valued(out):
                self._keep(out, self._randint(func, args, kwargs, out))
            return
        if func in _FACTORIES:
            if _valued(out):
                self._keep(out, self._run(func, args, kwargs))
            return
        if not self._twins or not args or id(args[0]) not in self._twins and not self._any_twinned(args):
            return
        real_args, missing = self._real(args)
        real_kwargs, missing_kw = self._real(kwargs)
        mutated = func._schema.is_mutable
        if missing or missing_kw:
            if mutated and isinstance(args[0], torch.Tensor):
                self._twins.pop(id(args[0]), None)  # (changed by what has no twin: no longer known)
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)  # (``unbind``, ``split``: a tuple, each kept)
        if not any(_valued(o) for o in outs):
            return
        result = self._run(func, real_args, real_kwargs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        for o, r in zip(outs, results) if len(results) == len(outs) else ():
            if _valued(o) and isinstance(r, torch.Tensor) and r.shape == o.shape:
                self._keep(o, r)

    def give(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """``real`` as ``fake``'s twin: values assumed by the caller (memfit.memory.routing's router choices)."""
        if _valued(fake) and real.shape == fake.shape:
            self._keep(fake, real)

    def _any_twinned(self, args) -> bool:
        """Whether an argument (or a tensor of a list argument: ``cat``'s) has a twin."""
        twins = self._twins
        return any(id(a) in twins if isinstance(a, torch.Tensor) else
                   isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) and id(x) in twins for x in a)
                   for a in args)

    def _mark_drawn(self, fake: torch.Tensor, drawn: set[int] | None = None) -> None:
        drawn = self._drawn if drawn is None else drawn
        key = id(fake)
        if key not in drawn:
            drawn.add(key)
            weakref.finalize(fake, drawn.discard, key)

    def _keep(self, fake: torch.Tensor, real: torch.Tensor | None) -> None:
        if real is None or real.numel() > LIMIT and any(real.stride()):  # (a constant, all strides 0, costs nothing)
            return
        key = id(fake)
        if key not in self._twins:
            weakref.finalize(fake, self._twins.pop, key, None)
        self._twins[key] = real

    def _real(self, tree):
        missing = []

        def swap(x):
            if isinstance(x, torch.Tensor):
                twin = self._twins.get(id(x))
                if twin is None:
                    missing.append(x)
                return twin
            if isinstance(x, torch.device):
                return torch.device("cpu")
            return x
        return tree_map(swap, tree), bool(missing)

    def _run(self, func, args, kwargs):
        kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in (kwargs or {}).items()}
        try:
            with _disable_current_modes():
                return func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a twin is a help, never a failure of the trace
            return None

    def _randint(self, func, args, kwargs, out: torch.Tensor) -> torch.Tensor | None:
        low, high = (0, args[0]) if func in (aten.randint.default, aten.randint.generator) else (args[0], args[1])
        try:
            with _disable_current_modes():
                return torch.randint(int(low), int(high), tuple(out.shape), dtype=out.dtype, generator=self._gen)
        except Exception:  # noqa: BLE001
            return None

    def fake_outputs(self, func, args, kwargs):
        """Fake outputs of an op sized by values (``repeat_interleave`` by repeats, ``unique``, ``nonzero``),
        shaped as the op's own on the twins of its arguments (called in the dispatch mode's body: fake mode
        makes them), or None if an argument has no twin. :meth:`after` then gives them their twins."""
        real_args, missing = self._real(args)
        real_kwargs, missing_kw = self._real(kwargs)
        real = None if missing or missing_kw else self._run(func, real_args, real_kwargs)
        if real is None:
            return None
        device = next(a.device for a in tree_leaves(args) if isinstance(a, torch.Tensor))
        return tree_map(lambda r: torch.empty(r.shape, dtype=r.dtype, device=device)
                        if isinstance(r, torch.Tensor) else r, real)

    def indexed_by_positions(self, func, args, kwargs) -> tuple[object, int] | None:
        """(the outputs of an indexing op of :data:`MASK_INDEXED` whose boolean masks have twins, run by
        their positions; the bytes of the ``nonzero`` its kernel computes), or None. Called in a dispatch
        mode's body (fake mode makes the outputs)."""
        known = as_positions(args, self.count) if func in MASK_INDEXED else None
        return None if known is None else (func(*known[0], **kwargs), known[1])

    def count(self, mask) -> int | None:
        """True values of a boolean mask with a twin, else None."""
        twin = self.of(mask)
        if twin is None:
            return None
        with _disable_current_modes():
            return int(twin.count_nonzero())

    def maximum(self, t) -> int | None:
        """The largest value of a tensor with a twin (a CTC loss's longest target), else None."""
        twin = self.of(t)
        if twin is None or twin.numel() == 0:
            return None
        with _disable_current_modes():
            return int(twin.max())

    def scalar_read(self, func, args):
        """A scalar read (``.item()``, ``bool(t)``, ``torch.equal``) answered by twins, else None."""
        if func is aten.equal.default:
            a, b = self.of(args[0]), self.of(args[1])
            if a is None or b is None:
                return None
            with _disable_current_modes():
                return bool(torch.equal(a, b))
        return self.scalar(args[0])

    def scalar(self, t):
        """The value of a one-element tensor with a twin (a Python number), else None."""
        twin = self.of(t)
        if twin is None or twin.numel() != 1:
            return None
        with _disable_current_modes():
            return twin.item()


# NOTE [ A list read from a twin ]
# ``FakeTensor.tolist`` reads each element with its own ``.item()``: an ``unbind``, then a scalar read per
# element, each through every mode of the trace (``.numpy()`` of a fake tensor fails: it has no data). Qwen2.5-VL's rope index reads each sample's token types
# as a list (2,048 of them) at every forward: 31,000 scalar reads, 5 of a shallow trace's 11 s. A
# tensor with a twin is read from its twin at once, after one scalar read through the modes, as a CUDA
# tensor's ``tolist`` is one copy to the host and one wait (the time model's sync: not one per element).
_LISTED: list[RealValues] = []
"""The twins of the traces now running, innermost last (the tracker's, and KnownValues' around it)."""


@contextlib.contextmanager
def lists_from_twins(values: RealValues):
    """While entered, ``tolist`` and ``numpy`` of a fake tensor that has a twin in ``values`` read the twin (the NOTE
    above)."""
    from torch._subclasses.fake_tensor import FakeTensor
    if not _LISTED:
        original = FakeTensor.tolist

        def tolist(self):
            twin = _read_twin(self)
            if twin is None:
                return original(self)
            with _disable_current_modes():
                return twin.tolist()

        def numpy(self, *, force: bool = False):  # (HiDream's experts count their tokens on the host: ``.numpy()``)
            if self.numel() == 0:
                return numpy.original(self, force=force)
            twin = _read_twin(self)
            if twin is None:  # (torch's own reads whatever is at the fake storage's address: never a value)
                raise RuntimeError("numpy() of a FakeTensor whose values a fake trace does not know")
            with _disable_current_modes():
                return twin.numpy().copy()

        tolist.original, numpy.original = original, FakeTensor.numpy
        FakeTensor.tolist, FakeTensor.numpy = tolist, numpy
    _LISTED.append(values)
    try:
        yield
    finally:
        _LISTED.remove(values)
        if not _LISTED:
            FakeTensor.tolist, FakeTensor.numpy = FakeTensor.tolist.original, FakeTensor.numpy.original


def _read_twin(fake) -> torch.Tensor | None:
    """The twin of a non-empty fake tensor in the traces now running, after the one wait a real read makes
    (a scalar read through the modes); None where it has none."""
    twin = next((t for t in (v.of(fake) for v in reversed(_LISTED)) if t is not None), None)
    if twin is None or fake.numel() == 0:
        return None
    fake[(0,) * fake.dim()].item()  # (the one wait a real read makes)
    return twin


def _valued(out, constant: bool = False) -> bool:
    """``out`` may have a twin (``constant``: one of a single value, expanded, whatever its size)."""
    return isinstance(out, torch.Tensor) and out.dtype in _VALUED and (constant or out.numel() <= LIMIT)


class KnownValues(TorchDispatchMode):
    """Fake mode's ops with the twins' answers and nothing else: a scalar read of a tensor with a twin, and
    an op sized by the values of tensors with twins. What has no twin fails as under fake mode alone.
    Entered inside ``FakeTensorMode``, to run model code whose shapes follow its integer inputs (a
    vision-language model's image tokens: memfit.workloads.image_text); a fake trace's tracker answers
    the same reads itself (memfit.memory.tracker), with its assumptions besides."""

    def __init__(self):
        super().__init__()
        self.values = RealValues()
        self.unknown_reads_zero = False
        """Answer a scalar read without a twin 0 (False) instead of failing: while building a model, whose
        initial values no shape follows (a truncated normal's resampling loop)."""

    def __enter__(self):
        self._lists = lists_from_twins(self.values)
        self._lists.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._lists.__exit__(*exc)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except DataDependentOutputException:
            out = self.values.scalar_read(func, args)
            if out is None and not self.unknown_reads_zero:
                raise
            return 0 if out is None else out
        except DynamicOutputShapeException:
            out = self.values.fake_outputs(func, args, kwargs)
            indexed = self.values.indexed_by_positions(func, args, kwargs) if out is None else None
            if indexed is not None:
                out = indexed[0]
            elif out is None:
                raise
        self.values.after(func, args, kwargs, out)
        return out


MASK_INDEXED = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                          aten._unsafe_index_put.default})
"""Ops indexed by a list of tensors, where a boolean mask stands for its ``nonzero`` positions."""


def as_positions(args, count) -> tuple[tuple, int] | None:
    """(an indexing op's arguments with each boolean mask among its indices replaced by its positions,
    the bytes of the ``nonzero`` the kernel computes for them), or None if a mask's count is unknown.
    ``count(mask)``: its True values (:meth:`RealValues.count`), or None."""
    positions, scratch = [], 0
    for index in args[1]:
        if index is None or index.dtype not in (torch.bool, torch.uint8):
            positions.append(index)
            continue
        rows = count(index)
        if rows is None:
            return None
        positions += [torch.empty(rows, dtype=torch.long, device=index.device) for _ in range(index.dim())]
        scratch += rows * index.dim() * 8
    return (args[0], positions, *args[2:]), scratch
