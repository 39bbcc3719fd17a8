"""The planner's choices at several budgets, next to the fastest plan recorded on the H100 (issue 13).

For GPT-2 124M (batch 8 x 1024) on the ``h100-80gb`` preset, at budgets of 16, 8, 4 and 2 GiB:

- **fastest recorded**: of the plans measured one at a time on the H100 (``tests/data/h100.jsonl``
  rows 1-39), the fastest whose measured footprint fits: ``max_memory_reserved`` plus the CUDA
  context measured before the model was built (what memfit's budget counts on a GPU);
- **memfit among the recorded**: the plan memfit ranks fastest among those same recorded plans,
  on its own predictions (time: the op-level model; footprint: ``estimate``'s reserved bytes +
  context), with what the H100 measured for it: is it within 10% of the fastest, and did it fit;
- **memfit's own choice**: what ``memfit plan`` chooses from its whole search space, with its
  predicted time and footprint, and the measurement when that plan was recorded (else: not
  measured; no GPU was available to measure it).

    .venv/bin/python -m bench.planner_choices              # the table (predictions cached)
    .venv/bin/python -m bench.planner_choices --budgets 8  # one budget
    .venv/bin/python -m bench.planner_choices --rows choices  # against the choices measured 2026-11-27
"""

from __future__ import annotations

import argparse
import pickle
import time
import warnings
from pathlib import Path

from memfit.devices import get_device
from memfit.memory.budget import Budget
from memfit.planner.search import plan
from memfit.planner.timing import trace_step
from memfit.plans import Plan
from memfit.units import fmt_bytes
from tools.gpu.rows import CLEAN_ROWS, ROOT, as_recorded, load_rows, plan_text, target_of

warnings.simplefilter("ignore")

GIB = 2**30
WORKLOAD, BATCH, SEQ = "gpt2", 8, 1024


def recorded_rows(rows: str = "clean") -> list[dict]:
    """``clean``: rows 1-39 (one case at a time); ``choices``: the planner's choices and runners-up of
    2026-11-27 (tools/gpu/choices_session.sh, three cases overlapping their CPU work: one session's
    times, compared among themselves only)."""
    picked = load_rows()[:CLEAN_ROWS] if rows == "clean" else \
        [r for r in load_rows() if r["case"].startswith(("choice", "p-choice"))]
    if rows != "clean":  # the repeat with two cases overlapped (p-), not three, stands for its row
        repeated = {r["case"][2:] for r in picked if r["case"].startswith("p-")}
        picked = [r for r in picked if r["case"] not in repeated]
    return [r for r in picked if r["workload"] == WORKLOAD and r["batch_size"] == BATCH and r["seq_len"] == SEQ]


def measured_used(row: dict) -> int:
    """Reserved bytes plus the CUDA context before the model (the preset's 527 MiB where a row
    overlapped others and could not measure it alone)."""
    return row["max_memory_reserved"] + row.get("device_used_before_model", get_device("h100-80gb").context_bytes)


def predicted(row: dict, cache: Path) -> tuple[int, float]:
    """(footprint the budget counts, step seconds) predicted for a recorded row (cached)."""
    path = cache / f"{row['case']}.pkl"
    if path.exists():
        return pickle.loads(path.read_bytes())
    target = target_of(row)
    with as_recorded(row):
        report, st, _ = trace_step(target)
    out = (Budget.resolve(None, target.device).used_bytes(report), st.seconds)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(out))
    return out


def _model_key() -> str:
    """The cache's folder for this time model (its constants): a changed model predicts anew."""
    import hashlib

    from memfit.planner.roofline import H100
    return hashlib.sha256(repr(H100).encode()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="16,8,4,2", help="GiB, comma-separated")
    ap.add_argument("--cache", default=str(ROOT / "memfit-out" / "planner_choices"))
    ap.add_argument("--rows", choices=["clean", "choices"], default="clean", help="which recorded rows (see "
                    "recorded_rows)")
    args = ap.parse_args()
    rows = recorded_rows(args.rows)
    budgets = [float(b) for b in args.budgets.split(",")]
    chosen = {}
    for gib in budgets:  # first: the planner forks its trace workers before this process runs a backward
        t0 = time.perf_counter()
        result = plan(WORKLOAD, budget=int(gib * GIB), device=get_device("h100-80gb"), batch_size=BATCH, seq_len=SEQ)
        chosen[gib] = result, time.perf_counter() - t0
    pred = {r["case"]: predicted(r, Path(args.cache) / _model_key()) for r in rows}
    by_plan = {Plan(**r["plan"]): r for r in rows}
    out = ["| budget | fastest recorded that fits (measured) | memfit among the recorded: predicted → measured "
           "| within 10%, fits | memfit's own choice (predicted) | measured | planning |",
           "|---|---|---|---|---|---|---|"]
    for gib in budgets:
        budget = int(gib * GIB)
        fits = [r for r in rows if measured_used(r) <= budget]
        best = min(fits, key=lambda r: r["step_seconds_median"]) if fits else None
        ours = [r for r in rows if pred[r["case"]][0] <= budget]
        pick = min(ours, key=lambda r: pred[r["case"]][1]) if ours else None
        result, seconds = chosen[gib]
        out.append("| " + " | ".join([
            f"{gib:g} GiB",
            _row(best, measured=True) if best else "none fits",
            (f"{plan_text(pick['plan'])}: {pred[pick['case']][1] * 1e3:.1f} ms, {fmt_bytes(pred[pick['case']][0])} → "
             f"{_row(pick, measured=True, name=False)}") if pick else "none predicted to fit",
            _verdict(pick, best, budget),
            _choice(result),
            _row(by_plan[result.chosen.plan], measured=True, name=False)
            if result.chosen and result.chosen.plan in by_plan else "not recorded",
            f"{seconds:.0f} s"]) + " |")
    print("\n".join(out))


def _row(r: dict, measured: bool, name: bool = True) -> str:
    text = f"{r['step_seconds_median'] * 1e3:.1f} ms, {fmt_bytes(measured_used(r))}"
    return f"{plan_text(r['plan'])}: {text}" if name else text


def _verdict(pick: dict | None, best: dict | None, budget: int) -> str:
    if pick is None or best is None:
        return "-" if pick is best else "**miss**"
    ratio = pick["step_seconds_median"] / best["step_seconds_median"]
    fits = measured_used(pick) <= budget
    ok = ratio <= 1.10 and fits
    return f"{ratio:.2f}x, {'fits' if fits else 'does not fit'}" + ("" if ok else " **miss**")


def _choice(result) -> str:
    c = result.chosen
    if c is None:
        s = result.smallest
        return f"nothing fits (smallest: {s.plan.short(BATCH)}, {fmt_bytes(s.used_bytes)})" if s else "nothing fits"
    return f"{c.plan.short(BATCH)}: {c.seconds * 1e3:.1f} ms, {fmt_bytes(c.used_bytes)}"


if __name__ == "__main__":
    main()
