"""Rows a device call measured, beside the predictions committed before it (blind): one line a row.

    python -m tools.gpu.compare_blind out/gt.jsonl tools/gpu/users_predicted.jsonl [--card h200]

Each row: allocated and reserved measured against predicted (the preset's), the paged (managed) bytes
apart, the step seconds against the time model's for the card's machine where predicted, the
allocator's retries (a capped allocator frees its cache and tries again before it raises), the error.
"""

from __future__ import annotations

import argparse
import json


def _ratio(predicted, measured) -> str:
    return f"{predicted / measured - 1:+.2%}" if predicted and measured else "-"


def lines(rows: list[dict], predicted: dict[str, dict], card: str) -> list[str]:
    out = []
    for r in rows:
        p = predicted.get(r["case"], {})
        mem = p.get("predicted") or {}
        seconds = (p.get("predicted_step_seconds") or {}).get(card)
        a, res = r.get("max_memory_allocated"), r.get("max_memory_reserved")
        out.append(f"{r['case']}: allocated {a} ({_ratio(mem.get('allocated'), a)}), reserved {res} "
                   f"({_ratio(mem.get('reserved'), res)}), managed {r.get('managed_bytes')} (predicted "
                   f"{mem.get('managed')}), s/step {r.get('step_seconds_median')} ({_ratio(seconds, r.get('step_seconds_median'))}), "
                   f"tokens/s {r.get('tokens_per_second')}, retries {r.get('alloc_retries')}"
                   + (f", error: {r['error'][:160]}" if r.get("error") else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured", metavar="GT.jsonl")
    ap.add_argument("predicted", metavar="PREDICTED.jsonl")
    ap.add_argument("--card", default="h200", help="the machine whose predicted step seconds to compare")
    opts = ap.parse_args(argv)
    with open(opts.predicted) as f:
        predicted = {row["case"]: row for row in map(json.loads, f) if row}
    with open(opts.measured) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    print("\n".join(lines(rows, predicted, opts.card)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
