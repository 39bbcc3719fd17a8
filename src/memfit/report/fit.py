"""``memfit fit``'s table of cards by methods: on the terminal, as Markdown, and as a picture."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.errors import UserError
from memfit.units import fmt_bytes, fmt_rate

SHORT_UNITS = {"tokens/s": "tok/s", "images/s": "img/s", "samples/s": "samples/s"}


def cell_text(cell, unit: str) -> str:
    """One cell in words: 'b=6 checkpointed 1,234 tok/s', '2 cards: b=4 FSDP2 ...', 'no: ...'."""
    if cell.cannot:
        return f"n/a: {cell.error}"
    if cell.world == 0:
        return f"no: {cell.error}" if cell.error else "no"
    rate = f"{fmt_rate(cell.throughput)} {SHORT_UNITS.get(unit, unit)}" if cell.throughput else "-"
    where = "" if cell.world == 1 else f"{cell.world} cards: "
    host = f", host {fmt_bytes(cell.host_bytes)}" if cell.host_bytes else ""
    return f"{where}b={cell.batch} {cell.recipe}, {rate}{host}"


def _rows(table):
    cards = sorted(table.cards, key=lambda d: d.total_bytes)
    return [(d, [table.cells.get((d.name, m)) for m in table.methods]) for d in cards]


def _recipes(table) -> list[str]:
    """Each recipe shown, with its plan (per method: what the names stand for)."""
    seen: dict[tuple[str, str], set[str]] = {}
    for cell in table.cells.values():
        if cell.plan is not None:
            seen.setdefault((cell.method, cell.recipe), set()).add(cell.plan.short())
    return [f"{method} {recipe}: {' | '.join(sorted(plans))}" for (method, recipe), plans in sorted(seen.items())]


def _passed_over(table) -> list[tuple[str, str, str]]:
    """(method, its cards, what was passed over) for each recipe the host's memory ruled out."""
    seen: dict[tuple[str, str], list[str]] = {}
    for cell in table.cells.values():
        if cell.passed_over:
            seen.setdefault((cell.method, cell.passed_over), []).append(cell.card)
    return [(method, ", ".join(cards), passed) for (method, passed), cards in seen.items()]


def _named(table) -> str:
    """The workload and its sizes, once (an image model's name already says a size other than its own:
    ``dit-flux 1216x832px``)."""
    said = table.sizes.replace(" px", "px") in table.workload
    return table.workload if said or not table.sizes else f"{table.workload} · {table.sizes}"


def _header(table) -> str:
    return (f"{_named(table)} · {len(table.cards)} cards ({table.groups} architectures) · "
            f"{table.traces} traces ({table.full_traces} at full depth"
            + (f"; {table.shared} plans shared by architectures that trace alike" if table.shared else "")
            + f") · {table.seconds:.1f} s")


def print_fit(table, console: Console | None = None) -> None:
    c = console or Console(highlight=False, soft_wrap=True)
    c.print(f"[bold]memfit fit[/] {_header(table)}")
    t = Table(show_edge=False, pad_edge=False, box=None)
    t.add_column("card")
    t.add_column("memory", justify="right")
    for m in table.methods:
        t.add_column(m)
    for d, cells in _rows(table):
        texts = []
        for cell in cells:
            text = escape(cell_text(cell, table.unit)) if cell else "-"
            style = "green" if cell and cell.world == 1 else "yellow" if cell and cell.world else "red"
            texts.append(f"[{style}]{text}[/]")
        t.add_row(d.name, fmt_bytes(d.total_bytes), *texts)
    c.print(t)
    _legend(c.print, table)


def _legend(say, table) -> None:
    share = f"{table.budget} of each card" if table.budget else "each card's capacity less 10%"
    say(f"b: the largest batch that fits (the next one does not) in {share} (reserved + CUDA context); "
        f"{table.unit} predicted on the card; the recipe: the fastest that takes the batch:")
    for line in _recipes(table):
        say(f"  {escape(line)}")
    if table.host_budget_bytes is not None:
        passed = _passed_over(table)
        say(f"host: the training machine's memory the recipe's copies hold (offloaded or paged states, swapped blocks), "
            f"each within {fmt_bytes(table.host_budget_bytes)} (--host-memory)" + ("; passed over:" if passed else ""))
        for method, cards, what in passed:
            say(f"  {method} on {cards}: {escape(what)}")
    elif any(c.host_bytes for c in table.cells.values()):
        say("host: the training machine's memory the recipe's copies hold (offloaded or paged states, swapped blocks); "
            "not checked against any machine: give --host-memory SIZE")


def markdown(table) -> str:
    """The table as Markdown (for a README): a line saying what it is, the table, the recipes."""
    lines = [f"`memfit fit` {_header(table)}", "",
             f"| card | memory | {' | '.join(table.methods)} |", "|---|---:|" + "---|" * len(table.methods)]
    for d, cells in _rows(table):
        texts = [cell_text(c, table.unit).replace("|", "\\|") if c else "-" for c in cells]
        lines.append(f"| {d.name} | {fmt_bytes(d.total_bytes)} | {' | '.join(texts)} |")
    lines.append("")
    _legend(lines.append, table)
    return "\n".join(lines)


COLOURS = {1: "#c7e9c0", 0: "#fcbba1"}
SHARDED = "#fdd49e"


def save_fit_png(table, path: str | Path) -> Path:
    """A picture of the table: a cell per card and method, green where one card takes it, orange
    where several do (FSDP2), red where none does."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--png needs matplotlib; pip install matplotlib") from None
    path = Path(path)
    rows = _rows(table)
    text = [[d.name, fmt_bytes(d.total_bytes)] + [cell_text(c, table.unit).replace(", ", "\n") if c else "-"
                                                  for c in cells] for d, cells in rows]
    colours = [["white", "white"] + [COLOURS.get(c.world, SHARDED) if c else "white" for c in cells]
               for _, cells in rows]
    fig, ax = plt.subplots(figsize=(3 + 3.2 * len(table.methods), 0.55 * (len(rows) + 2)))
    ax.axis("off")
    grid = ax.table(cellText=text, cellColours=colours, colLabels=["card", "memory", *table.methods],
                    loc="center", cellLoc="center")
    grid.auto_set_font_size(False)
    grid.set_fontsize(7)
    grid.scale(1, 2.2)
    ax.set_title(f"memfit fit {_named(table)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
