"""Compiled rows priced two ways: the time model's (the eager step's ops, memory-bound time scaled by a
fusion factor and a memory budget's slowdown fitted on GPT-2) and from the compiled step's own ops (each
Inductor kernel priced by the bytes of its arguments, extern matmuls and attention as they are, the budget's
recomputation in the trace), beside the measured step time of every recorded compiled row of a card.

    PYTHONPATH=. .venv/bin/python -m tools.fit.compiled_ops h200 '^b-'     # the card's rows matching a pattern

Findings of 2026-12-04 are in docs/planner.md ("Compiled steps priced from their own kernels"). Rows that ran
beside other jobs on the card (``overlapped_jobs``) have their host time inflated: only rows that ran alone
judge either way.
"""

from __future__ import annotations

import json
import re
import sys
import warnings


def compiled_ops_seconds(target, k) -> float:
    """``target``'s step seconds priced from its own step's ops (a compiled step's Inductor kernels as
    recorded), with the constants ``k``."""
    from memfit.planner.timing import record_ops, simulate
    return simulate(record_ops(target, as_planned=True), target.device, k).seconds


def compare(card: str, pattern: str) -> list[dict]:
    from memfit.hosts import host_for_row
    from memfit.planner.roofline import H100, for_host
    from memfit.planner.timing import step_seconds
    from memfit.plans import Plan
    from memfit.target import Target
    from tools.gpu.rows import in_todays_fields

    preset = {"h100": "h100-80gb", "h200": "h200-141gb"}[card]
    out = []
    with open(f"tests/data/{card}.jsonl") as f:
        rows = [json.loads(line) for line in f]
    for r in rows:
        if not re.search(pattern, r["case"]) or "compile" not in r["plan"] or not r.get("step_seconds_median"):
            continue
        target = Target.resolve(r["workload"], Plan(**in_todays_fields(r, r["plan"])), r["batch_size"], preset,
                                seq_len=r["seq_len"])
        k = for_host(host_for_row(r, card), H100)
        out.append({"case": f"{card}:{r['case']}", "measured": r["step_seconds_median"],
                    "time_model": step_seconds(target, k).seconds, "compiled_ops": compiled_ops_seconds(target, k),
                    "alone": not r.get("overlapped_jobs")})
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    card, pattern = (args[0] if args else "h200"), (args[1] if len(args) > 1 else ".")
    warnings.simplefilter("ignore")
    print("| row | ran | measured ms | time model ms | error | compiled ops ms | error |\n|---|---|---:|---:|---:|---:|---:|")
    for c in compare(card, pattern):
        m = c["measured"]
        print(f"| {c['case']} | {'alone' if c['alone'] else 'beside 2 jobs'} | {m * 1e3:.1f} | {c['time_model'] * 1e3:.1f} | "
              f"{c['time_model'] / m - 1:+.1%} | {c['compiled_ops'] * 1e3:.1f} | {c['compiled_ops'] / m - 1:+.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
