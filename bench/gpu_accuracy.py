"""GPU-preset prediction vs a real GPU: every case of a ground-truth jsonl, predicted on this CPU.

Each line of the jsonl (``tests/data/h100.jsonl``, recorded on one H100 80GB; see its README)
holds a workload, batch size, sequence length and plan, and what the real steady-state step gave:
``max_memory_allocated`` and ``max_memory_reserved``. This script predicts each case for the
preset of the card it ran on (``h100-80gb``, ``h200-141gb``; fake tensors, no GPU) and prints a markdown table: measured and predicted
allocated peak, error, measured and predicted reserved bytes, error; then the median and worst.

How a row is read and predicted (its plan in today's fields, the library behaviour it recorded) is
``tools/gpu/rows.py``. Where the prediction emulates a recorded library behaviour, the table marks the
case with ``*`` and prints its prediction for the installed versions below the table.

    .venv/bin/python -m bench.gpu_accuracy                       # all cases
    .venv/bin/python -m bench.gpu_accuracy --cases 'gpt2|mha'    # cases whose id matches a regex
    .venv/bin/python -m bench.gpu_accuracy --jobs 2 --json out.jsonl
    .venv/bin/python -m bench.gpu_accuracy --cases lora --times   # and the time model's step times (the card's preset)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

from tools.gpu.rows import load_cases, predict_safe


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="?", default=None, help="ground-truth jsonl (default tests/data/h100.jsonl)")
    ap.add_argument("--cases", default=None, help="only cases whose id matches this regular expression")
    ap.add_argument("--jobs", type=int, default=1, help="predict this many cases in parallel processes")
    ap.add_argument("--json", default=None, help="also write one JSON line per case to this file")
    ap.add_argument("--times", action="store_true",
                    help="also the op-level time model's step time (the card's preset) against the measured median")
    args = ap.parse_args(argv)
    cases = load_cases(args.jsonl)
    if args.cases:
        cases = [c for c in cases if re.search(args.cases, c.get("case") or c.get("id", ""))]
    print("| case | measured GiB | predicted GiB | error | reserved measured | reserved predicted | error | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    if args.jobs > 1:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=4) as pool:
            results = pool.imap(predict_safe, cases)
            rows = [_print(r) for r in results]
    else:
        rows = [_print(predict_safe(c)) for c in cases]
    ok = [r for r in rows if "failed" not in r]
    if ok:
        errs = [abs(r["error"]) for r in ok]
        rerrs = [abs(r["reserved_error"]) for r in ok]
        worst = max(ok, key=lambda r: abs(r["error"]))
        rworst = max(ok, key=lambda r: abs(r["reserved_error"]))
        print(f"\nallocated: median |error| {statistics.median(errs):.2f}%, worst {worst['error']:+.2f}% "
              f"({worst['case']}); within 1%: {sum(e <= 1 for e in errs)}/{len(ok)}, within 3%: "
              f"{sum(e <= 3 for e in errs)}/{len(ok)}")
        print(f"reserved: median |error| {statistics.median(rerrs):.2f}%, worst {rworst['reserved_error']:+.2f}% "
              f"({rworst['case']}); within 5%: {sum(e <= 5 for e in rerrs)}/{len(ok)}")
    emulated = [c for c, r in zip(cases, rows) if r.get("emulated")]
    for c in emulated:
        r = predict_safe(c, emulate=False)
        if "failed" not in r:
            print(f"* {r['case']}: emulating the recorded library behaviour; for the installed versions memfit "
                  f"predicts {_gib(r['predicted'])} GiB ({r['error']:+.2f}%), reserved "
                  f"{_gib(r['reserved_predicted'])} GiB ({r['reserved_error']:+.2f}%)")
    if args.times:
        _print_times(cases)
    failed = [r for r in rows if "failed" in r]
    if failed:
        print(f"{len(failed)} case(s) failed")
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 1 if failed else 0


def _print_times(cases: list[dict]) -> None:
    """The planner's step-time model (memfit.planner.timing) for each case, against its measured
    median step (rows that overlapped other cases' CPU work say so: their CPU-bound times are inflated)."""
    from memfit.planner.timing import step_seconds
    from tools.gpu.rows import as_recorded, target_of
    print("\n| case | measured ms | predicted ms | error |\n|---|---:|---:|---:|")
    for c in cases:
        measured = c.get("step_seconds_median")
        if not measured:
            continue
        try:
            with as_recorded(c):
                predicted = step_seconds(target_of(c)).seconds
        except Exception as e:  # noqa: BLE001 - report and carry on
            print(f"| {c['case']} | {measured * 1e3:.1f} | failed: {type(e).__name__} | |", flush=True)
            continue
        jobs = f" ({c['overlapped_jobs']} overlapped)" if c.get("overlapped_jobs") else ""
        print(f"| {c['case']}{jobs} | {measured * 1e3:.1f} | {predicted * 1e3:.1f} | "
              f"{100 * (predicted / measured - 1):+.1f}% |", flush=True)


def _print(r: dict) -> dict:
    if "failed" in r:
        print(f"| {r['case']} | | | failed: {r['failed']} | | | | |", flush=True)
    else:
        print(f"| {r['case']}{' *' if r.get('emulated') else ''} | {_gib(r['measured'])} | {_gib(r['predicted'])} | {r['error']:+.2f}% | "
              f"{_gib(r['reserved_measured'])} | {_gib(r['reserved_predicted'])} | {r['reserved_error']:+.2f}% | "
              f"{r['seconds']:.1f} |", flush=True)
    return r


if __name__ == "__main__":
    sys.exit(main())
