"""The end-of-run report: predicted vs measured peak, a memory timeline, what each technique saved.

What each technique saved is an ablation on the estimate: for every technique the plan uses, the
same plan with that one technique taken out is traced on fake tensors (one trace each, seconds
for most models), and its predicted device peak is compared with the plan's. The estimate is the
one TrainStep the run trained with, and the run's measured peak checks the estimate, so the
savings are as exact as the prediction (within 1% on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

from memfit.errors import UserError
from memfit.memory.estimate import estimate_target
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.secrets import redact
from memfit.target import Target
from memfit.units import fmt_bytes

TIMELINE_PNG = "memory-timeline.png"
REPORT_JSON = "report.json"


def without_each_technique(plan: Plan) -> list[tuple[str, Plan]]:
    """(technique, the plan without it) for each memory technique ``plan`` uses (each technique
    names its own ablations: ``Config.ablations``)."""
    return [(name, plan.without(config)) for technique in plan.techniques for name, config in technique.ablations()]


def technique_savings(target: Target, base_peak: int) -> list[dict]:
    """For each technique of the target's plan: the predicted device peak without it and the bytes it saves."""
    rows = []
    for name, without in without_each_technique(target.plan):
        try:
            with silenced_warnings():
                peak = estimate_target(target.with_plan(without)).peak_bytes
        except UserError as e:  # e.g. accumulation needs micro-batches, the 8-bit package is missing
            rows.append({"technique": name, "peak_without_bytes": None, "saved_bytes": None, "note": str(e)})
            continue
        rows.append({"technique": name, "peak_without_bytes": peak, "saved_bytes": peak - base_peak})
    return rows


def write_report(out_dir: Path, summary: dict) -> Path:
    path = out_dir / REPORT_JSON
    path.write_text(redact(json.dumps(summary, indent=2, default=str)) + "\n")
    return path


def render(summary: dict) -> str:
    """The report as text for the terminal."""
    lines = []
    pred, meas = summary.get("predicted_peak_bytes"), summary.get("measured_peak_bytes")
    per_rank = summary.get("measured_peak_bytes_per_rank")
    if pred and per_rank:
        lines.append(f"steady-state peak per rank: predicted {fmt_bytes(pred)}, measured "
                     + ", ".join(f"rank {r} {fmt_bytes(m)} ({100 * (pred - m) / m:+.2f}%)" for r, m in enumerate(per_rank)))
    elif pred and meas:
        lines.append(f"steady-state peak: predicted {fmt_bytes(pred)}, measured {fmt_bytes(meas)} "
                     f"({100 * (pred - meas) / meas:+.2f}%)")
    if summary.get("budget_bytes"):
        lines.append(f"budget {fmt_bytes(summary['budget_bytes'])}"
                     + (f" (enforced by the CPU budget guard; its peak {fmt_bytes(summary['guard_peak_bytes'])})"
                        if summary.get("guard_peak_bytes") else ""))
    for a in summary.get("adaptations", []):
        lines.append(f"adapted at step {a['step']} ({a['phase']}): {a['adaptation']}")
    savings = summary.get("technique_savings") or []
    if savings:
        base = summary.get("plan_device_peak_bytes")
        lines.append(f"what each technique saved (predicted device peak {fmt_bytes(base)} with all of them):")
        for row in savings:
            if row["saved_bytes"] is None:
                lines.append(f"  {row['technique']:<28} n/a ({row['note']})")
            else:
                saved = row["saved_bytes"]
                what = f"saved {fmt_bytes(saved)}" if saved >= 0 else f"costs {fmt_bytes(-saved)}"
                lines.append(f"  {row['technique']:<28} {what:>18}   (peak without it: "
                             f"{fmt_bytes(row['peak_without_bytes'])})")
    if summary.get("timeline_png"):
        lines.append(f"memory timeline: {summary['timeline_png']}")
    return "\n".join(lines)


def final_report(step, out_dir: Path, result) -> dict:
    """Write report.json (and the timeline PNG when matplotlib is installed); returns the summary."""
    target = step.target
    timeline = out_dir / TIMELINE_PNG
    with silenced_warnings():
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            timeline = None
        base = estimate_target(target, timeline=str(timeline) if timeline else None)
    summary = {
        "workload": target.workload.name, "device": target.device.name, "batch_size": target.batch_size,
        "steps": result.steps, "final_loss": result.losses[-1] if result.losses else None,
        "plan": result.plan, "adapted_plan": result.adapted_plan, "adaptations": result.adaptations,
        "predicted_peak_bytes": result.predicted_peak_bytes, "measured_peak_bytes": result.measured_peak_bytes,
        "world_size": result.world_size, "measured_peak_bytes_per_rank": result.measured_peak_bytes_per_rank,
        "budget_bytes": result.budget_bytes, "guard_peak_bytes": result.guard_peak_bytes,
        "plan_device_peak_bytes": base.peak_bytes,
        "technique_savings": technique_savings(target, base.peak_bytes),
        "timeline_png": str(timeline) if timeline else None,
    }
    write_report(out_dir, summary)
    return summary
