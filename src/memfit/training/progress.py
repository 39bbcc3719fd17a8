"""Progress of a training run on stderr: a live bar on a terminal, plain lines in logs.

On a terminal the bar (``rich.progress``) shows the step, the loss, tokens (or samples) per second,
the measured peak against the budget, and the time left. Piped to a file or CI log, a line is
written at the first and last step and then at most every ``every_seconds``, so logs stay short.
Adaptations and notes go above the bar either way.
"""

from __future__ import annotations

import sys
import time

from memfit.units import fmt_bytes, fmt_rate


class Progress:
    def __init__(self, total: int, *, start: int = 0, budget_bytes: int | None = None, enabled: bool = True,
                 every_seconds: float = 10.0, stream=None, quiet: bool = False):
        self.total, self.start, self.budget = total, start, budget_bytes
        self.quiet = quiet
        """No notes either (a rank other than 0: rank 0 says the same)."""
        self.enabled, self.every = enabled, every_seconds
        self.stream = stream or sys.stderr
        self._last_line = float("-inf")
        self._bar = None
        self._task = None
        self._console = None

    def __enter__(self) -> Progress:
        if self.enabled and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress
            self._console = Console(file=self.stream)
            self._bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                     TimeRemainingColumn(), console=self._console, transient=False)
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def __exit__(self, *exc) -> bool:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False

    def update(self, step: int, *, loss: float, rate: float, unit: str, peak_bytes: int | None) -> None:
        if not self.enabled:
            return
        peak = fmt_bytes(peak_bytes) if peak_bytes else "-"
        if self.budget:
            peak += f" / {fmt_bytes(self.budget)}"
        info = f"loss {loss:.4f} · {fmt_rate(rate)} {unit}/s · peak {peak}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
            return
        now = time.monotonic()
        if step in (self.start + 1, self.total) or now - self._last_line >= self.every:
            self._last_line = now
            print(f"step {step}/{self.total}  {info}", file=self.stream, flush=True)

    def note(self, message: str) -> None:
        """A line that stays (an adaptation, a warning), printed even when the bar is off."""
        if self.quiet:
            return
        if self._console is not None:
            self._console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)
