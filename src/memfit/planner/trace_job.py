"""One trace job of the trace book (memfit.planner.traces), as a worker process runs it.

A job is ``(plan, depth or None for full, batch or None for the whole batch)``: the plan's TrainStep
traced on fake tensors (memfit.planner.timing.record_step) at that depth and batch. What comes back is
small (:class:`Traced`), since a worker sends it to the planner's process; a plan's error comes back
as a value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import NamedTuple

import torch

from memfit.errors import UserError
from memfit.memory.budget import Budget
from memfit.memory.deep_stream import Stream, from_tracker
from memfit.memory.report import traced_device
from memfit.planner.ops import repeat_micro_batch
from memfit.planner.shallow import at_depth, offloaded_blocks, shallow_workload
from memfit.planner.stacks import stacks_of
from memfit.planner.timing import record_step
from memfit.quiet import errors_only
from memfit.step import has_repeats, repeats_skipped
from memfit.target import Target
from memfit.techniques.checkpointing import find_blocks
from memfit.techniques.compiled import GraphBreaks


class Traced(NamedTuple):
    """What the book keeps of one trace (small, so a worker process can send it back)."""

    peak_bytes: int
    context_bytes: int
    used_bytes: int
    """The allocator side of what the budget counts (reserved + context on a GPU preset; no managed
    memory: ``managed_bytes``)."""
    ops: list
    stream: Stream | None = None
    """Its allocations (shallow traces of eager plans: memfit.memory.deep_stream)."""
    managed_bytes: int = 0
    """CUDA managed memory (a paged optimizer's states): in none of ``used_bytes``, the peak and the
    stream; per block, so extrapolated with the depth as the peak is."""
    seconds: float = 0.0
    """The trace's CPU seconds in the process that ran it (wall time depends on what else runs)."""
    expandable_used_bytes: int | None = None
    """``used_bytes`` of the same step with expandable segments (NOTE [ Reserved bytes with expandable
    segments, from the same trace ] in memfit.techniques.allocator)."""
    host_bytes: int = 0
    """Peak bytes of the step's copies in host memory (offloaded states or activations, swapped blocks)."""


# NOTE [ Pieces of a broken graph left in Dynamo's cache ]
# A plan with ``compile: full`` whose blocks break the graph is refused (memfit.techniques.compiled.GraphBreaks),
# but the pieces Dynamo compiled around the breaks stay in the cache of each broken frame's code, a block's
# forward among them. A later ``compile: blocks`` trace in the same process (a worker traces many plans) compiles
# that forward as one graph under the same backend, finds the cached pieces, and runs them: the breaks unseen, a
# step partly eager predicted as compiled. None of the pieces is of use, so a trace that ends in GraphBreaks
# drops Dynamo's caches, once the trace has ended (not inside it: Dynamo's state is in use there).
class Tracer:
    """Runs trace jobs for one target (the trace book's workers call it)."""

    def __init__(self, target: Target, meta_model, budget: Budget) -> None:
        self.target, self.budget = target, budget
        # Dynamo notes, once per process, that a checkpoint under torch.compile has a context_fn
        # (memfit's checkpointing passes one): the planner's traces are not the run, and every worker
        # that compiles a checkpointed block would print it (``memfit train`` still shows it).
        errors_only("torch._higher_order_ops.wrap")
        self._meta = meta_model
        self._workloads: dict[int, object] = {}
        found = find_blocks(meta_model)
        self._containers = tuple(name for name, _ in found)
        """The repeated-block containers (their module names give an allocation's block)."""
        self._stacks = stacks_of(meta_model)
        self._full = self._stacks.full if self._stacks else None

    def _swapped_from(self, count: int, depth: int) -> dict[str, int]:
        """Each container's first swapped block at ``depth`` (its blocks' share of the full model's), the
        last ``count`` of all the containers' blocks in order swapped (memfit.techniques.swap_blocks)."""
        lengths = self._stacks.at(depth)
        out, left = {}, count
        for name, n in reversed(list(zip(self._containers, lengths))):
            out[name] = max(0, n - left)
            left = max(0, left - n)
        return out

    @property
    def meta_model(self):
        """The workload's model on the meta device, at full depth (not to be changed)."""
        return self._meta

    def shallow(self, depth: int):
        """The workload cut to ``depth`` blocks (one per depth: its meta model is cut once)."""
        if depth not in self._workloads:
            self._workloads[depth] = shallow_workload(self.target.workload, depth, meta=self._meta)
        return self._workloads[depth]

    def __call__(self, job: tuple) -> Traced | Exception:
        """One trace (run in a worker process): a plan's error comes back as a value."""
        plan, depth, batch = job
        target = self.target
        if batch is not None:
            target = dataclasses.replace(target, batch_size=batch * plan.world_size)  # (``batch``: one rank's)
        # (offloaded and kept blocks keep no stream: NOTE [ A shallow pair of a plan that offloads the first K
        # blocks ]; swapped and resident ones do: NOTE [ Two kinds of block, as two containers ])
        keeps_stream = depth is not None and not offloaded_blocks(plan)
        if depth is not None:
            target = dataclasses.replace(target, workload=self.shallow(depth))
            plan = at_depth(plan, depth, self._full)
        trackers = []
        t0 = time.process_time()
        try:
            target = target.with_plan(plan)
            n = plan.micro_batches(target.batch_size)[1]
            skips = has_repeats(n)  # NOTE [ Repeated micro-batches, traced once ]
            with repeats_skipped() if skips else contextlib.nullcontext():
                report, ops = record_step(target, on_tracker=trackers.append if keeps_stream else None)
            if skips:
                ops = repeat_micro_batch(ops, n)
                if ops is None:  # (not three micro-batches in its ops: traced whole)
                    trackers.clear()
                    report, ops = record_step(target, on_tracker=trackers.append if keeps_stream else None)
        except UserError as e:
            if isinstance(e, GraphBreaks):  # NOTE [ Pieces of a broken graph left in Dynamo's cache ]
                torch._dynamo.reset()
            return e
        except Exception as e:  # noqa: BLE001 - shallow: the model indexes its blocks by a count
            if depth is None:
                raise
            return RuntimeError(f"{type(e).__name__}: {e}")
        stream = None
        if trackers:
            tracker = trackers[0]
            stream = from_tracker(tracker, traced_device(target.device, "fake", target.tensor_device),
                                  getattr(tracker, "side_streams", None), self._containers,
                                  self._swapped_from(int(plan.swap_blocks or 0), depth))
        return Traced(report.peak_bytes, report.cuda_context_bytes or 0, self.budget.allocator_bytes(report), ops, stream,
                      managed_bytes=report.managed_bytes, seconds=time.process_time() - t0,
                      expandable_used_bytes=self.budget.expandable_allocator_bytes(report),
                      host_bytes=report.host_peak_bytes)
