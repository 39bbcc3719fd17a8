"""Planner output: ranked table of alternatives and a memory vs time Pareto plot."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.errors import UserError
from memfit.units import fmt_bytes, fmt_rate


def print_plan_result(result, console: Console | None = None, top: int = 12) -> None:
    c = console or Console(highlight=False, soft_wrap=True)
    c.print(f"[bold]memfit plan[/] {result.workload} · batch {result.batch_size} · device {result.device} · "
            f"budget {fmt_bytes(result.budget_bytes)} · {len(result.candidates)} candidate plans, "
            f"{result.traces} traced, {result.seconds:.1f} s")
    c.print(f"[dim]time model: {result.time_model}[/]")
    for note in result.notes:
        c.print(f"[dim]not searched: {escape(note)}[/]")
    for note in result.approximations:
        c.print(f"[yellow]approximation:[/] {escape(note)}")
    if result.run_steps:
        c.print(f"[dim]ms/step: over a run of {result.run_steps} steps, compile time included[/]")
    if result.chosen:
        ch = result.chosen
        compiling = f" · compile {_compile_time(ch)}" if ch.compile_seconds else ""
        c.print(f"[green]chosen:[/] {escape(ch.plan.describe())} · predicted {fmt_bytes(ch.used_bytes)} · "
                f"{ch.seconds * 1e3:.1f} ms/step · {_rate(result, ch)}{compiling}")
        if ch.host_bytes and result.device != "cpu":
            if result.host_budget_bytes is not None:
                c.print(f"host memory: {fmt_bytes(ch.host_bytes)} of the {fmt_bytes(result.host_budget_bytes)} the "
                        "training machine gives (--host-memory) at the peak (offloaded or swapped copies, pinned, and "
                        "paged optimizer states paged out)")
            else:
                c.print(f"[yellow]host memory:[/] {fmt_bytes(ch.host_bytes)} of the training machine's memory at the "
                        "peak (offloaded or swapped copies, pinned, and paged optimizer states paged out), not checked "
                        "against it: give --host-memory "
                        "(e.g. 64GB) to plan within that machine's memory")
        if ch.managed_bytes:
            c.print(f"[dim]paged optimizer states: {fmt_bytes(ch.managed_bytes)} of CUDA managed memory, not in "
                    "torch.cuda.max_memory_reserved(); the memory above counts the part that fits beside the "
                    "allocator's under the budget[/]")
        for note in ch.time_notes:
            c.print(f"[dim]{escape(note)}[/]")
        if ch.plan.numerics:
            c.print(f"[yellow]changes numerics:[/] {escape(', '.join(ch.plan.numerics))} (the updates differ from "
                    "the workload's own fp32 step; see docs/numerics.md)")
        c.print(escape(ch.plan.to_yaml().rstrip()))
    elif (s := result.smallest) is not None:
        c.print(f"[red]nothing fits in {fmt_bytes(result.budget_bytes)}.[/] The smallest footprint found is "
                f"{fmt_bytes(s.used_bytes)} with: {escape(s.plan.describe())}; a budget of at least that would fit.")
    else:
        c.print(f"[red]nothing fits in {fmt_bytes(result.budget_bytes)}.[/]")
    if not result.chosen and (over_host := _over_host(result)):
        least = min(over_host, key=lambda x: x.host_bytes)
        c.print(f"[red]{len(over_host)} plan(s) fit the device but not the host memory[/] "
                f"({fmt_bytes(result.host_budget_bytes)}, --host-memory); the least host memory among them is "
                f"{fmt_bytes(least.host_bytes)}, with: {escape(least.plan.describe())}.")
    t = Table(title="alternatives, fastest first", show_edge=False, pad_edge=False, box=None)
    kept = [x for x in result.candidates if x.status in ("chosen", "not worth it")]  # (always shown)
    big = [x for x in result.candidates if x.status == "too big"][:max(0, top - len(kept))]
    untried = [x for x in result.candidates if x.status == "untried"][:3]  # (faster, not traced: NOTE in memfit.planner.simpler)
    listed = {id(x) for x in kept + big + untried}
    shown = [x for x in result.candidates if id(x) in listed]
    shown += [x for x in result.candidates if x.status == "slower"][:max(3, top - len(shown))]
    compiles = any(x.compile_seconds for x in shown)
    for col, just in (("plan", "left"), ("memory", "right"), ("ms/step", "right"), (result.throughput_unit, "right")) + \
            ((("compile", "right"),) if compiles else ()) + (("status", "left"),):
        t.add_column(col, justify=just)
    for x in shown:
        mem = fmt_bytes(x.used_bytes) if x.used_bytes is not None else "-"
        style = {"chosen": "green", "too big": "red"}.get(x.status, "dim")
        compile_cell = (_compile_time(x) if x.compile_seconds else "-",) if compiles else ()
        t.add_row(escape(x.plan.short(result.batch_size)) + (" *" if x.plan.numerics else ""), mem, f"{x.seconds * 1e3:.1f}",
                  _rate(result, x, unit=False), *compile_cell,
                  f"[{style}]{x.status}[/]: {escape(x.reason)}")
    c.print(t)
    if any(x.plan.numerics for x in shown):
        c.print("[dim]* changes numerics (bf16 weights, low-bit optimizer states, stochastic rounding, quantized "
                "base weights, a different optimizer): its updates differ from the workload's own step[/]")
    different = sorted({n for x in shown for n in x.plan.numerics if n.startswith("different optimizer")})
    for note in different:
        c.print(f"[yellow]{escape(note)}[/]: not AdamW, searched because --optimizers named it")
    pruned = sum(x.status == "pruned" for x in result.candidates)
    if pruned:
        c.print(f"[dim]{pruned} plans pruned without tracing: they save no more memory than a plan that did "
                "not fit[/]")
    _print_recipes(c, result)


def _print_recipes(c: Console, result) -> None:
    """The field's recipes planned beside memfit's own (memfit.planner.field_recipes)."""
    recipes = [x for x in result.candidates if x.recipe is not None]
    if not recipes:
        return
    c.print("[bold]the field's recipes[/] (planned the same way, with this model and batch):")
    for x in recipes:
        mem = fmt_bytes(x.used_bytes) if x.used_bytes is not None else "-"
        style = {"chosen": "green", "too big": "red"}.get(x.status, "dim")
        c.print(f"  {escape(x.recipe.name)}: {escape(x.plan.short(result.batch_size))} · {mem} · "
                f"{x.seconds * 1e3:.1f} ms/step · {_rate(result, x)} · [{style}]{x.status}[/]: {escape(x.reason)}")
        c.print(f"[dim]    from {escape(x.recipe.source)}"
                + (f"; published: {escape(x.recipe.published)}" if x.recipe.published else "") + "[/]")
        for note in x.time_notes:
            c.print(f"[dim]    {escape(note)}[/]")


def print_methods(rows, console: Console | None = None) -> None:
    """``memfit plan --methods``: each method's fastest fitting plan, side by side (rows of
    (Method, PlanResult, trainable parameters))."""
    from memfit.planner.methods import DIFFERENT_THINGS
    c = console or Console(highlight=False, soft_wrap=True)
    first = next((r for _, r, _ in rows if r.least_bytes is None), rows[0][1])  # (a method searched: its unit)
    c.print(f"[bold]memfit plan --methods[/] {first.workload} · batch {first.batch_size} · device {first.device} · "
            f"budget {fmt_bytes(first.budget_bytes)}")
    c.print(f"[yellow]note:[/] {DIFFERENT_THINGS}")
    t = Table(title="each method's fastest plan that fits", show_edge=False, pad_edge=False, box=None)
    for col, just in (("method", "left"), ("trains", "right"), ("plan", "left"), ("memory", "right"),
                      ("ms/step", "right"), (first.throughput_unit, "right")):
        t.add_column(col, justify=just, no_wrap=col in ("method", "memory"))
    for method, result, trainable in rows:
        ch = result.chosen
        if ch:
            cells = (escape(ch.plan.short(result.batch_size)), fmt_bytes(ch.used_bytes), f"{ch.seconds * 1e3:.1f}",
                     _rate(result, ch, unit=False))
        elif result.least_bytes is not None:  # (not searched: its weights alone exceed the budget)
            cells = ("[red]cannot fit[/]: its weights alone", f"need {fmt_bytes(result.least_bytes)}", "-", "-")
        else:
            smallest = fmt_bytes(result.smallest.used_bytes) if result.smallest else "-"
            cells = ("[red]nothing fits[/]", f"needs {smallest}", "-", "-")
        t.add_row(method.name, _count(trainable), *cells)
    c.print(t)
    for method, _, _ in rows:  # (below the table: a column of sentences wrapped each row on a narrow terminal)
        c.print(f"[dim]  {method.name}: {escape(method.trains)}[/]")
    for method, result, _ in rows:  # (why a method cannot fit: its weights' bytes, and what would quantize more)
        if result.least_bytes is not None and result.notes:
            c.print(f"[dim]  {method.name} cannot fit: {escape(result.notes[0])}[/]")


def _rate(result, candidate, unit: bool = True) -> str:
    """The candidate's throughput: tokens/s for a text workload (batch x sequence length a step), else samples/s."""
    rate = result.throughput(candidate)
    text = fmt_rate(rate)
    return f"{text} {result.throughput_unit}" if unit else text


def print_largest_plan(result, console: Console | None = None) -> None:
    """``memfit plan --batch-size max`` (memfit.planner.search_max.LargestPlan): the fastest value and
    plan, the largest value under any plan, and each value searched."""
    from memfit.planner.search_max import throughput
    c = console or Console(highlight=False, soft_wrap=True)
    axis, found = result.sized.axis, result.largest
    c.print(f"[bold]memfit plan[/] {axis.flag} max · budget {fmt_bytes(result.budget_bytes)}")
    if found.value is None:
        c.print(f"[red]nothing fits:[/] {escape(found.describe())} under the most frugal plans; a budget of at least "
                "that would fit")
        return
    if result.best:
        ch = result.best.chosen
        c.print(f"[green]fastest:[/] {axis.show(result.best_value)} with {escape(ch.plan.short(result.best.batch_size))} · "
                f"{fmt_rate(result.throughput)} {result.unit} · {ch.seconds * 1e3:.1f} ms/step · predicted "
                f"{fmt_bytes(ch.used_bytes)}")
    top = f" with {escape(result.largest_plan.short())}" if result.largest_plan else ""
    c.print(f"[green]largest under any plan:[/] {axis.show(found.value)}{top}, {fmt_bytes(found.used_bytes)}; "
            f"{escape(_beyond(found))} ({found.traces} values traced)")
    t = Table(title="the searches, by value", show_edge=False, pad_edge=False, box=None)
    for col, just in ((axis.words, "right"), ("fastest plan that fits", "left"), ("memory", "right"),
                      ("ms/step", "right"), (result.unit, "right")):
        t.add_column(col, justify=just)
    for value, r in sorted(result.searched, key=lambda x: x[0]):
        ch = r.chosen
        if ch is None:
            why = "nothing fits" if r.slower_than is None else \
                f"none faster than {r.slower_than * 1e3:,.0f} ms/step fits (the best {result.unit} found before)"
            t.add_row(axis.number(value), f"[red]{why}[/]", "-", "-", "-")
            continue
        limited = " [yellow](trace limit reached: a faster plan may fit)[/]" if r.limited else ""
        t.add_row(axis.number(value), escape(ch.plan.short(r.batch_size)) + limited, fmt_bytes(ch.used_bytes),
                  f"{ch.seconds * 1e3:.1f}", fmt_rate(throughput(result.sized, value, ch.seconds)))
    c.print(t)


def _beyond(found) -> str:
    if found.next_used_bytes is None:
        return f"{found.axis.show(found.next_value)} is beyond the model ({found.next_error})"
    return f"{found.axis.show(found.next_value)} needs {fmt_bytes(found.next_used_bytes)} under every plan"


def _count(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _compile_time(candidate) -> str:
    """One-time compile seconds (measured here, or predicted from the compiled graph size on GPU presets)."""
    s = candidate.compile_seconds
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def save_pareto_png(result, path: str | Path) -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--pareto needs matplotlib; pip install matplotlib") from None
    path = Path(path)
    if not path.parent.exists():
        raise UserError(f"cannot write {str(path)!r}: folder {str(path.parent)!r} does not exist")
    pts = [x for x in result.candidates if x.used_bytes is not None]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([x.seconds * 1e3 for x in pts], [x.used_bytes / 2**20 for x in pts], c="#8c8c8c", s=18,
               label="evaluated plans")
    if result.chosen:
        ax.scatter([result.chosen.seconds * 1e3], [result.chosen.used_bytes / 2**20], c="#2ca02c", s=80,
                   marker="*", label="chosen")
    ax.axhline(result.budget_bytes / 2**20, color="#d62728", linestyle="--", label="budget")
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("predicted memory (MiB)")
    ax.set_title(f"{result.workload} · batch {result.batch_size} · {result.device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _over_host(result) -> list:
    """The plans that fit the device's budget but were rejected for the host's memory."""
    limit = result.host_budget_bytes
    return [] if limit is None else [x for x in result.candidates if x.status == "too big" and x.host_bytes > limit
                                     and x.used_bytes is not None and x.used_bytes <= result.budget_bytes]
