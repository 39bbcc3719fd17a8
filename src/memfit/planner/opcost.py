"""OpRecorder: what a step's ATen ops cost, read from a fake trace of the step itself.

The step-time model (memfit.planner.timing) needs, for every op the real step would run, what
work it does: its FLOPs (``torch.utils.flop_counter``'s registry, the formulas FlopCounterMode
uses), the bytes it reads and writes, the dtype its matmuls run in, how many tensors a
``_foreach`` op walks, and whether it moves data over the host link. A ``TorchDispatchMode``
entered around the steady-state step of a fake trace (``memfit.memory.faketrace.run_tracked``,
the trace ``estimate`` runs, with the CUDA kernel model for GPU presets) records that, one small
tuple per op, so techniques cost what they really run:

- checkpointing's recomputed forward is ops dispatched again during backward, flagged
  ``RECOMPUTE`` (the recomputation runs under checkpoint's ``_recomputation_hook``); selective
  checkpointing's cached matmuls are not dispatched again, so they cost nothing;
- micro-batches and loss chunks are more, smaller ops;
- offload and EMA on the host are copies between host and device: the tracker is told which
  storages live on the host (``observer.host``), so a copy from a host storage is host-to-device
  and a copy the placement then marks as host is device-to-host; an op on host storages runs on
  the host CPU (EMA's ``lerp_``), after a blocking copy of its device inputs;
- a library op whose CUDA path synchronises (bitsandbytes' per-parameter update) is flagged
  ``SYNC_AFTER``: the CPU waits for it before issuing the next parameter's;
- an op that passed through another Python dispatch mode first (selective checkpointing's
  caching modes) is flagged ``PY_MODE``: that mode is Python code run for every op on the CPU.

Bytes are those of the tensors an op reads and writes, each at most its storage (an expanded
bias is read once). Views, allocations and metadata ops launch no kernel; ops on zero-dim host
scalars (AdamW's step counters stay on the CPU) launch none either. A scalar read
(``.item()``) of a value computed on the device is a synchronisation.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.flop_counter import flop_registry

from memfit import rng_ops
from memfit.device_queries import PRIM_DEVICE, FakeTensor
from memfit.planner.op_links import Prefetched, while_alive
from memfit.planner.op_work import (
    ATTENTION_OPS,
    HALF,
    RNN_OPS,
    flat_args,
    flops_of,
    is_causal,
    matmul_dtype,
    nbytes_of,
    rnn_work,
    tensors_of,
)
from memfit.planner.ops import (
    AFTER_COMPUTE,
    ATTENTION,
    BACKGROUND,
    COMM,
    COMM_STREAM,
    COMPILED,
    CUSTOM,
    D2H,
    FOREACH,
    FUSED_HOST,
    H2D,
    HOST,
    MATMUL,
    MEMORY,
    OPTIMIZER,
    OUT_STREAM,
    PHASES,
    PY_MODE,
    RECOMPUTE,
    RNN,
    SCALAR,
    SIDE_STREAM,
    STEP_CALL,
    SYNC,
    SYNC_AFTER,
    VIEW,
    WAIT,
    WORKER,
    Op,
)
from memfit.techniques import fake_wrapper
from memfit.techniques.placement import running
from memfit.techniques.sharding import compute_waits, on_fsdp_stream

aten = torch.ops.aten

_FUSED_OPTIMIZERS = {aten._fused_adamw_, aten._fused_adam_}
_CPU_ONLY = {aten._unsafe_view, aten.lift_fresh, aten.empty, aten.empty_strided, aten.new_empty,
             aten.new_empty_strided, aten.empty_like, aten.set_, aten.resize_, aten._reshape_alias}
_SKIP = {torch.ops.prim.device}
"""``tensor.device`` is dispatched only for fake tensors: no op in a real run."""
_SCALAR_READS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal}
_COPIES = {aten.clone, aten._to_copy, aten.copy_, aten.copy}


class OpRecorder(TorchDispatchMode):
    """Records every ATen op of the block it is entered around (see the module docstring).

    Enter it inside the memory tracker of a fake trace (``run_tracked(..., around_step=...)``): it
    reads the step's phase and the host placement of storages from that tracker."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.tracker = None
        self._device_scalars: dict[int, tuple[None, weakref.ref]] = {}
        """Zero-dim storages computed from device tensors (a read of one waits for the GPU)."""
        self._last_copy: tuple[int, int] | None = None  # (index in ops, output storage key)
        self._pending: dict[int, tuple[int, weakref.ref]] = {}
        """Storages written by a collective or on FSDP2's streams -> (that op's serial, the storage,
        by weak reference: a freed storage's key is reused)."""
        self._prefetched = Prefetched()
        self._serials = 0
        self._compute_waits = 0
        self._schema: dict[Any, tuple[bool, tuple[int, ...]]] = {}
        self._depth = 0

    # -- context: find the tracker, hear about host placements --------------------------------------
    def __enter__(self):
        # entered again around a compiled region's wrapper (fake_wrapper.RUNTIME_MODES): only the
        # outermost entry sets up, so the phase and host placements stay those of the step
        if self._depth:
            self._depth += 1
            return super().__enter__()
        from memfit.memory.tracker import MemoryTracker
        self.tracker = next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, MemoryTracker)),
                            None)
        if self.tracker is not None:
            host = self.tracker.host
            self.tracker.host = lambda tensors: (self._placed_on_host(tensors), host(tensors))
        self._step_hook = register_optimizer_step_pre_hook(self._optimizer_step)
        fake_wrapper.LISTENERS.append(self)
        self._depth = 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth:
            return super().__exit__(*exc)
        try:
            if self.tracker is not None:
                del self.tracker.host  # the class's method again
            self._step_hook.remove()
        finally:  # (a worker process is reused: no recorder may stay told of later traces' kernels)
            if self in fake_wrapper.LISTENERS:
                fake_wrapper.LISTENERS.remove(self)
        return super().__exit__(*exc)

    # NOTE [ Compiled kernels in the step time ]
    # A compiled region predicted on fake tensors runs Inductor's own wrapper with kernels that do
    # nothing (memfit.techniques.fake_wrapper), so its kernels never reach the dispatcher and this
    # recorder used to see none of them: torchao's low-bit AdamW, one compiled call per parameter,
    # cost nothing in the model. GPT-2 (124M, bf16-pure, batch 8 x 1024) on an H100: torchao's 8-bit
    # AdamW 88.0-104.7 ms a step, torch's AdamW 52.2-54.6 ms, the same GPU kernel time (49.0 and 48.4
    # ms: the step is CPU-bound, 148 compiled calls); predicted 40.5 and 42.4 ms, so the planner chose
    # it at every budget (tests/data/h100.jsonl, choice* rows). Now the wrapper tells the recorder of
    # each call (a CPU cost: dynamo's guards, the wrapper, torchao's per-parameter Python) and each
    # kernel launch (a memory-bound kernel over the tensors it is given, each counted once).
    def compiled_call(self) -> None:
        """A compiled region was called (NOTE [ Compiled kernels in the step time ])."""
        self.ops.append(Op(VIEW, self._phase(), 0.0, 0, "", 1, _flags() | _offload_flags() | COMPILED))

    def compiled_kernel(self, tensors: list) -> None:
        """One of a compiled region's kernels was launched on ``tensors`` (each view counted once:
        a lower bound of its traffic, an argument written in place being read too). On host
        storages (torchao's update stepped on the host) it is a host op, timed at the host's
        unfused rate: that compiled CPU update is compute-bound, and slower still (left out of the
        search for it: memfit.planner.space)."""
        flags = _flags() | _offload_flags() | COMPILED
        seen, nbytes, hosted = set(), 0, False
        for t in tensors:
            hosted = hosted or self._is_host(t)
            key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape))
            if key not in seen:
                seen.add(key)
                nbytes += nbytes_of(t)
        if hosted:
            self.ops.append(Op(HOST, self._phase(), 0.0, 0, "", 1, flags, host_bytes=nbytes))
            return
        self.ops.append(Op(MEMORY, self._phase(), 0.0, nbytes, "", 1, flags))

    def _optimizer_step(self, optimizer, args, kwargs) -> None:
        """Each ``optimizer.step()`` call is Python work before its first op (per-parameter
        optimizers: offloaded states, optimizer in backward, bitsandbytes' loop)."""
        self.ops.append(Op(VIEW, self._phase(), 0.0, 0, "", 1, STEP_CALL | _offload_flags()))

    def _placed_on_host(self, tensors) -> None:
        """The placement put these tensors on the host: the copy that made them was device-to-host."""
        if self._last_copy is None:
            return
        i, key = self._last_copy
        for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata == key:
                self.ops[i] = self.ops[i]._replace(kind=D2H, flops=0.0, nbytes=nbytes_of(t))
                self._last_copy = None

    def _device_scalar(self, t: torch.Tensor) -> bool:
        entry = self._device_scalars.get(t.untyped_storage()._cdata)
        return entry is not None and entry[1]() is not None

    def _mark_device_scalar(self, t: torch.Tensor) -> None:
        if t.untyped_storage()._cdata not in self._device_scalars:
            while_alive(self._device_scalars, t.untyped_storage())

    def _is_host(self, t: torch.Tensor) -> bool:
        tr = self.tracker
        if tr is None:
            return False
        serial = tr.storages.token(t)
        return serial is not None and tr.state.records[serial].device == "host"

    def _phase(self) -> int:
        name = self.tracker.phase_name if self.tracker is not None else "idle"
        return PHASES.index(name) if name in PHASES else 0

    # -- dispatch ---------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE and type(args[0]) is FakeTensor:  # (NOTE [ Device queries ] in memfit.device_queries)
            return args[0].device
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _SKIP:
            return out
        self._record(func, packet, args, kwargs, out)
        return out

    def _record(self, func, packet, args, kwargs, out) -> None:
        flags = _flags() | (RECOMPUTE if _is_recompute() else 0) | _offload_flags() | \
            (COMM_STREAM if on_fsdp_stream() else 0)
        if func.namespace in _COLLECTIVES:
            self._record_collective(func, packet, args, kwargs, out, flags)
            return
        if func.namespace not in _ATEN:
            flags |= CUSTOM | (SYNC_AFTER if func._schema.name in _SYNCING_OPS else 0)
        phase = self._phase()
        view, mutated = self._schema_of(func)
        if view or packet in _CPU_ONLY or packet in _PROFILER:
            self.ops.append(Op(VIEW, phase, 0.0, 0, "", 1, flags))
            return
        ins = tensors_of(args, kwargs)
        if packet in _SCALAR_READS:
            self.ops.append(Op(SYNC if any(self._device_scalar(t) for t in ins) else SCALAR, phase, 0.0, 0, "", 1,
                               flags))
            return
        outs = tensors_of(out, None) if not mutated else [a for i, a in enumerate(flat_args(args, kwargs))
                                                        if i in mutated and isinstance(a, torch.Tensor)]
        if not any(t.numel() > 1 or self._device_scalar(t) for t in ins):
            # zero-dim host scalars (optimizer step counters): C++ on the CPU, no kernel
            self.ops.append(Op(SCALAR, phase, 0.0, 0, "", 1, flags))
            return
        for t in (*ins, *outs):
            if t.numel() <= 1:
                self._mark_device_scalar(t)
        key_of_stream_op = None
        if flags & COMM_STREAM:  # on FSDP2's streams: ordered after its collectives, waited for like them
            key_of_stream_op = self._serial()
            flags |= self._after_compute()
            for t in outs:
                self._will_wait(t, key_of_stream_op)
        elif self._pending and phase < OPTIMIZER:  # (the optimizer: NOTE [ Collectives ])
            self._wait_for_collectives(ins, phase, flags)
        read = sum(nbytes_of(t) for t in ins)
        written = sum(nbytes_of(t) for t in outs)
        hosted = [t for t in ins if self._is_host(t)]
        if packet in _COPIES:
            if outs and all(self._is_host(t) for t in outs) and any(not self._is_host(t) for t in ins):
                # device -> host into a host buffer (the EMA's copies of the weights)
                self.ops.append(Op(D2H, phase, 0.0, written, "", 1, flags))
                return
            if hosted:  # host -> device (offloaded activations and optimizer states coming back)
                # offloaded states are prefetched on a side stream, and so are swapped blocks' weights
                side = (phase == PHASES.index("optimizer") and not flags & WORKER) or bool(flags & SIDE_STREAM)
                key = self._prefetched.copied(outs[0], self._serial(), phase == OPTIMIZER) if side and outs else 0
                self.ops.append(Op(H2D, phase, 0.0, written, "", 1, flags | (SIDE_STREAM if side else 0), key))
                return
            if outs:
                self._last_copy = (len(self.ops), outs[0].untyped_storage()._cdata)
        if hosted:  # an op on host storages runs on the host CPU, after copying its device inputs there
            device_in = sum(nbytes_of(t) for t in ins if not self._is_host(t))
            flags |= FUSED_HOST if packet in _FUSED_OPTIMIZERS else 0
            self.ops.append(Op(HOST, phase, 0.0, device_in, "", 1, flags, host_bytes=read + written))
            return
        key = key_of_stream_op if key_of_stream_op is not None else \
            self._prefetched.key_of(ins[0]) if phase == OPTIMIZER and ins else self._prefetched.first_read(ins)
        if packet in ATTENTION_OPS:
            flops = flops_of(packet, args, kwargs, out)
            dtype = "half" if args[0].dtype in HALF else "fp32"
            self.ops.append(Op(ATTENTION, phase, flops, read + written, dtype, 1, flags, key,
                               is_causal=is_causal(func, args, kwargs)))
        elif packet in RNN_OPS:
            flops, steps = rnn_work(func, args)
            dtype = "half" if ins[0].dtype in HALF else "fp32"
            self.ops.append(Op(RNN, phase, flops, read + written, dtype, steps, flags, key))
        elif packet in flop_registry or packet is aten.linear:
            flops = flops_of(packet, args, kwargs, out)
            dtype = matmul_dtype(packet, ins)
            self.ops.append(Op(MATMUL, phase, flops, read + written, dtype, 1, flags, key))
        elif packet.__name__.startswith(("_foreach_", "_fused_", "_amp_foreach")):
            n = max((len(a) for a in args if isinstance(a, (list, tuple))), default=1)
            self.ops.append(Op(FOREACH, phase, 0.0, read + written, "", n, flags, key))
        else:
            elements = max((t.numel() for t in ins), default=0) if flags & CUSTOM else 0
            self.ops.append(Op(MEMORY, phase, 0.0, read + written, "", 1, flags, key, elements=elements))

    def _record_collective(self, func, packet, args, kwargs, out, flags: int) -> None:
        """A collective: the bytes one rank sends (ring algorithms: (N - 1) / N of the gathered
        output, of the reduce-scattered input, twice the all-reduced tensor); what it writes is
        waited for by the compute stream's first op that reads it. Functional collectives return
        their output (``wait_tensor`` is the compute stream's wait for it)."""
        import torch.distributed as dist
        name = packet.__name__
        phase = self._phase()
        if name == "wait_tensor":
            self._wait_for_collectives(tensors_of(args, kwargs), phase, flags)
            return
        functional = func.namespace == "_c10d_functional"
        ins = tensors_of(args, kwargs)
        outs = tensors_of(out, None) if functional else ins[:1]
        n = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        size = lambda ts: max((nbytes_of(t) for t in ts), default=0)  # noqa: E731
        if "gather" in name:
            moved = size(outs)
        elif "reduce_scatter" in name:
            moved = size(ins[1:] if not functional else ins)
        elif "reduce" in name:
            moved = 2 * size(ins)
        else:
            moved = size(ins)
        serial = self._serial()
        # issued on the compute stream (not inside one of FSDP2's): in that stream's order
        after = self._after_compute() | (0 if flags & COMM_STREAM else AFTER_COMPUTE)
        self.ops.append(Op(COMM, phase, 0.0, int(moved * (n - 1) / max(n, 1)), "", 1, flags | after, serial))
        for t in outs:
            self._will_wait(t, serial)

    def _serial(self) -> int:
        self._serials += 1
        return self._serials

    def _after_compute(self) -> int:
        """AFTER_COMPUTE once after each time one of FSDP2's streams was told to wait for the
        compute stream."""
        waits = compute_waits()
        if waits == self._compute_waits:
            return 0
        self._compute_waits = waits
        return AFTER_COMPUTE

    def _will_wait(self, t: torch.Tensor, serial: int) -> None:
        while_alive(self._pending, t.untyped_storage(), serial)

    def _wait_for_collectives(self, ins, phase: int, flags: int) -> None:
        for t in ins:
            hit = self._pending.pop(t.untyped_storage()._cdata, None)
            if hit is not None:
                self.ops.append(Op(WAIT, phase, 0.0, 0, "", 1, flags, hit[0]))

    def _schema_of(self, func) -> tuple[bool, tuple[int, ...]]:
        hit = self._schema.get(func)
        if hit is None:
            schema = func._schema
            mutated = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
            view = not mutated and any(r.alias_info is not None for r in schema.returns)
            hit = self._schema[func] = (view, mutated)
        return hit


_ATEN = ("aten", "prims", "prim")
_COLLECTIVES = ("c10d", "_c10d_functional")
_SYNCING_OPS = {"bitsandbytes::optimizer_update_8bit_blockwise", "bitsandbytes::optimizer_update_32bit"}
"""Library ops whose CUDA path synchronises after each call, which a trace on CPU tensors cannot
see: bitsandbytes' optimizers call ``torch.cuda.synchronize()`` after every parameter's update
(``bitsandbytes.optim.optimizer.Optimizer8bit.step``: ``sync_gpu(p)``; a no-op on CPU). Its other
ops (QLoRA's ``dequantize_4bit`` and ``dequantize_blockwise`` in every forward and backward) are
plain memory-bound kernels: priced as such, the H100's QLoRA row went from +137% to +118%; with
its GEMMs in bf16 and its forward GEMM counted (NOTE [ The 4-bit matmul under autocast ] in
``memfit.techniques.bnb_kernels``), to +17%."""
_PROFILER = {torch.ops.profiler._record_function_enter_new, torch.ops.profiler._record_function_exit}
_MEMFIT_MODES = ("/memfit/",)


def _offload_flags() -> int:
    """OUT_STREAM / WORKER / BACKGROUND: what a host-memory technique is doing (placement.running)."""
    return _WHERE_FLAGS.get(running(), 0)


_WHERE_FLAGS = {"out": OUT_STREAM, "host": WORKER, "background": BACKGROUND, "in": SIDE_STREAM}


def _flags() -> int:
    """PY_MODE when another Python dispatch mode handed this op down: the first frame above this
    mode's dispatch, past torch's own wrappers, is another mode's ``__torch_dispatch__``. memfit's
    own trace machinery does not count: it is not there in a real run."""
    f = sys._getframe(3)
    for _ in range(6):
        if f is None:
            return 0
        name = f.f_code.co_name
        if name == "__torch_dispatch__":
            return 0 if any(m in f.f_code.co_filename for m in _MEMFIT_MODES) else PY_MODE
        if name not in _WRAPPERS:
            return 0
        f = f.f_back
    return 0


_WRAPPERS = {"_fn", "inner", "__call__", "redispatch", "wrapper"}


def _is_recompute() -> bool:
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and hooks[0].__qualname__.startswith("_recomputation_hook")


rng_ops.register(OpRecorder)  # (memfit.rng_ops)
