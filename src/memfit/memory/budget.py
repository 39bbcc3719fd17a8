"""Budget: a memory budget on a device, and what counts against it.

One definition, used by the planner (does a plan fit?), by every report (does the step fit the
device?) and by training (which micro-batch will fit under the enforcement?):

- **What a plan needs** (:meth:`Budget.used_bytes`): on a GPU, the caching allocator's *reserved*
  bytes (its cudaMalloc'd segments, not only the allocated tensors) plus the CUDA context (the
  *allocator side*, :meth:`Budget.allocator_bytes`), plus the part of a paged optimizer's CUDA
  managed memory the card holds beside them: managed memory lives outside PyTorch's allocator but
  inside the card, up to the budget; what does not fit there the driver pages to the host and back
  each step (memfit.memory.managed, NOTE [ Managed memory over the budget ]); on a CPU device,
  device and host bytes together: offloaded copies live in the same physical memory.
- **What the run's enforcement limits** (:meth:`Budget.enforced_bytes`): a budget memfit sets on a
  GPU is the caching allocator's per-process limit, which caps reserved bytes (neither the context
  nor managed memory is in it: a card short for managed memory pages it out instead of raising); on
  a CPU the budget guard counts device bytes (host-placed copies excluded, as on a GPU); with no
  budget set, a GPU's own capacity limits reserved bytes plus the context.

- **What the plan's host copies may hold** (:attr:`Budget.host_bytes`, ``--host-memory``): offloaded
  optimizer states or activations and swapped blocks live in the training machine's memory
  (pinned), which is not the card's: a plan that fits the card but not that machine is killed by the
  OS, not by CUDA. Checked against the step's host peak where a limit is known: the one given, or,
  planning on ``--device cuda``, the memory this machine can still give; a GPU preset has no machine
  of its own, so without ``--host-memory`` it is not checked (the report says so).

The planner plans by the first (conservative: it includes what enforcement does not see, and it
prices the pages that migrate as time: :meth:`Budget.migration`);
adaptation predicts by the second (what decides whether the retried step raises).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memfit.devices import Device, available_host_bytes, host_total_bytes
from memfit.memory.managed import Migration, migration, paged_out_bytes
from memfit.units import parse_size

HEADROOM = 0.10
"""Without a budget, the planner leaves this share of the device free."""


@dataclass(frozen=True)
class Budget:
    bytes: int
    device: Device
    whole_device: bool = False
    """The device's own capacity (nothing set by memfit): the card itself is the limit."""
    host_bytes: int | None = None
    """The training machine's memory a GPU step's host copies may hold at their peak (None: not
    checked; see the module's docstring)."""

    @classmethod
    def of_device(cls, device: Device) -> Budget:
        """All of the device: a GPU's memory, or the memory this machine can still give."""
        capacity = device.total_bytes if device.is_gpu else available_host_bytes()
        return cls(capacity, device, whole_device=True)

    @classmethod
    def resolve(cls, spec: str | int | None, device: Device) -> Budget:
        """``20GiB``, ``80%`` of the device, a number of bytes, or None: the device's capacity
        minus :data:`HEADROOM`."""
        capacity = cls.of_device(device).bytes
        if spec is None:
            return cls(int(capacity * (1 - HEADROOM)), device)
        return cls(parse_size(spec, total_bytes=capacity, what="budget"), device)

    def with_host(self, spec: str | int | None) -> Budget:
        """This budget with the host memory ``--host-memory`` gives: ``64GB``, ``80%`` of this machine's
        memory, or None: on a local GPU (``--device cuda``) what this machine can still give, on a GPU
        preset unchecked. A CPU device counts host copies in :attr:`bytes` already."""
        given = None if spec is None else parse_size(spec, total_bytes=host_total_bytes(), what="--host-memory")
        if not self.device.is_gpu:  # (a bad value is still one: it gets its line)
            return self
        if given is None:
            return replace(self, host_bytes=available_host_bytes()) if self.device.is_local_gpu else self
        return replace(self, host_bytes=given)

    def host_over(self, host_bytes: int) -> bool:
        """A step holding ``host_bytes`` in the training machine's memory does not fit it."""
        return self.host_bytes is not None and host_bytes > self.host_bytes

    def used_bytes(self, report) -> int:
        """What the step needs of the budget (see the module's docstring)."""
        allocator = self.allocator_bytes(report)
        return self.counted(allocator, getattr(report, "managed_bytes", 0)) if self.device.is_gpu else allocator

    def allocator_bytes(self, report) -> int:
        """The allocator side of what the step needs: reserved + CUDA context on a GPU (no managed
        memory); on a CPU, what :meth:`used_bytes` counts."""
        if self.device.is_gpu:
            return _reserved(report) + (report.cuda_context_bytes or 0)
        return report.process_peak_bytes or report.peak_bytes

    def expandable_allocator_bytes(self, report) -> int | None:
        """:meth:`allocator_bytes` of the same step with expandable segments (GPU predictions; None
        where the report has no such figure: memfit.techniques.allocator)."""
        x = getattr(report, "expandable_reserved_bytes", None)
        return None if x is None or not self.device.is_gpu else x + (report.cuda_context_bytes or 0)

    # NOTE [ Managed memory over the budget ]
    # A paged optimizer's states (CUDA managed memory) are not capped by the allocator's limit: the
    # driver keeps on the card what fits beside the allocator's segments and the context, and pages
    # the rest to the host and back each step (bitsandbytes prefetches each state before its update).
    # So a step whose allocator side fits always runs; its managed bytes count against the budget up
    # to what is left of it, and what is over costs time, not an OOM: the migration's seconds are
    # part of the step (memfit.planner.gpu_time). This is how torchtune trains Llama-3-8B with
    # PagedAdamW8bit on a 24 GB card: 15 GiB of states beside 19 GiB reserved. The room left to the
    # managed bytes is the budget's, not the card's: memfit keeps within what the user gave it.
    def counted(self, allocator_bytes: int, managed_bytes: int) -> int:
        """What the budget counts of a step holding ``allocator_bytes`` (reserved + context) and
        ``managed_bytes`` of CUDA managed memory: the allocator side, plus the managed bytes that fit
        beside it (NOTE [ Managed memory over the budget ])."""
        return allocator_bytes + managed_bytes - self.paged_out(allocator_bytes, managed_bytes)

    def paged_out(self, allocator_bytes: int, managed_bytes: int) -> int:
        """The managed bytes that do not fit beside the allocator side under the budget: the driver
        keeps them on the host, and pages them in and out each step."""
        return paged_out_bytes(managed_bytes, self.bytes - allocator_bytes)

    def migration(self, allocator_bytes: int, managed_bytes: int) -> Migration:
        """The managed pages that move over the host link each step, and their time
        (memfit.memory.managed.migration, in the room the budget leaves them)."""
        return migration(managed_bytes, self.bytes - allocator_bytes, self.device.host_link_bandwidth)

    def fits(self, report) -> bool:
        return self.used_bytes(report) <= self.bytes

    def enforced_bytes(self, report) -> int:
        """What the run's enforcement counts (see the module's docstring)."""
        if self.device.is_gpu:
            return _reserved(report) + ((report.cuda_context_bytes or 0) if self.whole_device else 0)
        return report.peak_bytes

    def enforced_fits(self, report) -> bool:
        return self.enforced_bytes(report) <= self.bytes


def _reserved(report) -> int:
    return report.reserved_bytes if report.reserved_bytes is not None else report.peak_bytes
