"""Each technique alone and the best stacks on a GPT-2-style model (issue: techniques benchmark).

GPT-2 with 6 layers, width 512, 8 heads, vocabulary 50257, seq 512, batch 8, on this CPU. For every
plan: predicted peak (fake tensors), measured peak (PyTorch profiler allocator events: device and
host together, this being one machine), the predicted device-side peak (what a GPU would hold:
offloaded bytes excluded), and step time relative to fp32 AdamW, measured interleaved with it
(warm-up step each, then REPEATS alternating pairs; median of the ratios).

    .venv/bin/python -m bench.techniques [--repeats 2] [--only NAME,NAME]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import warnings

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
warnings.simplefilter("ignore")

from memfit.memory.measure import profile  # noqa: E402
from memfit.plans import Plan  # noqa: E402
from memfit.step import build_step  # noqa: E402
from memfit.workloads import load_workload  # noqa: E402

WORKLOAD, SEQ, BATCH = "gpt2:n_layer=6,n_embd=512,n_head=8", 512, 8
PLANS = {
    "fp32 AdamW (baseline)": Plan(),
    "bf16 autocast": Plan(precision="bf16"),
    "bf16-pure (kahan)": Plan(precision="bf16-pure", bf16_update="kahan"),
    "checkpointing blocks": Plan(checkpointing="blocks"),
    "checkpointing selective": Plan(checkpointing="selective"),
    "attention chunked": Plan(attention="chunked"),
    "adamw8bit": Plan(optimizer="adamw8bit"),
    "adafactor": Plan(optimizer="adafactor"),
    "optimizer in backward": Plan(optimizer_in_backward=True),
    "offload optimizer_states": Plan(offload=["optimizer_states"]),
    "offload optimizer_states:step=device": Plan(offload=["optimizer_states:step=device"]),
    "offload activations": Plan(offload=["activations"]),
    "loss_chunks 16": Plan(loss_chunks=16),
    "quick stack (bf16+blocks+8bit+chunked loss)": Plan(precision="bf16", checkpointing="blocks",
                                                         optimizer="adamw8bit", loss_chunks=8),
    "8-bit AdamW stack (bf16-pure+blocks+8bit+chunked loss+chunked attention)": Plan(
        precision="bf16-pure", checkpointing="blocks", optimizer="adamw8bit", loss_chunks=16, attention="chunked"),
    "best AdamW stack (bf16-pure SR+blocks+in-backward+chunked loss+chunked attention)": Plan(
        precision="bf16-pure", bf16_update="stochastic", checkpointing="blocks", optimizer_in_backward=True,
        loss_chunks=16, attention="chunked"),
    "best stack, Adafactor (bf16-pure+blocks+in-backward+chunked loss+chunked attention)": Plan(precision="bf16-pure", checkpointing="blocks", optimizer="adafactor",
                                   optimizer_in_backward=True, loss_chunks=16, attention="chunked"),
}


def time_ratio(wl, plan: Plan, repeats: int) -> float:
    """Median over interleaved pairs of (plan step time / baseline step time)."""
    base = build_step(wl, Plan(), BATCH, "cpu")
    step = build_step(wl, plan, BATCH, "cpu")
    batch = wl.batch(BATCH)
    base(batch), step(batch)  # warm-up: optimizer states, allocator, oneDNN primitives
    ratios = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        base(batch)
        t1 = time.perf_counter()
        step(batch)
        t2 = time.perf_counter()
        ratios.append((t2 - t1) / (t1 - t0))
    del base, step
    gc.collect()
    return statistics.median(ratios)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    wl = load_workload(WORKLOAD, seq_len=SEQ)
    names = [n for n in PLANS if not a.only or n.startswith("fp32") or any(k in n for k in a.only.split(","))]
    print(f"{WORKLOAD} seq {SEQ} batch {BATCH}, CPU; ratios vs fp32 AdamW")
    print("| plan | predicted peak | measured peak | error | device-side peak (predicted) | memory vs fp32 | "
          "step time vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base_peak = None
    for name in names:
        plan = PLANS[name]
        r = profile(wl, plan, batch_size=BATCH, repeats=0)
        base_peak = base_peak or r.peak_bytes
        ratio = 1.0 if name.startswith("fp32") else time_ratio(wl, plan, a.repeats)
        mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
        print(f"| {name} | {mib(r.predicted_peak_bytes)} | {mib(r.peak_bytes)} | {r.error_percent:+.2f}% | "
              f"{mib(r.predicted.peak_bytes)} | {base_peak / r.peak_bytes:.2f}x lower | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
