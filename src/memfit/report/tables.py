"""Terminal tables for estimate and profile."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from memfit.memory.categories import CATEGORIES, DESCRIPTIONS
from memfit.memory.report import MemoryReport
from memfit.units import fmt_bytes


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


def _plan_text(plan: dict) -> str:
    from memfit.plans import Plan
    return escape(Plan.from_dict(plan).describe())


def _batch_text(batch_size: int, plan: dict) -> str:
    """The global batch, and one rank's share when the plan is sharded."""
    world = int(plan.get("world_size") or 1)
    return f"batch {batch_size}" + (f" ({batch_size // world} per rank, one of {world} ranks)" if world > 1 else "")


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:5.1f}%" if whole else "    -"


EXPANDABLE_SAVES = 0.02
"""Expandable segments are shown beside the default's reserved bytes where they hold this share less."""


def _expandable_saves(r: MemoryReport) -> bool:
    """Whether the report shows the reserved bytes with expandable segments (NOTE [ Reserved bytes with
    expandable segments, from the same trace ] in memfit.techniques.allocator)."""
    x = r.expandable_reserved_bytes
    return x is not None and r.reserved_bytes is not None and x < r.reserved_bytes * (1 - EXPANDABLE_SAVES)


def print_estimate(r: MemoryReport, console: Console | None = None, host_limit: int | None = None) -> None:
    """The estimate's table; ``host_limit``: the training machine's memory (``--host-memory``) the host
    copies are held to (None: not checked)."""
    c = console or _console()
    how = {"fake": "traced on fake tensors", "real-fallback": "measured by a real run (fake tracing failed)",
           "real": "measured"}[r.method]
    c.print(f"[bold]memfit estimate[/] {r.workload} · {_batch_text(r.batch_size, r.plan)} · plan: {_plan_text(r.plan)} "
            f"({r.precision}) · "
            f"device {r.device} · {how} in {r.trace_seconds:.1f} s")
    t = Table(show_edge=False, pad_edge=False, box=None)
    t.add_column("category")
    t.add_column("bytes at peak", justify="right")
    t.add_column("share", justify="right")
    t.add_column("what", style="dim")
    for cat in CATEGORIES:
        t.add_row(cat, fmt_bytes(r.breakdown[cat]), _pct(r.breakdown[cat], r.peak_bytes), DESCRIPTIONS[cat])
    label = "peak allocated" if r.reserved_bytes is not None else "peak"
    t.add_row(f"[bold]{label}[/]", f"[bold]{fmt_bytes(r.peak_bytes)}[/]", "", f"during {r.peak_phase}")
    if r.host_peak_bytes:
        t.add_row("host memory", fmt_bytes(r.host_peak_bytes), "", "peak of offloaded copies (not on the device)")
    if r.load_peak_bytes:
        reserved = f", {fmt_bytes(r.load_reserved_bytes)} reserved" if r.load_reserved_bytes is not None else ""
        t.add_row("loading the model", fmt_bytes(r.load_peak_bytes), "", f"peak while it loads, before its first batch{reserved}")
        if r.weights_load_peak_bytes and r.weights_load_peak_bytes < 0.99 * r.load_peak_bytes:
            alone = f", {fmt_bytes(r.weights_load_reserved_bytes)} reserved" if r.weights_load_reserved_bytes else ""
            t.add_row("  its weights alone", fmt_bytes(r.weights_load_peak_bytes), "",
                      f"until the last weight arrives (from_pretrained), before the plan prepares the model{alone}")
    if r.reserved_bytes is not None:
        t.add_row("reserved", fmt_bytes(r.reserved_bytes), "", "held by the CUDA caching allocator")
        if _expandable_saves(r):
            t.add_row("  with expandable", fmt_bytes(r.expandable_reserved_bytes), "",
                      "the same step, allocator: expandable")
        t.add_row("CUDA context", fmt_bytes(r.cuda_context_bytes), "", "outside PyTorch's allocator")
        allocator = r.reserved_bytes + r.cuda_context_bytes
        paged_out = r.paged_out_bytes
        if r.managed_bytes:
            t.add_row("managed (paged)", fmt_bytes(r.managed_bytes), "",
                      "paged optimizer states: CUDA unified memory, not in max_memory_reserved()")
        if paged_out:
            t.add_row("  paged out", fmt_bytes(paged_out), "",
                      "no room beside the allocator: on the host, migrating in and out each step")
        total = allocator + r.managed_bytes - paged_out
        verdict = "[green]fits[/]" if r.fits else "[red]does not fit[/]"
        t.add_row("[bold]on the device[/]", f"[bold]{fmt_bytes(total)}[/]", "",
                  f"of {fmt_bytes(r.device_total_bytes)}: {verdict}")
    if host_limit is not None and r.host_held_bytes:
        verdict = "[green]fits[/]" if r.host_held_bytes <= host_limit else "[red]does not fit[/]"
        t.add_row("[bold]on the host[/]", f"[bold]{fmt_bytes(r.host_held_bytes)}[/]", "",
                  f"of {fmt_bytes(host_limit)} (--host-memory): {verdict}")
    c.print(t)
    _print_modules(c, r)
    for fact in r.facts:
        c.print(escape(fact))
    _print_approximations(c, r.approximations)


def _print_modules(c: Console, r: MemoryReport, top: int = 5) -> None:
    if r.activations_by_module:
        items = list(r.activations_by_module.items())[:top]
        c.print("largest activations at the peak: " + ", ".join(f"{m} {fmt_bytes(b)}" for m, b in items))


def print_modules(r: MemoryReport, top: int, console: Console | None = None) -> None:
    """Per-module table: activations and all bytes at the peak, by the module that created them."""
    c = console or _console()
    t = Table(title=f"memory at the peak by module (top {top})", show_edge=False, pad_edge=False, box=None)
    t.add_column("module")
    t.add_column("activations", justify="right")
    t.add_column("all categories", justify="right")
    for module, nbytes in list(r.by_module.items())[:top]:
        t.add_row(module, fmt_bytes(r.activations_by_module.get(module, 0)), fmt_bytes(nbytes))
    c.print(t)


def _print_leaks(c: Console, leaks: list[dict]) -> None:
    if not leaks:
        c.print("[green]leak finder:[/] nothing created by the step outlives it (besides weights, gradients, "
                "optimizer states)")
        return
    total = sum(x["nbytes"] for x in leaks)
    c.print(f"[red]leak finder:[/] {fmt_bytes(total)} created by the step is still held after it:")
    for x in leaks[:5]:
        c.print(f"  {fmt_bytes(x['nbytes'])} in {x['count']} tensor(s) from {x['op']} in {x['module']} ({x['phase']})")


def _print_approximations(c: Console, approximations: list[str]) -> None:
    for a in approximations:
        c.print(f"[yellow]approximation:[/] {escape(a)}")


def print_profile(result, console: Console | None = None) -> None:
    c = console or _console()
    m, p = result.measured, result.predicted
    cuda = getattr(result, "measured_by", "profiler") == "cuda-allocator"
    c.print(f"[bold]memfit profile[/] {m.workload} · {_batch_text(m.batch_size, m.plan)} · plan: {_plan_text(m.plan)} · "
            f"device {m.device}")
    t = Table(show_edge=False, pad_edge=False, box=None)
    t.add_column("category")
    t.add_column("predicted", justify="right")
    t.add_column("measured", justify="right")
    for cat in CATEGORIES:
        t.add_row(cat, fmt_bytes(p.breakdown[cat]), fmt_bytes(m.breakdown[cat]))
    label = "peak allocated" if cuda else "peak"
    t.add_row(f"[bold]{label}[/]", f"[bold]{fmt_bytes(result.predicted_peak_bytes)}[/]", f"[bold]{fmt_bytes(m.peak_bytes)}[/]")
    if cuda:
        predicted_reserved = fmt_bytes(p.reserved_bytes) if p.reserved_bytes is not None else "-"
        t.add_row("[bold]peak reserved[/]", f"[bold]{predicted_reserved}[/]", f"[bold]{fmt_bytes(m.reserved_bytes)}[/]")
        if p.managed_bytes:
            t.add_row("managed (paged)", fmt_bytes(p.managed_bytes), fmt_bytes(m.managed_bytes))
        if result.device_used_bytes is not None:
            context = (fmt_bytes(p.reserved_bytes + p.cuda_context_bytes + p.managed_bytes)
                       if p.reserved_bytes is not None else "-")
            t.add_row("on the device", context, fmt_bytes(result.device_used_bytes))
    if result.load_peak_bytes is not None and p.load_peak_bytes:
        t.add_row("loading the model", fmt_bytes(p.load_peak_bytes), fmt_bytes(result.load_peak_bytes))
        if cuda and p.load_reserved_bytes is not None and result.load_reserved_bytes is not None:
            t.add_row("  reserved when loaded", fmt_bytes(p.load_reserved_bytes), fmt_bytes(result.load_reserved_bytes))
    if p.host_peak_bytes:
        t.add_row("  of which device", fmt_bytes(p.peak_bytes), "")
        t.add_row("  host (offloaded)", fmt_bytes(p.host_peak_bytes), "")
    c.print(t)
    err = result.error_percent
    style = "green" if abs(err) <= 1 else "yellow" if abs(err) <= 5 else "red"
    c.print(f"prediction error: [{style}]{err:+.3f}%[/] of the measured {'allocated ' if cuda else ''}peak "
            f"({result.predicted_peak_bytes - m.peak_bytes:+,d} bytes) · step time {result.step_seconds * 1e3:.1f} ms (median of "
            f"{len(result.step_seconds_all)})")
    if cuda and result.reserved_error_percent is not None:
        rerr = result.reserved_error_percent
        rstyle = "green" if abs(rerr) <= 1 else "yellow" if abs(rerr) <= 5 else "red"
        c.print(f"reserved error: [{rstyle}]{rerr:+.3f}%[/] of the measured reserved peak "
                f"({p.reserved_bytes - m.reserved_bytes:+,d} bytes)")
    if cuda:
        c.print("[dim]measured: the CUDA caching allocator's max_memory_allocated / max_memory_reserved over the "
                "steady-state step; on the device: total - free after it (CUDA context included); measured breakdown: "
                "memfit's tracker on the real tensors (kernel workspaces show as the difference to the peak)[/]")
    else:
        c.print("[dim]measured peak: PyTorch profiler allocator events; measured breakdown: memfit's tracker on the "
                "real tensors (kernel scratch shows as the difference to the peak)[/]")
    _print_leaks(c, m.leaks)
    _print_approximations(c, p.approximations)
