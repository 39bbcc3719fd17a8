"""GPU-preset prediction vs a real GPU: every case of a ground-truth jsonl, predicted on this CPU.

Each line of the jsonl (``tests/data/h100.jsonl``, recorded on one H100 80GB; see its README)
holds a workload, batch size, sequence length and plan, and what the real steady-state step gave:
``max_memory_allocated`` and ``max_memory_reserved``. This script predicts each case for the
preset of the card it ran on (``h100-80gb``, ``h200-141gb``; fake tensors, no GPU) and prints a markdown table: measured and predicted
allocated peak, error, measured and predicted reserved bytes, error; then the median and worst.

A row without a ``bitsandbytes`` field ran without bitsandbytes: a plan naming ``adamw8bit``
there ran torch's fp32 AdamW, so that is what is predicted.

Library versions: a row records the versions it ran with (rows 1-39: torch 2.11, transformers
5.17; see tests/data/README.md). Where a library changed which kernels a model reaches between that
version and the installed one, the prediction emulates the recorded behaviour and the table marks
the case with ``*`` (its prediction for the installed version is printed below the table):
transformers 5.23 made T5's SDPA position-bias mask contiguous; with 5.17's non-contiguous mask
CUDA's SDPA takes the math path (memfit.memory.cuda.sdpa), with 5.23's the memory-efficient one.

    .venv/bin/python bench/gpu_accuracy.py                       # all cases
    .venv/bin/python bench/gpu_accuracy.py --cases 'gpt2|mha'    # cases whose id matches a regex
    .venv/bin/python bench/gpu_accuracy.py --jobs 2 --json out.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "tests" / "data" / "h100.jsonl"
SHARED = Path("/work/shared/gpu-ground-truth/h100.jsonl")


def load_cases(path: str | os.PathLike | None = None) -> list[dict]:
    """The cases of a ground-truth jsonl (default tests/data/h100.jsonl)."""
    p = Path(path) if path else (DEFAULT if DEFAULT.exists() else SHARED)
    cases = []
    for line in p.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "max_memory_allocated" in row and not row.get("error"):
                cases.append(row)
    return cases


DEVICE_STEP_ROWS = {"gpt2-bf16-offopt", "t-llama4-offopt-b2"}
"""Rows recorded when ``offload: [optimizer_states]`` stepped on the device (before 2026-11-24); that
implementation is ``optimizer_states:step=device`` now."""


def plan_of(case: dict) -> dict:
    """The plan that ran, in today's plan fields: adamw8bit without bitsandbytes on the GPU machine
    fell back to AdamW; optimizer-state offload stepped on the device (``DEVICE_STEP_ROWS``)."""
    plan = dict(case.get("plan") or {})
    if plan.get("optimizer") == "adamw8bit" and not case.get("bitsandbytes"):
        plan["optimizer"] = "adamw"
    return in_todays_fields(case, plan)


def in_todays_fields(case: dict, plan: dict) -> dict:
    """``plan`` of ``case`` with the recorded optimizer-state offload named as it is now."""
    if case.get("case") not in DEVICE_STEP_ROWS:
        return plan
    return {**plan, "offload": ["optimizer_states:step=device" if o == "optimizer_states" else o
                                for o in plan["offload"]]}


RECORDED_TRANSFORMERS = "5.17.0"
"""transformers of rows without a ``transformers`` field (rows 1-39)."""


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("+")[0].split(".")[:2])


@contextlib.contextmanager
def _t5_mask_as_in_transformers_5_17():
    """transformers <= 5.17 handed SDPA T5's position bias in its own (permuted) layout; 5.23
    returns ``position_bias_mask.contiguous()``. Emulated by dropping that call."""
    import transformers.integrations.sdpa_attention as sdpa
    line = "return position_bias_mask.contiguous()"
    original = sdpa.create_position_bias_mask
    source = inspect.getsource(original)
    if line not in source:
        raise RuntimeError("transformers' create_position_bias_mask changed: update the 5.17 emulation")
    namespace: dict = {}
    exec(compile(source.replace(line, "return position_bias_mask"), sdpa.__file__, "exec"), sdpa.__dict__, namespace)
    sdpa.create_position_bias_mask = namespace["create_position_bias_mask"]
    try:
        yield
    finally:
        sdpa.create_position_bias_mask = original


def recorded_environment(case: dict) -> contextlib.AbstractContextManager | None:
    """What to emulate so that the prediction reaches the kernels the recorded run reached (None:
    nothing differs)."""
    import transformers
    recorded = case.get("transformers") or RECORDED_TRANSFORMERS
    if case["workload"].split(":")[0] == "t5" and _version(recorded) < (5, 23) <= _version(transformers.__version__):
        return _t5_mask_as_in_transformers_5_17()
    return None


def preset_for(case: dict) -> str:
    """The preset of the card a row ran on (rows without a ``gpu`` field ran on an H100)."""
    from memfit.devices import preset_for_card
    return preset_for_card(case.get("gpu") or "NVIDIA H100", case.get("gpu_total_bytes"))


def predict(case: dict, device: str | None = None, *, emulate: bool = True) -> dict:
    """Predict one case; returns the case id with measured and predicted bytes and errors.
    ``emulate``: emulate library behaviour of the recorded environment (see the module docstring)."""
    warnings.simplefilter("ignore")
    import memfit
    t0 = time.perf_counter()
    device = device or preset_for(case)
    env = recorded_environment(case) if emulate else None
    with env or contextlib.nullcontext():
        report = memfit.estimate(case["workload"], memfit.Plan(**plan_of(case)), batch_size=case["batch_size"],
                                 seq_len=case.get("seq_len"), device=device)
    alloc, reserved = case["max_memory_allocated"], case["max_memory_reserved"]
    return {"case": case.get("case") or case.get("id"), "measured": alloc, "predicted": report.peak_bytes,
            "error": 100 * (report.peak_bytes - alloc) / alloc,
            "reserved_measured": reserved, "reserved_predicted": report.reserved_bytes,
            "reserved_error": 100 * (report.reserved_bytes - reserved) / reserved,
            "seconds": time.perf_counter() - t0, "emulated": env is not None}


def _predict_safe(case: dict, emulate: bool = True) -> dict:
    try:
        return predict(case, emulate=emulate)
    except Exception as e:  # noqa: BLE001 - report and carry on with the other cases
        return {"case": case.get("case") or case.get("id"), "failed": f"{type(e).__name__}: {str(e)[:200]}"}


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="?", default=None, help="ground-truth jsonl (default tests/data/h100.jsonl)")
    ap.add_argument("--cases", default=None, help="only cases whose id matches this regular expression")
    ap.add_argument("--jobs", type=int, default=1, help="predict this many cases in parallel processes")
    ap.add_argument("--json", default=None, help="also write one JSON line per case to this file")
    args = ap.parse_args(argv)
    cases = load_cases(args.jsonl)
    if args.cases:
        cases = [c for c in cases if re.search(args.cases, c.get("case") or c.get("id", ""))]
    print("| case | measured GiB | predicted GiB | error | reserved measured | reserved predicted | error | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    if args.jobs > 1:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=4) as pool:
            results = pool.imap(_predict_safe, cases)
            rows = [_print(r) for r in results]
    else:
        rows = [_print(_predict_safe(c)) for c in cases]
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
        r = _predict_safe(c, emulate=False)
        if "failed" not in r:
            print(f"* {r['case']}: emulating the recorded library behaviour; for the installed versions memfit "
                  f"predicts {_gib(r['predicted'])} GiB ({r['error']:+.2f}%), reserved "
                  f"{_gib(r['reserved_predicted'])} GiB ({r['reserved_error']:+.2f}%)")
    failed = [r for r in rows if "failed" in r]
    if failed:
        print(f"{len(failed)} case(s) failed")
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 1 if failed else 0


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
