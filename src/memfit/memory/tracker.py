"""MemoryTracker: every live storage, its bytes, category, module, device and time.

A ``TorchDispatchMode`` sees every ATen op below autograd, forward and backward alike, on fake
tensors (prediction) and real tensors (measurement). Each new storage an op returns is recorded;
``memfit.memory.storages.LiveStorages`` follows it by weak reference and reports its free, so the
tracker holds no memory itself.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit import real_values, rng_ops
from memfit.device_queries import PRIM_DEVICE, FakeTensor
from memfit.errors import ASSUMED_ZERO
from memfit.memory import assumed_sizes
from memfit.memory.categories import CATEGORIES
from memfit.memory.module_stack import ModuleStack
from memfit.memory.storages import LiveStorages
from memfit.quiet import in_stand_in_values
from memfit.real_values import RealValues

aten = torch.ops.aten
MANAGED = "managed"
"""The tracker's device of CUDA managed (unified) memory: a paged optimizer's states."""


# NOTE [ What a storage tracker cannot see ]
# Kernels may allocate scratch memory inside one op (oneDNN/cuDNN workspaces, sort buffers); it
# never reaches Python. ``memfit.memory.workspaces`` adds a per-op rule for the known cases, as a
# transient record around the op.
@dataclass
class StorageRecord:
    serial: int
    nbytes: int
    device: str
    phase: str
    module: str
    op: str
    step: int
    label: str | None = None
    outlived_forward: bool = False


@dataclass
class Approximation:
    """Something the trace could not know and assumed (shown in reports)."""

    what: str
    where: str
    count: int = 1


@dataclass
class TrackerState:
    records: list[StorageRecord] = field(default_factory=list)
    events: list[tuple[int, int]] = field(default_factory=list)
    """(serial, +1 for allocation | -1 for free), in order; bytes come from the record so that a
    probe can correct a record's size after the fact."""
    marks: list[tuple[str, int, int]] = field(default_factory=list)  # (phase, step, event index at start)
    built: int | None = None
    """The event index at which the model was built or loaded (the batch and the steps come after)."""


POINTS = ("step", "end", "empty_cache", "loaded")
"""The names :meth:`MemoryTracker.mark` puts in the timeline: points, not phases (a phase's mark names what
runs from it to the next: 'forward', 'backward'...; memfit.techniques.timeline_marks says who marks the last two)."""


class MemoryTracker(TorchDispatchMode):
    """Track storages created by ATen ops. Use as a context manager around model build + steps.

    ``assume_scalars``: on fake tensors, answer data-dependent scalar reads (``.item()``,
    ``torch.equal``) with 0/False and record an :class:`Approximation` instead of failing.
    """

    thread_local = True  # (a dispatch mode sees only its own thread: memfit.observer)

    def __init__(self, *, assume_scalars: bool = False, probe=None):
        super().__init__()
        self.state = TrackerState()
        self.phase_name = "setup"
        self.step_index = 0
        self.assume_scalars = assume_scalars
        self.approximations: dict[tuple[str, str], Approximation] = {}
        self.probe = probe
        self.unprobed: dict[str, int] = {}
        self._check_origin: dict[int, object] = {}  # storage's record -> the aten.all / aten.any / aten.sum (or kin) that made it
        self._mask_counts: dict[int, int | None] = {}  # storage's record -> elements counted per value (a bool mask's sum)
        self._real_values = RealValues()  # (NOTE [ Real values of small integer tensors ])
        self.storages = LiveStorages(self._allocated, self._freed, self._hosted)  # tokens: record serials
        self._forward_serial_start = 0
        self._modules = ModuleStack()
        self._born_as: str | None = None
        self._stack = contextlib.ExitStack()

    # -- context -----------------------------------------------------------------------------
    def __enter__(self):
        self._stack.enter_context(self._modules)
        self._stack.enter_context(real_values.lists_from_twins(self._real_values))  # (NOTE [ A list read from a twin ])
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._stack.close()
        return out

    @contextlib.contextmanager
    def phase(self, name: str):
        """Mark a phase of the step (called by TrainStep through its observer)."""
        prev = self.phase_name
        self.phase_name = name
        self.state.marks.append((name, self.step_index, len(self.state.events)))
        if name == "forward":
            self._forward_serial_start = len(self.state.records)
        try:
            yield
        finally:
            if name == "forward":
                self._mark_outlived_forward()
            self.phase_name = prev

    def mark(self, name: str) -> None:
        """A named point in the timeline (one of :data:`POINTS`: 'step' at the start of each step)."""
        if name == "step":
            self.step_index += 1
        self.state.marks.append((name, self.step_index, len(self.state.events)))

    # -- labels --------------------------------------------------------------------------------
    def label(self, tensors, category: str) -> None:
        assert category in CATEGORIES, category
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                for serial in self.storages.tokens(t):  # (a tensor subclass: each tensor inside it)
                    self.state.records[serial].label = category

    @contextlib.contextmanager
    def born_as(self, category: str):
        """Storages allocated inside the block get ``category`` (until labelled otherwise)."""
        assert category in CATEGORIES, category
        before, self._born_as = self._born_as, category
        try:
            yield
        finally:
            self._born_as = before

    def host(self, tensors) -> None:
        """These tensors live in host memory (see memfit.techniques.placement)."""
        self.storages.host(tensors)

    def on_host(self):
        """Storages made inside the block live in host memory (work the step does on the host)."""
        return self.storages.on_host()

    def managed(self, tensors) -> None:
        """These tensors are CUDA managed memory, outside the caching allocator: booked on the device
        ``managed`` (NOTE [ Managed states ] in memfit.techniques.optimizers_paged). A real managed
        buffer comes from no ATen op (``torch.frombuffer``), so it is booked here if it is new."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self.storages.see(t)
                for serial in self.storages.tokens(t):
                    self.state.records[serial].device = MANAGED

    # NOTE [ Categories are decided late ]
    # A storage's category is often known only after it was allocated: a backward result becomes a
    # gradient when AccumulateGrad keeps it, a forward result is an activation only if it outlives the
    # forward pass. Records keep the phase and module they were born in; explicit labels
    # (``label(tensors, category)``: parameters, inputs, gradients, optimizer states) are applied when
    # the step reaches the point where they are known; :meth:`category_of` resolves the rest by phase.
    def category_of(self, rec: StorageRecord) -> str:
        """See NOTE [ Categories are decided late ]."""
        if rec.label is not None:
            return rec.label
        if rec.phase == "forward":
            return "activations" if rec.outlived_forward else "temporaries"
        if rec.phase in ("backward", "optimizer", "zero_grad", "workspace"):
            return "temporaries"
        return "other"

    def live_bytes(self, device: str | None = None) -> int:
        recs = self.state.records
        return sum(recs[s].nbytes for s, _ in self.storages.live.values()
                   if device is None or recs[s].device == device)

    def give_values(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Values for a fake tensor the trace cannot know, assumed by the caller (a router's choice:
        memfit.memory.routing): the trace then reads them as a twin's (NOTE [ Real values of small integer tensors ])."""
        self._real_values.give(fake, real)

    # -- dispatch --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE:  # tensor.device: over half of all calls, never memory
            return args[0].device if type(args[0]) is FakeTensor else func(*args)  # (NOTE [ Device queries ] in memfit.device_queries)
        kwargs = kwargs or {}
        if self.assume_scalars and func in _SCALAR_READS and _any_fake(args):
            from torch._subclasses.fake_tensor import DataDependentOutputException
            try:  # fake mode knows the value of small constants (e.g. an optimizer's step counter)
                return func(*args, **kwargs)
            except DataDependentOutputException:
                known = self._real_values.scalar_read(func, args)  # (NOTE [ Real values of small integer tensors ])
                return self._assume(func, args) if known is None else known
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:  # (an op sized by values: NOTE [ Sizes a fake tensor cannot know ])
            out = self._sized(func, args, kwargs)
            if out is None:
                raise
        probed = None
        if self.probe is not None and self.probe.wants(func):
            probed = self.probe(func, args, kwargs, out)
            if probed is None:
                name = str(func.overloadpacket.__name__)
                self.unprobed[name] = self.unprobed.get(name, 0) + 1
            elif probed.error:
                self.approximate(f"no kernel on this CPU for this call ({probed.error[:160]}): its scratch is not "
                                  "counted, and a real run of this step fails here", str(func.overloadpacket.__name__))
                probed = None
            else:
                out = _resize_outputs(out, probed.output_nbytes)
                if probed.scaled:
                    self.approximate("kernel scratch extrapolated from probes at smaller shapes",
                                      str(func.overloadpacket.__name__))
        self.storages.see_outputs(out, func)
        if self.assume_scalars and (type(out) is FakeTensor or type(out) in (tuple, list) and out and type(out[0]) is FakeTensor):
            self._real_values.after(func, args, kwargs, out)
        if self.assume_scalars and func.overloadpacket in _CHECK_OPS and isinstance(out, torch.Tensor):
            token = self.storages.token(out)  # (by its record, not its address: NOTE [ Assumed scalars ])
            if token is not None:
                self._check_origin[token] = func.overloadpacket
                if func.overloadpacket in _COUNT_OPS:
                    self._mask_counts[token] = _mask_count(args, out)
        if func in assumed_sizes.SCRATCH and _any_fake(args):  # (a real run's allocator sees it)
            self._transient(assumed_sizes.scratch_bytes(func, args), func, args)
            self._transient_end()
        if probed is not None and probed.scratch_bytes:
            # scratch = the op's peak minus what it returns, so booking it beside the outputs
            # reproduces the op's peak (see memfit.memory.workspaces)
            self._transient(probed.scratch_bytes, func, args)
            self._transient_end()
        return out

    def _sized(self, func, args, kwargs):
        """The outputs of an op whose size depends on values fake mode does not know: the op's own on the
        real twins of its arguments, else the assumed size (NOTE [ Sizes a fake tensor cannot know ] in
        memfit.memory.assumed_sizes), else None."""
        values = self._real_values
        known = values.fake_outputs(func, args, kwargs) if self.assume_scalars else None
        if known is not None:  # (every argument has a twin: the op's own answer)
            return known
        if func in real_values.MASK_INDEXED:
            indexed = values.indexed_by_positions(func, args, kwargs)
            if indexed is not None:
                self._transient(indexed[1], func, args)  # (the kernel's nonzero of the mask)
                self._transient_end()
            return None if indexed is None else indexed[0]
        sized = assumed_sizes.outputs(func, args, values.count, values.maximum) if func in assumed_sizes.SIZED else None
        if sized is None:
            return None
        if sized[1] is not None:
            self.approximate(sized[1], _user_frame())
        return sized[0]

    # -- LiveStorages hooks: a storage's token is its record's serial ----------------------------
    def _allocated(self, t: torch.Tensor, nbytes: int, func, on_host: bool) -> int:
        serial = len(self.state.records)
        self.state.records.append(StorageRecord(
            serial=serial, nbytes=nbytes, device="host" if on_host else _device_name(t), phase=self.phase_name,
            module=self._modules.current(), op=_op_name(func) if func else "?", step=self.step_index,
            label=self._born_as))
        self.state.events.append((serial, 1))
        return serial

    def _freed(self, serial: int) -> None:
        self.state.events.append((serial, -1))

    def _hosted(self, serial: int) -> int:
        self.state.records[serial].device = "host"
        return serial

    def _transient(self, nbytes: int, func, args) -> None:
        serial = len(self.state.records)
        device = next((_device_name(a) for a in tree_leaves(args) if isinstance(a, torch.Tensor)), "cpu")
        self.state.records.append(StorageRecord(serial=serial, nbytes=nbytes, device=device, phase="workspace",
                                                module=self._module(), op=f"{func.overloadpacket.__name__}:workspace",
                                                step=self.step_index, label="temporaries"))
        self.state.events.append((serial, 1))
        self._transient_serial = serial

    def _transient_end(self) -> None:
        self.state.events.append((self._transient_serial, -1))

    def _mark_outlived_forward(self) -> None:
        start = self._forward_serial_start
        for serial, _ in self.storages.live.values():
            if serial >= start:
                self.state.records[serial].outlived_forward = True

    def _module(self) -> str:
        return self._modules.current()

    # NOTE [ Assumed scalars ]
    # A value fake mode cannot know is assumed to be the common case of a check: ``.all()`` True (and
    # ``torch._is_all_true``, torch.distributions' argument checks), ``.any()`` False, ``torch.equal``
    # True, anything else 0 (e.g. GradScaler's found_inf: no overflow), and a count of a boolean mask (``mask.sum()``, ``count_nonzero``) a full mask, as
    # ``.all()`` is: every element counted (e.g. the caption lengths of a text-conditioned DiT from
    # its attention mask; a synthetic batch's masks are full). Every assumption is listed in the
    # report, except those about the values memfit gives a loaded model in place of a checkpoint's
    # (memfit.quiet.stand_in_values: the user's run reads a checkpoint there, and assumes nothing).
    # Which check made a tensor is kept by its storage's record, not its address: a storage
    # freed and another made at the same address took over its origin, so GradScaler's found_inf, made
    # where an ``.all()`` had been, read as an overflow and skipped the first step's update, in some
    # traces and not others (the second step then made the optimizer states).
    def _assume(self, func, args):
        """The value assumed for a scalar fake mode cannot know, listed in the report (NOTE [ Assumed
        scalars ])."""
        token = self.storages.token(args[0])
        origin = self._check_origin.get(token) if func is not aten.equal.default and token is not None else None
        count = self._mask_counts.get(token) if origin in _COUNT_OPS else None
        if func is aten.equal.default:
            what, value = "torch.equal(...) assumed True", True
        elif count is not None:
            what, value = "a data-dependent count of a boolean mask assumed full (all True)", count
        elif origin in _ALL_OPS:
            what, value = "a data-dependent .all() assumed True", True
        elif origin in _ANY_OPS:
            what, value = "a data-dependent .any() assumed False", False
        else:
            dtype = args[0].dtype
            value = False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
            what = ASSUMED_ZERO
        if not in_stand_in_values():  # memfit's own stand-in for a checkpoint's values: not the user's step
            self.approximate(what, _user_frame())
        return value

    def approximate(self, what: str, where: str) -> None:
        key = (what, where)
        if key in self.approximations:
            self.approximations[key].count += 1
        else:
            self.approximations[key] = Approximation(what=what, where=where)


_OP_NAMES: dict = {}


def _op_name(func) -> str:
    name = _OP_NAMES.get(func)
    if name is None:
        name = _OP_NAMES[func] = str(func.overloadpacket.__name__)
    return name


def _resize_outputs(out, real_nbytes: tuple[int, ...]):
    """Give fake outputs the storage size the real kernel returns (see memfit.memory.workspaces):
    an output the meta kernel leaves empty (``mkldnn_rnn_layer``'s workspace), and a 0-dim result
    that really is a view of a larger buffer (CPU ``mse_loss`` reduces its elementwise losses in
    place and returns element 0, holding them all while autograd keeps the loss)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten
    leaves, spec = tree_flatten(out)
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if len(tensors) != len(real_nbytes):
        return out
    changed = False
    for i, nbytes in zip(tensors, real_nbytes):
        t = leaves[i]
        # only outputs the meta kernel leaves empty (e.g. mkldnn_rnn_layer's workspace)
        if t.dim() == 1 and t.numel() == 0 and nbytes and nbytes % t.element_size() == 0:
            leaves[i] = torch.empty(nbytes // t.element_size(), dtype=t.dtype, device=t.device)
            changed = True
        elif t.dim() == 0 and nbytes > t.untyped_storage().nbytes() and nbytes % t.element_size() == 0:
            leaves[i] = torch.empty(nbytes // t.element_size(), dtype=t.dtype, device=t.device)[0]
            changed = True
    return tree_unflatten(leaves, spec) if changed else out


_COUNT_OPS = {aten.sum, aten.count_nonzero}
_ALL_OPS = {aten.all, aten._is_all_true}
"""What ``.all()`` and ``torch._is_all_true`` make (the latter: torch.distributions' argument validation)."""
_ANY_OPS = {aten.any, aten._is_any_true}
_CHECK_OPS = {*_ALL_OPS, *_ANY_OPS, *_COUNT_OPS}


def _mask_count(args, out: torch.Tensor) -> int | None:
    """Elements each value of ``out`` counts, when ``out`` sums a boolean mask; else None."""
    mask = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if mask is None or mask.dtype != torch.bool or out.numel() == 0:
        return None
    return mask.numel() // out.numel()
_SCALAR_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


def _any_fake(args) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return any(isinstance(a, FakeTensor) for a in tree_leaves(args))


def _device_name(t: torch.Tensor) -> str:
    d = t.device
    return "cpu" if d.type == "cpu" else f"{d.type}:{d.index or 0}"


def _user_frame() -> str:
    """The innermost stack frame outside torch and memfit: where a data-dependent read came from."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        f = frame.filename
        if "/torch/" not in f and "/memfit/memory/" not in f and "contextlib" not in f:
            return f"{'/'.join(f.split('/')[-2:])}:{frame.lineno}"  # also '<stdin>', a notebook cell
    return "?"


rng_ops.register(MemoryTracker)  # (memfit.rng_ops)
