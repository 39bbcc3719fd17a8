"""Leak finder: memory a step leaves behind.

In the steady state a training step ends holding what it started with: weights, optimizer
states, gradients (until the next zero_grad) and the batch. Anything else created during the
step and still alive when it ends (a loss kept with its graph, outputs appended to a list, a
cache that grows) is reported with the op and module that created it. Steps 2 and 3 are
compared so a one-off allocation of the first step does not count.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from memfit.memory.tracker import MemoryTracker

EXPECTED = {"parameters", "gradients", "optimizer_states", "inputs"}


@dataclass
class Leak:
    op: str
    module: str
    phase: str
    count: int
    nbytes: int


def find_leaks(tracker: MemoryTracker, step: int) -> list[Leak]:
    """Storages created during ``step`` and alive at the end of the trace, not expected to persist."""
    alive = {serial for serial, _ in tracker.storages.live.values()}
    groups: dict[tuple, list[int]] = defaultdict(list)
    for serial in alive:
        rec = tracker.state.records[serial]
        if rec.step != step or tracker.category_of(rec) in EXPECTED or rec.device == "host":
            continue
        groups[(rec.op, rec.module, rec.phase)].append(rec.nbytes)
    leaks = [Leak(op, module, phase, len(sizes), sum(sizes)) for (op, module, phase), sizes in groups.items()]
    return sorted(leaks, key=lambda x: -x.nbytes)
