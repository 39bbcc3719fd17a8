"""Memory timeline of the steady-state step as a PNG, stacked by category."""

from __future__ import annotations

from pathlib import Path

from memfit.errors import UserError
from memfit.memory.categories import CATEGORIES, STEADY_STEP
from memfit.memory.report import Window, step_window
from memfit.memory.tracker import POINTS, MemoryTracker

COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_states": "#55a868", "activations": "#c44e52",
          "temporaries": "#8172b3", "inputs": "#937860", "communication": "#da8bc3", "other": "#8c8c8c"}


def category_timeline(tracker: MemoryTracker, device: str, window: Window, points: int = 2000):
    """(x positions, {category: bytes per position}, phase marks) over the window."""
    recs, events = tracker.state.records, tracker.state.events
    live = dict.fromkeys(CATEGORIES, 0)
    stride = max(1, (window.end - window.start) // points)
    xs, series = [], {c: [] for c in CATEGORIES}
    for i, (serial, sign) in enumerate(events[:window.end]):
        rec = recs[serial]
        if rec.device == device:
            live[tracker.category_of(rec)] += sign * rec.nbytes
        if i >= window.start and ((i - window.start) % stride == 0 or i == window.end - 1):
            xs.append(i - window.start)
            for c in CATEGORIES:
                series[c].append(live[c])
    marks = [(idx - window.start, name) for name, _, idx in tracker.state.marks
             if window.start <= idx < window.end and name not in POINTS]
    return xs, series, marks


def pyplot_for(path: str | Path):
    """(matplotlib.pyplot on the Agg backend, the PNG's path), or the user error saying what is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--timeline needs matplotlib; pip install 'memfit[plots]' (or pip install matplotlib)") from None
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise UserError(f"cannot write {str(path)!r}: folder {str(path.parent)!r} does not exist")
    return plt, path


def save_timeline_png(tracker: MemoryTracker, path: str | Path, *, device: str = "cpu", step: int = STEADY_STEP,
                      title: str = "") -> Path:
    plt, path = pyplot_for(path)
    xs, series, marks = category_timeline(tracker, device, step_window(tracker, step))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.stackplot(xs, *[[b / 2**20 for b in series[c]] for c in CATEGORIES], labels=CATEGORIES,
                 colors=[COLORS[c] for c in CATEGORIES], linewidth=0)
    last = None
    for x, name in marks:
        if name != last:
            ax.axvline(x, color="black", linewidth=0.5, alpha=0.4)
            ax.text(x, ax.get_ylim()[1] * 0.98, name, fontsize=7, rotation=90, va="top", ha="right", alpha=0.7)
        last = name
    ax.set_xlabel("allocation events in the steady-state step")
    ax.set_ylabel("MiB")
    ax.set_title(title or "memory by category")
    ax.legend(loc="lower right", fontsize=7, ncol=2, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
