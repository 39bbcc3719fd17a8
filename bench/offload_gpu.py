"""Offload and EMA that cost little time on a GPU (issue 15): each technique against plain bf16.

Four rows, each a pair of plans on the same workload: A = ``{precision: bf16}``, B = A plus the
technique. Moving bytes to the host only pays if the copies hide behind compute; the recorded H100
rows (tests/data/h100.jsonl) show they did not (optimizer-state offload 3.8x on 4 Llama-7B layers,
activation offload 6.4x and a CPU EMA 3.4x on GPT-2). The issue's targets: optimizer-state offload
<= 1.3x on the Llama row, activation offload <= 1.5x and CPU EMA <= 1.1x on GPT-2.
Measured 2026-11-26 on one H100 (16 host cores; ``--only llama4-offopt --repeats 6``,
bench/results/offload_gpu_h100.jsonl): the host step 3.45x, the device step 2.76x (missed).

Each row runs in two fresh processes, one building A first and one B first. A process measures
the peak of the plan it built first as gpu_ground_truth.py does (two warm-up steps,
``reset_peak_memory_stats``, one step, ``max_memory_allocated``; memfit's PeakWindow, the one
``memfit train`` uses), then builds the other plan and times both interleaved (ABAB... turns, each
step synchronised). The ratio is median(B) / median(A) over both processes' timed steps. memfit's
predicted peak (``memfit.estimate``, the card's preset) is set beside each measured one. Steps come
from ``memfit.build_step`` and batches from ``make_batch``: the techniques are memfit's own.

NOTE [ Turns, not single steps ]: the techniques measured here work in the background. A CPU EMA's
worker thread averages the weights while the *next* step runs, and a step waits for the previous
average only when it starts the next one. Alternating single steps would hand B's background work
to A's step (B looks free, A looks slow). So each turn is STEPS_PER_TURN steps of one plan, the
first untimed: it absorbs what the other plan left running, and the timed ones see B's steady
state (each waiting for its own predecessor's work, as in training).

    PYTHONPATH=src python -m bench.offload_gpu                 # on a CUDA GPU, from the repo root
    PYTHONPATH=src python -m bench.offload_gpu --only llama4 --repeats 20 --out x.jsonl   # one row
    .venv/bin/python -m bench.offload_gpu --predicted             # the time model's ratios (no GPU)
    .venv/bin/python -m bench.offload_gpu --cpu-smoke          # no GPU: tiny models on this CPU

The physical bound (issue 51): an offloaded step can be no faster than the largest of three terms,
recorded beside each row: the device's compute (plan A's measured step: the same step without the
copies), the bytes the step moves over the host link at the link's measured bandwidth (pinned copies,
each direction; memfit's recorded ops give the bytes), and the bytes the host update reads and
writes at the host's measured bandwidth for that update (torch's fused CPU AdamW for offloaded
optimizer states, an elementwise average for the EMA). ``B / bound`` is the row's distance from it
(target: <= 1.2x); ``--predicted`` prints the byte terms here, without a GPU.

Without CUDA (or with ``--cpu-smoke``) the same code runs tiny GPT-2 and Llama configs on the CPU:
it proves the script end to end; its times say nothing about a GPU. Each row costs two processes
(imports, two builds, a fake-tensor estimate each); where a session limits one command's time,
run the rows one ``--only`` at a time. Raw results go to ``--out`` as JSON lines (default
bench/results/offload_gpu.jsonl; the smoke: memfit-out/offload_cpu_smoke.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.offload_bound import bound, host_update_bandwidth, link_bandwidth, traffic

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "h100.jsonl"
WARMUP_STEPS = 2
STEPS_PER_TURN = 3
"""Steps a plan runs in a row when the two take turns; the first of each turn is not timed (see
NOTE [ Turns, not single steps ])."""
BF16 = {"precision": "bf16"}
L4 = "llama:num_hidden_layers=4"


@dataclass(frozen=True)
class Row:
    id: str
    workload: str
    batch_size: int
    seq_len: int
    plan_b: dict
    target: float | None
    """The issue's bound on B's step time over A's (None: the issue sets none for this row)."""
    plan_a: dict = field(default_factory=lambda: dict(BF16))
    before_b: dict | None = None
    """The plan whose H100 recording is this row's "before" (default ``plan_b``): the host-step
    optimizer offload's "before" is the device-step one the H100 recorded."""


DEVICE_STEP = {**BF16, "offload": ["optimizer_states:step=device"]}
ROWS = [
    Row("gpt2-offopt", "gpt2", 8, 1024, {**BF16, "offload": ["optimizer_states"]}, None, before_b=DEVICE_STEP),
    Row("llama4-offopt", L4, 2, 2048, {**BF16, "offload": ["optimizer_states"]}, 1.3, before_b=DEVICE_STEP),
    Row("gpt2-offopt-device-step", "gpt2", 8, 1024, DEVICE_STEP, None),
    Row("llama4-offopt-device-step", L4, 2, 2048, DEVICE_STEP, 1.3),
    Row("gpt2-offact", "gpt2", 8, 1024, {**BF16, "offload": ["activations"]}, 1.5),
    Row("gpt2-ema-cpu", "gpt2", 8, 1024, {**BF16, "ema": {"decay": 0.999, "device": "cpu", "every": 1}}, 1.1),
]
SMOKE = {  # the same rows on tiny configs: (workload, batch, seq)
    "gpt2": ("gpt2:n_layer=1,n_embd=64,n_head=2,vocab_size=256,n_positions=64", 2, 64),
    L4: ("llama:num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,"
         "num_key_value_heads=1,vocab_size=256,max_position_embeddings=64", 2, 64),
}


def smoke_rows() -> list[Row]:
    out = []
    for r in ROWS:
        workload, batch_size, seq_len = SMOKE[r.workload]
        out.append(replace(r, workload=workload, batch_size=batch_size, seq_len=seq_len))
    return out


# -- one process: the first plan's peak, then both plans timed interleaved ----------------------------

def measure(job: dict) -> dict:
    """Build ``job['first']``, measure its steady-state peak, build ``job['second']``, time both in
    ``job['repeats']`` interleaved turns each; predict the first plan's peak for ``job['preset']`` (None:
    the preset of the card this runs on)."""
    import torch

    import memfit
    from memfit.memory.measure import PeakWindow
    from memfit.step import make_batch

    cuda = job["device"] == "cuda"
    dev = memfit.get_device(job["device"])
    wl = memfit.load_workload(job["workload"], seq_len=job["seq_len"])
    out: dict = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    preset = job["preset"]
    if cuda:
        from memfit.devices import preset_for_card
        props = torch.cuda.get_device_properties(0)
        out["machine"], preset = props.name, preset or preset_for_card(props.name, props.total_memory)
    out["predicted_on"] = preset

    def build(plan: dict):
        torch.manual_seed(0)
        step = memfit.build_step(wl, memfit.Plan(**plan), job["batch_size"], device=dev)
        batch = make_batch(step.target)
        for _ in range(WARMUP_STEPS):  # the first step creates the optimizer states; the second is steady
            step(batch)
        return step, batch

    def timed(step, batch) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(batch)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with PeakWindow(dev) as window:
            first = build(job["first"])
            with window.step(WARMUP_STEPS):
                first[0](first[1])
            out["peak"] = window.finish(WARMUP_STEPS)
            if cuda:
                out["peak_reserved"] = torch.cuda.max_memory_reserved()
        second = build(job["second"])
        staged = [(key, step.optimizer) for key, (step, _) in (("first", first), ("second", second))
                  if hasattr(step.optimizer, "stages")]  # offloaded states: where the time goes
        for _, opt in staged:
            opt.stages = {}
        out["times_first"], out["times_second"] = [], []
        for _ in range(job["repeats"]):  # NOTE [ Turns, not single steps ]
            for built, times in ((first, out["times_first"]), (second, out["times_second"])):
                turn = [timed(*built) for _ in range(STEPS_PER_TURN)]
                times.extend(turn[1:])
        for key, opt in staged:  # (seconds per step, untimed steps of each turn included)
            out[f"stages_{key}"] = {k: v / opt.stages["steps"] for k, v in opt.stages.items() if k != "steps"}
        del first, second, staged
        if cuda:
            torch.cuda.empty_cache()
        report = memfit.estimate(memfit.load_workload(job["workload"], seq_len=job["seq_len"]),
                                 memfit.Plan(**job["first"]), batch_size=job["batch_size"], device=preset)
        out["predicted"] = report.measurable_peak_bytes
    return out


def run_child(job: dict, timeout: float = 900) -> dict:
    """:func:`measure` in a fresh Python process (no caching-allocator state, handles or peak shared)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "bench.offload_gpu", "--child", json.dumps(job)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"process exited {p.returncode} without a result: {(p.stderr or p.stdout)[-1500:]}"}


def predicted_table(rows: list[Row], preset: str) -> str:
    """The time model's step times of each row's two plans on ``preset`` (fake traces, no GPU), beside
    the recorded ratio and the issue's target: a prediction, never a measurement."""
    from memfit.planner.timing import step_seconds
    from memfit.plans import Plan
    from memfit.target import Target

    lines = [f"predicted by memfit's time model for {preset} (not measured)",
             "| row | recorded (H100) | predicted ratio (B / A) | A ms | B ms | target |", "|---|---:|---:|---:|---:|---:|"]
    seconds: dict = {}
    for r in rows:
        for plan in (r.plan_a, r.plan_b):
            key = (r.workload, r.batch_size, r.seq_len, json.dumps(plan, sort_keys=True))
            if key not in seconds:
                target = Target.resolve(r.workload, Plan(**plan), r.batch_size, preset, seq_len=r.seq_len)
                seconds[key] = step_seconds(target).seconds
        a, b = (seconds[(r.workload, r.batch_size, r.seq_len, json.dumps(p, sort_keys=True))]
                for p in (r.plan_a, r.plan_b))
        before = recorded(r)
        was = f"{before['ratio']:.2f}x" if before else "-"
        bound = f"<= {r.target}x" if r.target else "-"
        lines.append(f"| {r.id} | {was} | {b / a:.2f}x | {a * 1e3:.1f} | {b * 1e3:.1f} | {bound} |")
    return "\n".join(lines)


# -- one row: two processes, A first and B first ------------------------------------------------------

def recorded(row: Row, path: Path = DATA) -> dict:
    """The H100 "before" figures of the row's pair (rows that ran alone on the GPU), or {}. Recorded
    plans are read in today's fields (tools/gpu/rows.py's ``in_todays_fields``)."""
    from tools.gpu.rows import in_todays_fields

    found, shape = {}, (row.workload, row.batch_size, row.seq_len)
    for line in path.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        alone = "overlapped_jobs" not in r and "error" not in r
        if alone and (r.get("workload"), r.get("batch_size"), r.get("seq_len")) == shape:
            for which, plan in (("a", row.plan_a), ("b", row.before_b or row.plan_b)):
                if in_todays_fields(r, r["plan"]) == plan and which not in found:
                    found[which] = r
    if len(found) < 2:
        return {}
    a, b = found["a"], found["b"]
    time_a, time_b = a["step_seconds_median"], b["step_seconds_median"]
    return {"cases": [a["case"], b["case"]], "step_seconds_a": time_a, "step_seconds_b": time_b,
            "ratio": time_b / time_a,
            "peak_a": a["max_memory_allocated"], "peak_b": b["max_memory_allocated"]}


def run_row(row: Row, device: str, preset: str | None, repeats: int, runner=run_child,
            before: dict | None = None) -> dict:
    """Both processes of a row and what the table shows; ``runner`` runs one job (tests: in-process),
    ``before``: the recorded H100 figures to show (default: the row's own, if recorded)."""
    job = {"workload": row.workload, "batch_size": row.batch_size, "seq_len": row.seq_len, "device": device,
           "preset": preset, "repeats": repeats}
    ab = runner({**job, "first": row.plan_a, "second": row.plan_b})
    ba = runner({**job, "first": row.plan_b, "second": row.plan_a})
    out = {**asdict(row), "device": device, "before_h100": recorded(row) if before is None else before}
    errors = [r["error"] for r in (ab, ba) if "error" in r]
    if errors:
        return {**out, "error": " | ".join(errors)}
    times_a, times_b = ab["times_first"] + ba["times_second"], ab["times_second"] + ba["times_first"]
    a, b = statistics.median(times_a), statistics.median(times_b)
    met = None if row.target is None or device != "cuda" else b / a <= row.target
    terms = {}
    if device == "cuda":  # the physical bound beside the row (issue 51)
        moved = traffic(row.workload, row.batch_size, row.seq_len, row.plan_b, ab["predicted_on"])
        terms = bound(moved, a, link_bandwidth(), host_update_bandwidth(fused=moved["fused_host"])
                      if moved["host_bytes"] else None)
        terms["b_over_bound"] = b / terms["bound_s"]
    staged = [r[k] for r, k in ((ab, "stages_second"), (ba, "stages_first")) if k in r]
    return {**out, "machine": ab["machine"], "torch": ab["torch"], "predicted_on": ab["predicted_on"],
            "bound": terms, "stages_b": {k: statistics.mean(st[k] for st in staged) for k in staged[0]} if staged else None,
            "step_seconds_a": a, "step_seconds_b": b, "ratio": b / a, "met": met,
            "peak_a": ab["peak"], "peak_b": ba["peak"],
            "peak_reserved_a": ab.get("peak_reserved"), "peak_reserved_b": ba.get("peak_reserved"),
            "predicted_a": ab["predicted"], "predicted_b": ba["predicted"],
            "times_a": times_a, "times_b": times_b}


# -- the table -----------------------------------------------------------------------------------------

def _mem(n: int | None) -> str:
    if not isinstance(n, int):
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def table(results: list[dict]) -> str:
    lines = ["| row | before ratio (H100, recorded) | after ratio (measured; B / A per step) | target | "
             "met? | memory without / with (measured) | predicted without / with |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for r in results:
        before = r["before_h100"]
        before_text = f"{before['ratio']:.2f}x" if before else "-"
        target = f"<= {r['target']:.1f}x" if r["target"] else "-"
        if "error" in r:
            lines.append(f"| {r['id']} | {before_text} | failed: {r['error'][:120]} | {target} | - | - | - |")
            continue
        met = {True: "yes", False: "no", None: "-" if r["device"] == "cuda" else "n/a (CPU)"}[r["met"]]
        lines.append(f"| {r['id']} | {before_text} | {r['ratio']:.2f}x ({r['step_seconds_b'] * 1e3:.1f} / "
                     f"{r['step_seconds_a'] * 1e3:.1f} ms) | {target} | {met} | {_mem(r['peak_a'])} / "
                     f"{_mem(r['peak_b'])} | {_mem(r['predicted_a'])} / {_mem(r['predicted_b'])} |")
    bounded = [r for r in results if r.get("bound")]
    if bounded:
        lines += ["", "| row | B ms | compute ms | link ms (H2D / D2H bytes) | host update ms (bytes) | bound ms | "
                  "B / bound (target <= 1.2x) |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in bounded:
            t = r["bound"]
            lines.append(f"| {r['id']} | {r['step_seconds_b'] * 1e3:.1f} | {t['compute_s'] * 1e3:.1f} | "
                         f"{t['link_s'] * 1e3:.1f} ({_mem(t['h2d_bytes'])} / {_mem(t['d2h_bytes'])}) | "
                         f"{t['host_s'] * 1e3:.1f} ({_mem(t['host_bytes'])}) | {t['bound_s'] * 1e3:.1f} | "
                         f"{t['b_over_bound']:.2f}x |")
    staged = [r for r in results if r.get("stages_b")]
    if staged:  # offloaded states: where B's step goes (OffloadOptimizerStates.stages, ms per step)
        keys = ("update", "gradient_copies", "copies_back", "held_gradients", "tail")
        lines += ["", "| row | B ms | host updates | waits for gradients | copies back issued | backward waiting to "
                  "free gradients | after backward, waiting for updates |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in staged:
            lines.append(f"| {r['id']} | {r['step_seconds_b'] * 1e3:.1f} | " +
                         " | ".join(f"{r['stages_b'].get(k, 0.0) * 1e3:.1f}" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU (default without CUDA)")
    ap.add_argument("--only", default="", help="comma-separated row ids (or parts of them) to run")
    ap.add_argument("--repeats", type=int, default=None, help="turns per plan per process (GPU 10, CPU 3)")
    ap.add_argument("--preset", default=None, help="device preset memfit predicts for (default: the card's)")
    ap.add_argument("--out", default=None, help="JSON lines of the raw results (overwritten)")
    ap.add_argument("--predicted", action="store_true",
                    help="print memfit's time model's ratios for the full rows on --preset (default h100-80gb); no GPU")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.predicted:
        chosen = [r for r in ROWS if not a.only or any(k in r.id for k in a.only.split(","))]
        print(predicted_table(chosen, a.preset or "h100-80gb"))
        print("\nwhat each row's step moves (the bound's byte terms; the bandwidths are measured on the GPU machine):")
        for r in chosen:
            t = traffic(r.workload, r.batch_size, r.seq_len, r.plan_b, a.preset or "h100-80gb")
            print(f"  {r.id}: host link {_mem(t['h2d_bytes'])} in, {_mem(t['d2h_bytes'])} out; host update "
                  f"{_mem(t['host_bytes'])}{' (fused AdamW)' if t['fused_host'] else ''}")
        return 0
    if a.child:
        try:
            result = measure(json.loads(a.child))
        except Exception as e:  # noqa: BLE001 - reported in the row; the other rows carry on
            import traceback
            result = {"error": f"{type(e).__name__}: {str(e)[:400]} {traceback.format_exc()[-800:]}"}
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    import torch  # the GPU is left to the child processes: no CUDA context here
    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if cuda:
        device, preset, rows = "cuda", a.preset, ROWS
    else:
        device, preset, rows = "cpu", "cpu", smoke_rows()
        print("CPU SMOKE RUN: tiny models on this CPU. These figures prove the script runs end to end;\n"
              "they say nothing about GPU speed or memory. On a CUDA GPU, from the repo root:\n"
              "    PYTHONPATH=src python -m bench.offload_gpu")
    rows = [r for r in rows if not a.only or any(k in r.id for k in a.only.split(","))]
    repeats = a.repeats or (10 if cuda else 3)
    default = "bench/results/offload_gpu.jsonl" if cuda else "memfit-out/offload_cpu_smoke.jsonl"
    out = Path(a.out or ROOT / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with out.open("w") as f:
        for row in rows:
            before = recorded(next(r for r in ROWS if r.id == row.id))  # the smoke shows the full row's
            results.append(run_row(row, device, preset, repeats, before=before))
            f.write(json.dumps(results[-1]) + "\n")
            f.flush()
            print(f"  {row.id}: {'failed' if 'error' in results[-1] else 'done'}", flush=True)
    done = [r for r in results if "error" not in r]
    if done:
        first = done[0]
        print(f"{first['machine']}, torch {first['torch']}; {repeats} turns of {STEPS_PER_TURN - 1} timed "
              f"steps per plan in each of 2 processes per row; predicted for {first['predicted_on']}")
    print(table(results))
    print(f"raw results: {out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
