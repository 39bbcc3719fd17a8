"""Predict a case file's rows on this CPU before a GPU measures them (blind rows).

For each case of a ground-truth case file (tools/gpu/ground_truth.py's format): memfit's prediction
for a GPU preset, made here on fake tensors, appended as one JSON line ``{"case", "preset",
"predicted": {"allocated", "reserved"}, "code_generators", "memfit_commit", "torch", "seconds"}``.
Commit the file before the GPU run: the rows measured later are compared with it, unchanged.

    python -m tools.gpu.predict_cases --cases tools/gpu/compile_blind_cases.json \\
        --out tools/gpu/compile_blind_predicted.jsonl [--preset h100-80gb] [--only REGEX]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
import warnings


def predict_case(case: dict, preset: str) -> dict:
    """memfit's prediction of ``case`` for ``preset`` (the model built as the GPU run builds it)."""
    import torch

    import memfit
    from tools.gpu.ground_truth import resolve_workload
    t0 = time.perf_counter()
    report = memfit.estimate(resolve_workload(case), memfit.Plan(**case["plan"]), batch_size=case["batch_size"],
                             device=preset)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"case": case["case"], "preset": preset,
            "predicted": {"allocated": report.peak_bytes, "reserved": report.reserved_bytes,
                          "managed": report.managed_bytes},
            "code_generators": [a for a in report.approximations if "compiled region predicted with" in a],
            "notes": [a for a in report.approximations if "instead" in a],
            "memfit_commit": commit, "torch": torch.__version__, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True, metavar="FILE.json")
    ap.add_argument("--out", required=True, metavar="FILE.jsonl")
    ap.add_argument("--preset", default="h100-80gb")
    ap.add_argument("--only", metavar="REGEX")
    opts = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    with open(opts.cases) as f:
        cases = [c for c in json.load(f) if not opts.only or re.search(opts.only, c["case"])]
    for case in cases:
        row = predict_case(case, opts.preset)
        with open(opts.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
