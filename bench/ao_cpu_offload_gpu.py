"""memfit's optimizer-state offload against torchao's ``CPUOffloadOptimizer``, on one CUDA GPU.

Issue 29 asks to use torchao's ``CPUOffloadOptimizer`` where it beats memfit's own offload. Both keep
an fp32 master and AdamW's states in pinned host memory, copy each gradient to the host as backward
makes it and step torch's fused CPU AdamW there. They differ in when the host steps: torchao's
``step()`` runs every parameter's update after backward, one after another; memfit's
``offload: [optimizer_states]`` runs each update on a worker thread while backward goes on.

The workload is 4 Llama layers at Llama-2-7B width (batch 2 x 2048 tokens), ``precision: bf16``
(fp32 weights, bf16 autocast), as ``bench/offload_gpu.py``'s ``llama4-offopt`` row:

- A: ``memfit.build_step`` with ``{"precision": "bf16", "offload": ["optimizer_states"]}``;
- B: the workload's own loop (autocast forward, ``backward``, ``step``, ``zero_grad``) with
  ``CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True, lr=1e-4)`` (fused by default).

Two fresh processes, one building A first and one B first; each measures the peak of the one it
built first (two warm-up steps, ``reset_peak_memory_stats``, one step, ``max_memory_allocated``),
then times both in interleaved turns (3 steps a turn, the first untimed). Medians over both
processes. On a CPU (``--device cpu``, tiny config) it is a smoke test: torchao's class needs CUDA.

    run(command="PYTHONPATH=/tmp/site:src python3 -m bench.ao_cpu_offload_gpu --out $OUT/ao_offload.jsonl")
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD, BATCH, SEQ = "llama:num_hidden_layers=4", 2, 2048
PLAN = {"precision": "bf16", "offload": ["optimizer_states"]}
WARMUP, TURN = 2, 3


def _memfit(wl, device):
    import memfit
    from memfit.step import make_batch

    step = memfit.build_step(wl, memfit.Plan(**PLAN), BATCH, device=memfit.get_device(device))
    batch = make_batch(step.target)
    return lambda: step(batch)


def _torchao(wl, device):
    import torch
    from torchao.optim import CPUOffloadOptimizer

    model = wl.model().to(device)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, lr=1e-4)
    with torch.device(device):
        batch = wl.batch(BATCH)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = wl.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


BUILD = {"memfit": _memfit, "torchao": _torchao}


def child(first: str, device: str, repeats: int) -> dict:
    import torch

    import memfit

    wl = memfit.load_workload(WORKLOAD, seq_len=SEQ)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {"first": first, "torch": torch.__version__,
                 "machine": torch.cuda.get_device_name(0) if cuda else "cpu"}
    second = "torchao" if first == "memfit" else "memfit"
    steps = {}
    for name in (first, second):
        torch.manual_seed(0)
        steps[name] = BUILD[name](wl, device)
        for _ in range(WARMUP):
            steps[name]()
        if name == first and cuda:
            sync()
            torch.cuda.reset_peak_memory_stats()
            steps[name]()
            sync()
            out["peak"] = torch.cuda.max_memory_allocated()
    times: dict = {first: [], second: []}
    for _ in range(repeats):
        for name in (first, second):
            for i in range(TURN):
                sync()
                t0 = time.perf_counter()
                steps[name]()
                sync()
                if i:
                    times[name].append(time.perf_counter() - t0)
    out["times"] = times
    return out


def run(first: str, device: str, repeats: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "bench.ao_cpu_offload_gpu", "--child", first, "--device", device,
           "--repeats", str(repeats)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (p.stderr or p.stdout)[-1500:]}


def main(argv=None) -> int:
    global WORKLOAD, SEQ
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        WORKLOAD, SEQ = "llama:num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2," \
                        "num_key_value_heads=1,vocab_size=256", 64
    if args.child:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            print("RESULT " + json.dumps(child(args.child, args.device, args.repeats)), flush=True)
        return 0
    runs = [run(first, args.device, args.repeats) for first in ("memfit", "torchao")]
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        print("\n".join(errors))
        return 1
    med = {k: statistics.median(runs[0]["times"][k] + runs[1]["times"][k]) for k in ("memfit", "torchao")}
    row = {"workload": WORKLOAD, "batch_size": BATCH, "seq_len": SEQ, "plan": PLAN, "machine": runs[0]["machine"],
           "torch": runs[0]["torch"], "step_seconds": med, "ratio_torchao_over_memfit": med["torchao"] / med["memfit"],
           "peak": {r["first"]: r.get("peak") for r in runs}, "runs": runs}
    peaks = {k: f"{v / 2**30:.2f} GiB" if v else "-" for k, v in row["peak"].items()}
    print(f"{row['machine']}: memfit offload {med['memfit'] * 1e3:.1f} ms/step, peak {peaks['memfit']}; "
          f"torchao CPUOffloadOptimizer {med['torchao'] * 1e3:.1f} ms/step, peak {peaks['torchao']}; "
          f"torchao / memfit {row['ratio_torchao_over_memfit']:.2f}x")
    if args.out:
        with contextlib.suppress(FileNotFoundError), open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
