"""Predict a case file's rows on this CPU before a GPU measures them (blind rows).

For each case of a ground-truth case file (tools/gpu/ground_truth.py's format): memfit's prediction
for a GPU preset, made here on fake tensors, appended as one JSON line ``{"case", "preset",
"predicted": {"allocated", "reserved"}, "code_generators", "memfit_commit", "torch", "seconds"}``.
Commit the file before the GPU run: the rows measured later are compared with it, unchanged.

    python -m tools.gpu.predict_cases --cases tools/gpu/compile_blind_cases.json \\
        --out tools/gpu/compile_blind_predicted.jsonl [--preset h100-80gb] [--only REGEX]

``--times CARD`` (``h100`` or ``h200``) adds ``predicted_step_seconds``: the step time the time model
gives the case on that machine (its card's preset, its host's profile, memfit.hosts), as
``tools/fit/held_out.py`` will predict the measured row (blind held-out plans, issue 51), plus the paged
states' migration where the case's ``leave_bytes`` leaves them too little room.
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


CARD_GPUS = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}


def predict_seconds(case: dict, card: str) -> float:
    """The time model's step seconds for ``case`` on ``card``'s machine, as tools/fit/held_out.py
    prices the row the GPU will record (built as the harness builds it: loaded as a checkpoint)."""
    from tools.fit.held_out import predict
    row = {**case, "card": card, "gpu": CARD_GPUS[card], "load": "checkpoint", "step_seconds_median": 1.0}
    (result,) = predict([row], None)
    return result.predicted


def migration_seconds(case: dict, predicted: dict, preset: str) -> float:
    """Seconds a step spends moving its paged states over the link, where the card the case leaves
    (``leave_bytes``, beside the predicted reserved bytes) has no room for all of them (NOTE [ Pages that
    migrate ] in memfit.memory.managed; held_out.py's time has no budget, so no migration)."""
    from memfit.devices import get_device
    from memfit.memory.managed import migration
    if not predicted.get("managed") or not case.get("leave_bytes"):
        return 0.0
    room = case["leave_bytes"] - predicted["reserved"]
    return migration(predicted["managed"], room, get_device(preset).host_link_bandwidth).seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True, metavar="FILE.json")
    ap.add_argument("--out", required=True, metavar="FILE.jsonl")
    ap.add_argument("--preset", default="h100-80gb")
    ap.add_argument("--only", metavar="REGEX")
    ap.add_argument("--times", choices=sorted(CARD_GPUS), help="also the predicted step seconds on this machine")
    opts = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    with open(opts.cases) as f:
        cases = [c for c in json.load(f) if not opts.only or re.search(opts.only, c["case"])]
    for case in cases:
        row = predict_case(case, opts.preset)
        if opts.times:
            moved = migration_seconds(case, row["predicted"], opts.preset)
            row["predicted_step_seconds"] = {opts.times: round(predict_seconds(case, opts.times) + moved, 5)}
            if moved:
                row["predicted_migration_seconds"] = round(moved, 5)
        with open(opts.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
