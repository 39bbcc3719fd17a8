"""Replay the recorded H100 step times against memfit's step-time model (issue 13, part 1).

Every row of ``tests/data/h100.jsonl`` is a (workload, batch, plan) measured on an H100 80GB with
memfit's own TrainStep. Each is traced here once on fake tensors for the ``h100-80gb`` preset
(memfit.planner.timing.step_seconds) and its predicted time set beside the measured one. The
figure the planner ranks by is the ratio of a plan to plain bf16 of the same workload and batch:
printed for every row that has such a baseline, with the Spearman rank correlation of predicted
against measured ratios. Rows 1-39 ran one case at a time; rows 40-75 ran four processes at once
(their CPU-bound times are inflated and noisy), so they are listed apart and not counted.

    .venv/bin/python -m tools.fit.time_constants            # trace every row (cached), print the tables
    .venv/bin/python -m tools.fit.time_constants --fit      # refit the constants on the fit rows

``--fit`` minimises the squared log error of the fit rows' ratios (plus a small weight on every
clean row's absolute time) by Nelder-Mead over the constants' logarithms, and prints the
constants to paste into ``memfit.planner.roofline.Constants``. Each technique is fitted on one
workload's row and held out on the other's (``FIT_CASES``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import sys
import time
import warnings
from pathlib import Path

from memfit.devices import get_device
from memfit.planner.ops import (
    Op,
)
from memfit.planner.timing import H100, Constants, record_ops, time_from_ops
from memfit.plans import Plan
from tools.gpu.rows import (
    CLEAN_ROWS,
    ROOT,
    as_recorded,
    load_rows,
    plan_fields,
    plan_text,
    replaced,
    target_of,
)

warnings.simplefilter("ignore")
COMPILE_DATA = ROOT / "tests" / "data" / "h100-handwritten-gpt2-compile.jsonl"
"""A hand-written GPT-2 bf16 step (batch 8 x 1024), eager and under torch.compile, on the same H100."""
FIT_CASES = {"gpt2-fp32", "gpt2-bf16-blocks", "gpt2-bf16-offact", "gpt2-bf16-mb2", "gpt2-bf16-ema", "gpt2-adafactor",
             "gpt2-bf16-8bit", "gpt2-best", "t-llama4-selective-b2", "t-llama4-offopt-b2", "t-llama4-chunks-b2",
             "t-llama4-pure-8bit-blocks-b2"}
"""The ratio rows the constants are fitted on: each technique on one workload (GPT-2 or 4 Llama layers
at 7B width), held out on the other (fp16 and chunked attention are held out everywhere)."""
PRIOR = {"mm_eff_half": 0.7, "mm_eff_fp32": 0.8, "mm_overhead": 5e-6, "attn_eff_half": 0.4, "attn_eff_fp32": 0.4,
         "mem_eff": 0.75, "custom_elements": 43e9, "kernel": 3e-6, "link_eff": 0.85, "duplex": 1.5, "copy_latency": 10e-6, "host_bw": 10e9,
         "cpu_forward": 15e-6, "cpu_backward": 6e-6, "cpu_optimizer": 10e-6, "cpu_py_mode": 25e-6,
         "cpu_custom": 40e-6, "cpu_step_call": 100e-6, "rnn_step": 25e-6}
"""What the hardware and PyTorch's overheads make likely. The fit is pulled towards these: a factor
of 2 away (4 for the CPU overheads, which vary more between machines) costs as much as one 10% ratio
error. Efficiencies are capped at 1 and ``duplex`` at 2 (copies both ways no slower than in turn)."""
FITTED = tuple(PRIOR)
BASELINE = {"precision": "bf16"}
CACHE_VERSION = 3  # 3: compiled regions' calls and kernels recorded (torchao's update)
"""Bumped when a technique's step changes (cached ops of the old step are not reused)."""


def trace(row: dict, cache: Path | None) -> tuple[list[Op], float]:
    """The steady-state ops of the row's step (cached by row), and the seconds the trace took."""
    path = cache / f"{row['case']}.v{CACHE_VERSION}.pkl" if cache else None
    if path is not None and path.exists():
        ops, seconds = pickle.loads(path.read_bytes())
        return [Op(*o) for o in ops], seconds
    t0 = time.perf_counter()
    with as_recorded(row):  # (the kernels the recorded run reached: rows.recorded_environment)
        ops = record_ops(target_of(row))
    seconds = time.perf_counter() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(([tuple(o) for o in ops], seconds)))
    return ops, seconds


def baselines(rows: list[dict]) -> dict[int, int]:
    """Row index -> index of the plain-bf16 row of the same workload, batch and sequence (clean rows first)."""
    found: dict[tuple, int] = {}
    for i, r in enumerate(rows):
        key = (r["workload"], r["batch_size"], r["seq_len"])
        if r["plan"] == BASELINE and (key not in found or found[key] >= CLEAN_ROWS > i):
            found[key] = i
    out = {}
    for i, r in enumerate(rows):
        j = found.get((r["workload"], r["batch_size"], r["seq_len"]))
        if j is not None and j != i and (i >= CLEAN_ROWS or j < CLEAN_ROWS):
            out[i] = j
    return out


def predict_all(rows, ops, k: Constants) -> list[float]:
    return [time_from_ops(ops[i], target_stub(rows[i]), k).seconds if ops[i] is not None else math.nan
            for i in range(len(rows))]


class _Stub:
    """What time_from_ops reads of a target (the plan and device), without loading the workload."""

    def __init__(self, plan, device):
        self.plan, self.device = plan, device


def target_stub(row: dict):
    return _Stub(Plan(**plan_fields(row)), get_device("h100-80gb"))


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for m in range(i, j + 1):
                r[order[m]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def tables(rows, pred, base) -> str:
    out = ["| # | case | plan | batch | measured ms | predicted ms | measured ratio | predicted ratio | ratio error |"
           " ratio in |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        if i == CLEAN_ROWS:
            out += ["", "Rows 40-75 ran four processes at once (noisy; not counted):", "", out[0], out[1]]
        m, p = r["step_seconds_median"], pred[i]
        ratio = ["", "", "", ""]
        if i in base and not math.isnan(p) and replaced(r):
            ratio = [f"{m / rows[base[i]]['step_seconds_median']:.2f}", f"{p / pred[base[i]]:.2f}",
                     "replaced: re-measure", ""]
        elif i in base and not math.isnan(p):
            mr, pr = m / rows[base[i]]["step_seconds_median"], p / pred[base[i]]
            ratio = [f"{mr:.2f}", f"{pr:.2f}", f"{pr / mr - 1:+.0%}" + (" **miss**" if abs(pr / mr - 1) > 0.15 else ""),
                     "" if i >= CLEAN_ROWS else "fit" if r["case"] in FIT_CASES else "held out"]
        pt = f"{p * 1e3:.1f}" if not math.isnan(p) else "n/a"
        out.append(f"| {i + 1} | {r['case']} | {plan_text(r['plan'])} | {r['batch_size']} | {m * 1e3:.1f} | {pt} | "
                   + " | ".join(ratio) + " |")
    return "\n".join(out)


def ratio_pairs(rows, pred, base, only=None):
    """(measured, predicted) ratios of the clean rows with a baseline (``only``: a row filter)."""
    pairs = []
    for i, j in base.items():
        if i < CLEAN_ROWS and not math.isnan(pred[i]) and not replaced(rows[i]) and (only is None or only(rows[i])):
            pairs.append((rows[i]["step_seconds_median"] / rows[j]["step_seconds_median"], pred[i] / pred[j]))
    return pairs


def objective(rows, ops, base, k: Constants) -> float:
    pred = predict_all(rows, ops, k)
    loss = sum(math.log(p / m) ** 2 for m, p in ratio_pairs(rows, pred, base, lambda r: r["case"] in FIT_CASES))
    absolute = [math.log(pred[i] / rows[i]["step_seconds_median"]) ** 2 for i in range(CLEAN_ROWS)
                if not math.isnan(pred[i]) and not replaced(rows[i])]
    prior = sum((math.log(getattr(k, n) / v) / math.log(4 if n.startswith("cpu_") else 2)) ** 2
                for n, v in PRIOR.items())
    return loss + 0.5 * sum(absolute) / max(1, len(absolute)) + 0.01 * prior


def fit(rows, ops, base, start: Constants, iters: int) -> Constants:
    """Nelder-Mead over the logarithms of the FITTED constants."""
    x0 = [math.log(PRIOR[n]) for n in FITTED]

    def make(x):
        return dataclasses.replace(start, **{n: math.exp(v) for n, v in zip(FITTED, x)})

    def f(x):
        k = make(x)
        if max(k.mm_eff_half, k.mm_eff_fp32, k.mem_eff, k.link_eff, k.attn_eff_half,
               k.attn_eff_fp32) > 1 or not 1 <= k.duplex <= 2:
            return 1e9
        return objective(rows, ops, base, k)
    simplex = [x0] + [[v + (0.3 if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for it in range(iters):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if it % 50 == 0:
            print(f"fit {it}: {values[0]:.4f}", flush=True)
        centroid = [sum(c) / (len(simplex) - 1) for c in zip(*simplex[:-1])]
        worst = simplex[-1]
        refl = [c + (c - w) for c, w in zip(centroid, worst)]
        fr = f(refl)
        if fr < values[0]:
            exp = [c + 2 * (c - w) for c, w in zip(centroid, worst)]
            fe = f(exp)
            simplex[-1], values[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(centroid, worst)]
            fc = f(con)
            if fc < values[-1]:
                simplex[-1], values[-1] = con, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, s)] for s in simplex[1:]]
                values = [values[0]] + [f(s) for s in simplex[1:]]
    return make(min(zip(values, simplex))[1])


def compile_ratio() -> float:
    """Measured compiled / eager step time of the hand-written GPT-2."""
    rec = {r["mode"]: r for r in map(json.loads, COMPILE_DATA.read_text().splitlines())}
    return rec["compile"]["step_s"] / rec["eager"]["step_s"]


def compile_blocks_ratio(rows) -> float:
    """Measured ``compile: blocks`` / eager step time of memfit's own GPT-2 bf16 step (one session)."""
    by = {r["case"]: r for r in rows}
    return by["c-gpt2-bf16-blocks"]["step_seconds_median"] / by["c-gpt2-bf16-eager"]["step_seconds_median"]


def predicted_compile_ratio(rows, ops, k: Constants, mode: str = "full") -> float:
    """Predicted compiled / eager time of memfit's GPT-2 bf16 row (the same model, batch and length)."""
    i = next(i for i, r in enumerate(rows) if r["case"] == "gpt2-bf16")
    row = rows[i]
    compiled = _Stub(Plan(**row["plan"], compile=mode), get_device("h100-80gb"))
    return time_from_ops(ops[i], compiled, k).seconds / time_from_ops(ops[i], target_stub(row), k).seconds


def fit_compile(rows, ops, k: Constants) -> Constants:
    """Bisect the fusion factors so that the predicted compiled/eager ratios are the recorded ones
    (``full``: the hand-written GPT-2; ``blocks``: memfit's own, rows c-gpt2-bf16-*)."""
    for name, mode, want in (("compile_fusion", "full", compile_ratio()),
                             ("compile_fusion_blocks", "blocks", compile_blocks_ratio(rows))):
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            if predicted_compile_ratio(rows, ops, dataclasses.replace(k, **{name: mid}), mode) > want:
                hi = mid
            else:
                lo = mid
        k = dataclasses.replace(k, **{name: (lo + hi) / 2})
    return k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=str(ROOT / "memfit-out" / "planner_gpu_ops"),
                    help="where each row's recorded ops are kept between runs ('' for none)")
    ap.add_argument("--rows", default="", help="row numbers to run, e.g. 1-39 (default: all)")
    ap.add_argument("--fit", type=int, nargs="?", const=1500, default=0, metavar="ITERS",
                    help="refit the constants (Nelder-Mead iterations)")
    args = ap.parse_args()
    rows = load_rows()
    wanted = set(range(len(rows)))
    if args.rows:
        lo, _, hi = args.rows.partition("-")
        wanted = set(range(int(lo) - 1, int(hi or lo)))
    cache = Path(args.cache) if args.cache else None
    ops: list = [None] * len(rows)
    seconds = []
    for i, r in enumerate(rows):
        if i not in wanted:
            continue
        try:
            ops[i], s = trace(r, cache)
            seconds.append(s)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"row {i + 1} {r['case']}: trace failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    base = baselines(rows)
    k = H100
    if args.fit:
        k = fit_compile(rows, ops, fit(rows, ops, base, H100, args.fit))
        print("fitted constants:\n" + "\n".join(f"    {n}: float = {getattr(k, n):.4g}"
                                                  for n in (*FITTED, "compile_fusion", "compile_fusion_blocks")))
    pred = predict_all(rows, ops, k)
    pairs = ratio_pairs(rows, pred, base)
    rho = spearman([m for m, _ in pairs], [p for _, p in pairs])
    within = sum(abs(p / m - 1) <= 0.15 for m, p in pairs)
    clean = [i for i in range(min(CLEAN_ROWS, len(rows))) if not math.isnan(pred[i]) and not replaced(rows[i])]
    rho_abs = spearman([rows[i]["step_seconds_median"] for i in clean], [pred[i] for i in clean])
    print(tables(rows, pred, base))
    held = ratio_pairs(rows, pred, base, lambda r: r["case"] not in FIT_CASES)
    print(f"\nHeld-out ratios: {sum(abs(p / m - 1) <= 0.15 for m, p in held)}/{len(held)} within 15%, "
          f"worst {max(abs(p / m - 1) for m, p in held):.0%}") if held else None
    print(f"\nRatios to plain bf16 (rows 1-39 with a bf16 baseline): {within}/{len(pairs)} within 15%, "
          f"Spearman {rho:.3f}; absolute times, rows 1-39: Spearman {rho_abs:.3f}, median |error| "
          f"{sorted(abs(pred[i] / rows[i]['step_seconds_median'] - 1) for i in clean)[len(clean) // 2]:.0%}")
    if ops[next(i for i, r in enumerate(rows) if r["case"] == "gpt2-bf16")] is not None:
        print(f"compile (GPT-2 bf16, batch 8 x 1024; the fit's one compile point): compiled/eager measured "
              f"{compile_ratio():.3f} (hand-written step), predicted {predicted_compile_ratio(rows, ops, k):.3f}")
    if seconds:
        print(f"trace + record: median {sorted(seconds)[len(seconds) // 2]:.1f} s, max {max(seconds):.1f} s "
              f"per row on {os.cpu_count()} CPU cores (cached rows show the time of their first trace)")


if __name__ == "__main__":
    main()
