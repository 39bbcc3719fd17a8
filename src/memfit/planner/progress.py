"""Progress of a plan search on stderr: a live line on a terminal, nothing in logs.

A search first times the techniques (real steps on the CPU; one trace per technique value on GPU
presets), then walks the candidates fastest first, tracing until one fits. Its length is not
known in advance: the bar counts the plans traced against the trace limit (``--max-traces``), and
shows the candidates still open and the seconds so far. Piped to a file or a CI log it writes
nothing: the result's header has the counts.
"""

from __future__ import annotations

import sys
import time


class PlanProgress:
    """``stage(text)`` names what runs now; ``walk(traced, limit, open_plans)`` after each plan the
    walk measures; ``label`` names the search where several run in turn, and :meth:`line` gives each
    of several searches run at once a line of its own (``--methods``: a method each). A no-op unless
    ``stream`` is a terminal."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.label = ""
        self._bar = self._task = None
        self._lines = 0
        self._t0 = time.perf_counter()

    def __enter__(self) -> PlanProgress:
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress
            self._bar = RichProgress(TextColumn("plan {task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                     console=Console(file=self.stream), transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task("timing techniques", total=None, info="")
        return self

    def __exit__(self, *exc) -> bool:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False

    def stage(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=self._named(text), completed=0, total=None, info="")

    def walk(self, traced: int, limit: int, open_plans: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=self._named("traces"), completed=traced, total=limit,
                             info=f"{open_plans} candidates open")

    def rung(self, text: str) -> None:
        """Which evidence is being gathered now (the rung: values alone, shallow traces, a full trace)."""
        if self._bar is not None:
            self._bar.update(self._task, info=text)

    def note(self, text: str) -> None:
        """A line that stays (above the bar on a terminal; in a log too): what the user should know
        while the search runs, such as how long it will take."""
        if self._bar is not None:
            self._bar.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=self.stream, flush=True)

    def _named(self, text: str) -> str:
        return f"{self.label}: {text}" if self.label else text

    def line(self, label: str) -> ProgressLine:
        """A line of its own, for one of several searches that run at once (``--methods``)."""
        return ProgressLine(self, label)


class ProgressLine:
    """One search's line of a :class:`PlanProgress` (the first takes the bar's own line)."""

    def __init__(self, parent: PlanProgress, label: str) -> None:
        self.parent, self.label, self._task = parent, label, None
        bar = parent._bar
        if bar is not None:
            if parent._task is not None and not parent._lines:
                self._task = parent._task
            else:
                self._task = bar.add_task(label, total=None, info="")
            parent._lines += 1

    def stage(self, text: str) -> None:
        if self._task is not None:
            self.parent._bar.update(self._task, description=f"{self.label}: {text}", completed=0, total=None, info="")

    def walk(self, traced: int, limit: int, open_plans: int) -> None:
        if self._task is not None:
            self.parent._bar.update(self._task, description=f"{self.label}: traces", completed=traced, total=limit,
                                    info=f"{open_plans} candidates open")

    def rung(self, text: str) -> None:
        if self._task is not None:
            self.parent._bar.update(self._task, info=text)

    def done(self, text: str) -> None:
        if self._task is not None:
            self.parent._bar.update(self._task, description=f"{self.label}: {text}", info="")

    def note(self, text: str) -> None:
        self.parent.note(f"{self.label}: {text}")


class NoProgress:
    def stage(self, text: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def done(self, text: str) -> None:
        pass

    def walk(self, traced: int, limit: int, open_plans: int) -> None:
        pass

    def rung(self, text: str) -> None:
        pass
