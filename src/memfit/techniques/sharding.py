"""Sharding across ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``), as torchtitan does it.

With ``world_size`` N ranks, each rank keeps 1/N of every parameter, of its gradient and of its
optimizer states (model states: 16 bytes per parameter with fp32 AdamW, so 16/N). Before a block's
forward (and again before its backward, with ``reshard_after_forward``), FSDP2 all-gathers the
block's full parameters into a buffer of the block's unsharded size, and frees it after; after the
block's backward it reduce-scatters the full gradients into the sharded ones. So a rank's peak is
the sharded model states, plus its own activations (its 1/N of the global batch), plus about two
blocks' unsharded parameters and gradients in flight (the one computing and the one prefetched):
those are the *communication* buffers of the report. The price is time: every step moves the
parameters twice (three times with resharding) and the gradients once over the interconnect;
FSDP2 overlaps it with compute on its own streams.

- ``reshard_after_forward: false`` keeps each block's gathered parameters from forward to backward
  (no second all-gather; a whole unsharded model of memory, like ZeRO-2).
- ``shard_param_dtype`` / ``shard_reduce_dtype``: FSDP2's ``MixedPrecisionPolicy``: the dtype the
  parameters are gathered and computed in (bf16 halves the buffers and the traffic; the sharded
  fp32 master weights stay), and the dtype gradients are reduced in.
- ``shard_offload: true``: ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer
  states live in host memory, and the optimizer steps on the CPU (device memory: activations and
  the buffers in flight; time: the host link and a CPU optimizer).

Sharding is applied per repeated block (memfit.techniques.checkpointing.find_blocks), then to the
root, after checkpointing has wrapped the blocks. The batch is the *global* batch: each rank runs
``batch / world_size`` samples (split further by micro-batching), and FSDP2 averages the gradients,
so N ranks train as one process on the whole batch does.

``optimizer_in_backward`` composes: FSDP2 runs a sharded parameter's post-accumulate-grad hooks
once it has reduce-scattered that parameter's gradient, so each rank steps its shards as they
arrive and frees them (what torchtune's optimizer-in-backward recipes rely on).

``compile: blocks`` composes: blocks are compiled (technique order 25) before they are sharded
(order 50), as torchtitan compiles each block and then calls ``fully_shard`` on it, so FSDP2's pre-
and post-forward hooks gather and free the parameters around the compiled forward; the compiled
graph sees the unsharded parameters as inputs.

A fake trace (``estimate``) runs one rank against PyTorch's fake process group (no other process:
its collectives do nothing, their buffers are real allocations of the trace). A real step needs
one process per rank with a process group initialised (``torchrun``).

Plan keys: ``shard`` (auto: fsdp when ``world_size`` > 1 | none | fsdp), ``world_size``, ``reshard_after_forward``, ``shard_param_dtype``,
``shard_reduce_dtype``, ``shard_offload``.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

from memfit.errors import UserError
from memfit.techniques.base import Config, Export, Key, Technique, choice, register, whole_number
from memfit.techniques.timeline_marks import mark, watching_tracker

FSDP_STREAMS = 10
"""Numbers of FSDP2's streams in the caching-allocator model start here (0: the default stream)."""
DTYPES = ("none", "bf16", "fp16", "fp32")
"""``shard_param_dtype`` / ``shard_reduce_dtype`` values (none: as the parameters are)."""


class Sharding(Config):
    world_size = 1
    fsdp2 = False
    """The step is sharded with FSDP2 (its buffers are booked as communication)."""

    def rank_batch(self, batch_size: int) -> int:
        """The samples one rank runs of a global batch."""
        return batch_size


@dataclass(frozen=True)
class NoSharding(Sharding):
    """One process holds the whole model."""

    def values(self) -> dict:
        return {"shard": "auto", "world_size": 1, "reshard_after_forward": True, "shard_param_dtype": "none",
                "shard_reduce_dtype": "none", "shard_offload": False}


@dataclass(frozen=True)
class FSDP2(Sharding):
    """FSDP2 ``fully_shard`` per repeated block, then the root, over ``world_size`` ranks."""

    world_size: int = 1
    """Ranks (processes, one per GPU) the model is sharded over."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (gather again for backward)."""
    param_dtype: str = "none"
    """``MixedPrecisionPolicy.param_dtype``: the dtype parameters are gathered and computed in."""
    reduce_dtype: str = "none"
    """``MixedPrecisionPolicy.reduce_dtype``: the dtype gradients are reduce-scattered in."""
    offload: bool = False
    """``CPUOffloadPolicy``: sharded parameters, gradients and optimizer states in host memory."""
    rank = 1
    fsdp2 = True

    def values(self) -> dict:
        return {"shard": "fsdp", "world_size": self.world_size, "reshard_after_forward": self.reshard_after_forward,
                "shard_param_dtype": self.param_dtype, "shard_reduce_dtype": self.reduce_dtype,
                "shard_offload": self.offload}

    def rank_batch(self, batch_size: int) -> int:
        n = self.world_size
        if n > batch_size:
            raise UserError(f"plan: world_size {n} is larger than the batch ({batch_size}): every rank needs at least "
                            f"one sample; use a batch of at least {n}, or fewer ranks")
        if batch_size % n:
            raise UserError(f"plan: the batch ({batch_size}) does not split evenly over world_size {n}; use a batch "
                            f"that is a multiple of {n}")
        return batch_size // n

    def check(self, plan) -> None:
        def refuse(other: str, why: str) -> None:
            raise UserError(f"plan: shard: fsdp with {other} is not supported yet ({why}); remove one of them")
        if plan.config("compile").mode == "full":
            refuse("compile: full", "it compiles the loss after the blocks are sharded, a composition not tested "
                   "yet; use compile: blocks, which compiles each block before it is sharded")
        if plan.config("offload").states is not None:
            refuse("offload: optimizer_states", "use shard_offload: true, FSDP2's own CPU offload")
        if plan.config("precision").scaled:
            refuse(f"precision: {plan.precision}", "its loss scaler checks each rank's shard of the gradients for overflow "
                   "alone, so the ranks could disagree on skipping a step; use bf16")
        if plan.optimizer == "adamw8bit":
            refuse("optimizer: adamw8bit", "bitsandbytes' 8-bit states do not take DTensor parameters")
        if self.param_dtype != "none" and plan.precision in ("bf16", "fp16", "bf16-base", "fp16-base"):
            raise UserError(f"plan: shard_param_dtype {self.param_dtype} and precision {plan.precision} both cast the "
                            "compute; with FSDP2 use precision fp32 and shard_param_dtype bf16 (torchtitan's mixed "
                            "precision), or shard_param_dtype none")

    # NOTE [ FSDP2's offload on a GPU preset ]
    # ``shard_offload`` is FSDP2's CPUOffloadPolicy. A GPU preset is traced on fake CPU tensors, where its copies
    # between host and device are no-ops: memfit.techniques.shard_offload makes them.
    # The CPU runs it as it is (pinned only beside CUDA tensors: fake tensors have no ``_pin_memory``).
    def apply(self, parts) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from memfit.techniques.checkpointing import find_blocks

        if not dist.is_available():
            raise UserError("shard: fsdp needs torch.distributed, which this PyTorch build lacks")
        if not dist.is_initialized():
            raise UserError(f"shard: fsdp runs one process per rank, each with a process group; train it with memfit "
                            f"train --nproc {self.world_size} (or, from Python, call build_step in each of "
                            f"{self.world_size} torchrun processes); memfit estimate and plan predict one rank")
        if dist.get_world_size() != self.world_size:
            raise UserError(f"plan: world_size {self.world_size} but {dist.get_world_size()} processes were launched; "
                            "launch as many processes as world_size")
        from memfit.techniques import shard_offload
        emulated = self.offload and shard_offload.emulated(parts)  # NOTE [ FSDP2's offload on a GPU preset ]
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():  # (the mesh holds a real tensor of rank numbers)
            mesh = init_device_mesh(parts.device_type, (self.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=_dtype(self.param_dtype), reduce_dtype=_dtype(self.reduce_dtype))
        options = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy,
                       offload_policy=CPUOffloadPolicy(pin_memory=parts.device_type == "cuda") if self.offload
                       else OffloadPolicy())  # (pinned as HostPlacement pins: only beside CUDA tensors)
        for _, children in find_blocks(parts.model):
            for child in children:
                fully_shard(child, **options)
        fully_shard(parts.model, **options)
        if emulated:
            shard_offload.emulate_offload(parts)
        _release_the_whole_model(parts.device_type)

    @contextlib.contextmanager
    def trace_context(self):
        with fake_process_group(self.world_size), fsdp_streams():
            yield

    def notes(self) -> list[str]:
        return [f"one of {self.world_size} ranks, traced against a fake process group: collectives move no data, "
                "their buffers are allocated as FSDP2 allocates them, in its streams' own pools of the caching "
                "allocator (unmeasured on GPUs)"]

    def label(self, batch_size):
        extra = "".join([":keep" if not self.reshard_after_forward else "",
                         f":{self.param_dtype}" if self.param_dtype != "none" else "",
                         ":offload" if self.offload else ""])
        return f"fsdp{self.world_size}{extra}"

    def export(self, into: Export) -> None:
        into.hf["fsdp"] = "full_shard auto_wrap" + (" offload" if self.offload else "")
        into.hf["fsdp_config"] = {"fsdp_version": 2, "reshard_after_forward": self.reshard_after_forward}
        into.lightning.update(strategy="fsdp", devices=self.world_size)
        mixed = self.param_dtype != "none" or self.reduce_dtype != "none"  # (axolotl sets no MixedPrecisionPolicy)
        into.not_carried(self, hf=False, lightning=False, axolotl=mixed)  # (sd-scripts shards no weights)
        into.axolotl.update(fsdp_version=2, fsdp_config={"reshard_after_forward": self.reshard_after_forward,
                                                         "offload_params": self.offload,
                                                         "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
        into.axolotl_notes.append(f"launch it on {self.world_size} GPUs (accelerate launch, or torchrun "
                                  f"--nproc-per-node {self.world_size}): micro_batch_size is each GPU's")
        if mixed:
            into.in_lightning_module(f"FSDP2 MixedPrecisionPolicy(param_dtype={self.param_dtype}, "
                                     f"reduce_dtype={self.reduce_dtype})")


def _release_the_whole_model(device_type: str) -> None:
    """The model was built whole on each rank, then sharded: the caching allocator gives the freed
    whole model's memory back (``torch.cuda.empty_cache``; in a trace, a mark the allocator model
    replays), so a rank's reserved bytes are its share's, not the whole model's."""
    import torch
    mark("empty_cache")
    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """Rank 0 of ``world_size`` on PyTorch's fake backend, for a fake trace (no other process; the
    collectives return at once). An initialised fake group is reused; a real one is refused."""
    import torch.distributed as dist
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise UserError("memfit estimate of a sharded plan runs one fake rank; run it outside torchrun's processes")
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_fake_meshes()


def _forget_fake_meshes() -> None:
    """DTensor caches each op's output sharding by its inputs' specs (in Python and in C++), and a
    mesh of the fake group equals (by hash) the real group's mesh of the same shape: a real rank
    that traced first would get the fake rank 0's mesh back on its outputs. Clear those caches
    after a fake trace."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    _clear_sharding_prop_cache()


@contextlib.contextmanager
def fsdp_streams():
    """FSDP2's device handle during a fake trace: streams and events that run nothing, where what is
    allocated while one of FSDP2's streams is current is booked to that stream's pool of the
    caching-allocator model (GPU presets). The handle stands for CPU tensors (a GPU preset is traced
    on fake CPU tensors here) and, without a GPU, for CUDA ones too (device index 0): FSDP2 asks CUDA
    for streams, events and the current device, which need a GPU."""
    import torch
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_collectives,
        _fsdp_init,
        _fsdp_param_group,
        _fsdp_state,
    )
    modules = (device_mesh, _fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state)
    original = device_mesh._get_device_handle

    mine = ("cpu",) if torch.cuda.is_available() else ("cpu", "cuda")

    def handle(device_type: str = "cuda"):
        return _TracedDevice if device_type in mine else original(device_type)
    saved = [(m, m._get_device_handle) for m in modules if hasattr(m, "_get_device_handle")]
    for m, _ in saved:
        m._get_device_handle = handle
    try:
        yield
    finally:
        for m, fn in saved:
            m._get_device_handle = fn


class _Stream:
    """A stream of the traced device's handle: it runs nothing, and has a number, so that what is
    allocated while it is current goes to its own pool of the caching-allocator model (as on a GPU,
    where FSDP2's all-gather and reduce-scatter buffers come from their streams' pools)."""

    numbers = itertools.count(FSDP_STREAMS)

    def __init__(self, priority: int = 0) -> None:
        self.number = next(self.numbers)

    def wait_stream(self, stream) -> None:
        if getattr(stream, "number", None) == 0:  # FSDP2 orders this stream after the compute stream
            _COMPUTE_WAITS[0] += 1

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event


class _Default(_Stream):
    number = 0

    def __init__(self) -> None:
        pass


_DEFAULT = _Default()


_SIDE: list[int] = []
"""FSDP2 streams made current in a fake trace, innermost last."""
_COMPUTE_WAITS = [0]
"""How many times a fake trace's FSDP2 stream was told to wait for the compute stream."""


def compute_waits() -> int:
    """A count that grows each time one of FSDP2's streams waits for the compute stream (read by
    the planner's op recorder: the next op on those streams starts after the compute stream)."""
    return _COMPUTE_WAITS[0]


def on_fsdp_stream() -> bool:
    """Is one of FSDP2's own streams current (a fake trace's op runs there, not on the compute
    stream)? Read by the planner's op recorder."""
    return bool(_SIDE)


@contextlib.contextmanager
def _on_stream(stream):
    """Storages the trace allocates inside the block are on ``stream`` (the tracker's
    ``side_streams``, read by memfit.memory.allocator; only GPU presets' kernel model keeps them)."""
    tracker = watching_tracker()
    start = len(tracker.state.records) if tracker is not None else 0
    side = bool(getattr(stream, "number", 0))
    if side:
        _SIDE.append(stream.number)
    try:
        yield
    finally:
        if side:
            _SIDE.pop()
        streams = getattr(tracker, "side_streams", None)
        if streams is not None and side:
            for rec in tracker.state.records[start:]:
                streams.setdefault(rec.serial, stream.number)


class _TracedDevice:
    """The device handle FSDP2 gets in a fake trace (see fsdp_streams)."""

    import torch as _torch
    Stream, Event, synchronize = _Stream, _torch.cpu.Event, _torch.cpu.synchronize

    @staticmethod
    def current_stream(device=None):
        return _DEFAULT

    @staticmethod
    def stream(stream):
        return _on_stream(stream)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(index) -> None:
        pass

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True


def on_ranks(plan, world_size: int):
    """``plan`` for a run of ``world_size`` processes (``memfit train --nproc``): a plan of one process
    (world_size 1) is sharded over them with FSDP2; a plan of another world size is refused."""
    config = plan.config("shard")
    if world_size == 1:
        if config.world_size > 1:
            raise UserError(f"plan: world_size {config.world_size}, and this run is one process; train with --nproc "
                            f"{config.world_size}, or use world_size: 1")
        return plan
    if config.world_size == world_size:
        return plan
    if config.world_size > 1:
        raise UserError(f"plan: world_size {config.world_size}, and --nproc {world_size} processes run it; make them "
                        "the same")
    return plan.replace(world_size=world_size)


def _dtype(name: str):
    import torch
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _flag(name: str):
    def parse(text: str) -> bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise UserError(f"--{name.replace('_', '-')} {text!r}: give true or false")
    return parse


def parse(values: dict) -> Sharding:
    kind = choice("shard", values["shard"], ("auto", "none", "fsdp"))
    n = values["world_size"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UserError(f"plan: world_size must be a whole number >= 1, got {n!r}")
    if kind == "auto":  # several ranks are sharded ones
        kind = "fsdp" if n > 1 else "none"
    for key in ("reshard_after_forward", "shard_offload"):
        if not isinstance(values[key], bool):
            raise UserError(f"plan: {key} must be true or false, got {values[key]!r}")
    param_dtype = choice("shard_param_dtype", values["shard_param_dtype"], DTYPES)
    reduce_dtype = choice("shard_reduce_dtype", values["shard_reduce_dtype"], DTYPES)
    if kind == "none":
        if n > 1:
            raise UserError(f"plan: world_size {n} needs shard: fsdp (memfit runs several ranks only sharded, with "
                            "FSDP2); add shard: fsdp, or world_size: 1")
        given = [k for k, default in (("reshard_after_forward", True), ("shard_param_dtype", "none"),
                                      ("shard_reduce_dtype", "none"), ("shard_offload", False)) if values[k] != default]
        if given:
            raise UserError(f"plan: {', '.join(given)} are FSDP2 options; add shard: fsdp, or remove them")
        return NoSharding()
    return FSDP2(world_size=n, reshard_after_forward=values["reshard_after_forward"], param_dtype=param_dtype,
                 reduce_dtype=reduce_dtype, offload=values["shard_offload"])


TECHNIQUE = register(
    Technique("shard", (
        Key("shard", "auto", "Shard the model over ranks: auto (fsdp when world_size > 1) | none | fsdp (FSDP2 "
            "fully_shard).", metavar="SHARD"),
        Key("world_size", 1, "Ranks the global batch and the sharded model are spread over.", annotation="int",
            from_text=whole_number("--world-size"), metavar="N"),
        Key("reshard_after_forward", True, "FSDP2: free gathered parameters after each block's forward.",
            annotation="bool", from_text=_flag("reshard_after_forward"), metavar="BOOL"),
        Key("shard_param_dtype", "none", "FSDP2: dtype parameters are gathered and computed in (none|bf16|fp16|fp32).",
            metavar="DTYPE"),
        Key("shard_reduce_dtype", "none", "FSDP2: dtype gradients are reduced in (none|bf16|fp16|fp32).",
            metavar="DTYPE"),
        Key("shard_offload", False, "FSDP2: keep sharded parameters, gradients and optimizer states in host memory.",
            annotation="bool", from_text=_flag("shard_offload"), metavar="BOOL"),
    ), parse),
    Sharding, NoSharding, FSDP2)
