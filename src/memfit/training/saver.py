"""A run's saving: each checkpoint written complete, then the older ones beyond the last K removed.

The loop asks for a checkpoint every ``--checkpoint-every`` steps, at the end, when a signal asks
the run to stop (memfit.training.preemption) and on Ctrl-C. :class:`Saver` writes it
(memfit.training.checkpoint, or DCP on several ranks) and only then, on rank 0, removes what the
run no longer keeps (NOTE [ The last good checkpoint stays ] in memfit.training.retention); the
ranks meet once more after that, so no rank starts the next save while rank 0 is still removing.
"""

from __future__ import annotations

from pathlib import Path

from memfit.training import checkpoint, retention

DEFAULT_KEEP = 2


class Saver:
    """Saves one run's checkpoints into ``out_dir`` and keeps its newest ``keep``."""

    def __init__(self, out_dir: Path, *, keep: int, workload: str, requested, ranks=None,
                 resumed: dict | None = None):
        self.out_dir, self.keep, self.workload, self.requested, self.ranks = out_dir, keep, workload, requested, ranks
        self.main = ranks is None or ranks.is_main
        self.last_saved: int = resumed["step"] if resumed else 0
        """The step of the run's newest complete checkpoint (0: none yet)."""
        self.kept: list[Path] = []
        """The run's checkpoints, oldest first: on resume, the one resumed from and those before it."""
        if resumed is not None:
            older = [e for e in retention.complete(out_dir) if e.step <= resumed["step"]]
            self.kept = [e.path for e in reversed(older)]

    def save(self, step, *, index: int, samples_seen: int, rng: dict | None = None) -> Path | None:
        """Write the checkpoint of step ``index`` (none when it is the newest already), then remove
        the checkpoints beyond the newest ``keep``."""
        if index == self.last_saved and self.kept:
            return None
        path = checkpoint.save(self.out_dir, step, step_index=index, samples_seen=samples_seen, workload=self.workload,
                               requested_plan=self.requested, rng=rng, ranks=self.ranks,
                               previous=self.last_saved or None)
        self.last_saved = index
        self.kept = [p for p in self.kept if p.name != path.name] + [path]
        self.kept = self.kept[-self.keep:]
        if self.main:
            retention.prune(self.out_dir, self.kept)
        if self.ranks is not None:
            self.ranks.barrier()
        return path

    def on_interrupt(self, step, *, done: int, samples_seen: int, rng: dict, note) -> None:
        """Ctrl-C in step ``done + 1``: keep the steps done. If nothing of the interrupted step was
        applied yet (no optimizer update, no EMA or scaler update), save the checkpoint of the last
        completed step, with the RNG as it was when the interrupted step began, so ``--resume``
        continues exactly."""
        untouched = step.phase in ("idle", "zero_grad", "forward") or (
            step.phase == "backward" and not step.updates_in_backward)
        last = self.last_saved
        if done <= last:
            note(f"interrupted in step {done + 1}; the checkpoint of step {last} is current: --resume continues")
        elif untouched:
            self.save(step, index=done, samples_seen=samples_seen, rng=rng)
            note(f"interrupted in step {done + 1} ({step.phase}); saved the checkpoint of step {done}: --resume "
                 "continues exactly")
        else:
            note(f"interrupted inside step {done + 1}'s parameter update; the checkpoint of step {last} stays: "
                 "--resume continues from it")
