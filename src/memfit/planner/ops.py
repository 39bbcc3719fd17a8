"""The op vocabulary of the step-time model: one small record per ATen op the step runs.

memfit.planner.opcost's ``OpRecorder`` writes an :class:`Op` for every op of a fake trace's
steady-state step; memfit.planner.timing prices them (memfit.planner.roofline), and the planner's
trace book extrapolates them from shallow traces (memfit.planner.traces). An op is its kind (what
kind of kernel, or none), the phase of the step it runs in, the work it does and its flags (where
and how it runs).
"""

from __future__ import annotations

from typing import NamedTuple

from memfit.step import RUN_WHEN_SKIPPING

# op kinds
VIEW, MATMUL, ATTENTION, MEMORY, FOREACH, H2D, D2H, HOST, SYNC, RNN, SCALAR, COMM, WAIT = range(13)
KIND_NAMES = ("view", "matmul", "attention", "memory", "foreach", "h2d", "d2h", "host", "sync", "rnn", "scalar",
              "comm", "wait")
"""COMM: a collective (``nbytes``: what one rank sends over the interconnect; ``key``: its serial
number, shared with the ops FSDP2 then runs on its streams); WAIT: the compute stream waits for
the collective or stream op of serial ``key`` (it reads what that one wrote). Serial numbers, not
positions: the planner copies and reorders recorded ops (micro-batches, shallow extrapolation). See
NOTE [ Collectives ] in memfit.planner.timing."""
# flags
RECOMPUTE, PY_MODE, SIDE_STREAM, STEP_CALL, CUSTOM, SYNC_AFTER = 1, 2, 4, 8, 16, 32
COMM_STREAM, AFTER_COMPUTE = 512, 1024
"""COMM_STREAM: an op FSDP2 runs on one of its own streams (the copy into the all-gather buffer,
the division of reduced gradients); AFTER_COMPUTE: a collective, or an op on FSDP2's streams, that
first waits for the compute stream (a collective issued on the compute stream itself; FSDP2's
``wait_stream``: before reducing the gradients backward just made, before the first all-gather of
a step)."""
OUT_STREAM, WORKER, BACKGROUND = 64, 128, 256
"""OUT_STREAM: a copy to the host on its own stream (gradients going out as backward makes them);
WORKER: the host update of offloaded optimizer states and its copy back, on a worker thread and
another stream (memfit.techniques.offload_optimizer); BACKGROUND: the EMA's copies and average,
beside the next step (memfit.techniques.ema). See memfit.techniques.placement.running."""
FUSED_HOST = 2048
"""A host op that is torch's fused CPU AdamW/Adam (one multi-threaded pass over the host copies:
the host optimizer's update, timed at ``host_fused_bw``, not ``host_bw``)."""
COMPILED = 4096
"""Inductor's code (NOTE [ Compiled kernels in the step time ]): on a VIEW, one call of a compiled
region (its guards and wrapper, priced ``cpu_compiled_call``); on a MEMORY op, one of its kernels."""
PHASES = ("setup", "zero_grad", "forward", "backward", "optimizer", "idle")
FORWARD, BACKWARD, OPTIMIZER = (PHASES.index(name) for name in ("forward", "backward", "optimizer"))

class Op(NamedTuple):
    kind: int
    phase: int
    flops: float
    """FLOPs (matmuls and attention; 0 for the rest)."""
    nbytes: int
    """Bytes read and written (for host ops: the bytes of its device inputs first copied over)."""
    dtype: str
    """'half', 'fp32' (CUDA cores) or 'tf32' (fp32 convolutions take TF32 tensor cores by default)."""
    tensors: int
    """Tensors a ``_foreach`` op walks; an RNN's sequential steps (time steps x layers x directions)."""
    flags: int
    key: int = 0
    """Side-stream copies: the storage they fill; other ops in the optimizer: a storage they read."""
    host_bytes: int = 0
    """Host ops: bytes read and written on the host."""
    is_causal: bool = False
    elements: int = 0
    """Ops outside ATen: the elements of their largest tensor (their kernels are priced per element)."""


def forward_backward_span(ops: list[Op]) -> tuple[int, int]:
    """The indices of the first forward op and the last backward op (what runs per micro-batch)."""
    first = next((i for i, op in enumerate(ops) if op.phase == FORWARD), 0)
    last = max((i for i, op in enumerate(ops) if op.phase == BACKWARD), default=len(ops) - 1)
    return first, last


def repeat_micro_batch(ops: list[Op], n: int) -> list[Op] | None:
    """The ops of a step of ``n`` micro-batches from those of its trace that ran the first two and the
    last (NOTE [ Repeated micro-batches, traced once ] in memfit.step): the second's ops (from its
    forward to the last one's) once more for each skipped micro-batch. None where the ops do not show
    three micro-batches."""
    starts = [i for i, op in enumerate(ops) if op.phase == FORWARD and (i == 0 or ops[i - 1].phase != FORWARD)]
    if len(starts) != RUN_WHEN_SKIPPING:
        return None
    second, last = starts[1], starts[2]
    return ops[:last] + ops[second:last] * (n - RUN_WHEN_SKIPPING) + ops[last:]
