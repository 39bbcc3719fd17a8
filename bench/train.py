"""memfit train vs a hand-written loop with the same model and techniques (issue: train benchmark).

Per-step time of `memfit.training` (loop, metrics, data, OOM handling) against a plain PyTorch loop
(zero_grad, forward + loss, backward, AdamW step) on the same model, batch and text data: in fp32,
and with bf16 autocast + block checkpointing (the hand-written loop uses torch.autocast and Hugging
Face's gradient checkpointing). Each
side runs N steps; a step's time is the wall time from the end of one step to the end of the next
(memfit: the ``time`` stamps in metrics.jsonl, so data, metrics, checkpoint checks and the
progress display count), over steps 4..N (after memfit's profiled steps). Repeats alternate memfit, memfit with a budget (the CPU budget
guard on every op) and hand-written; medians are reported. Also: the steady-state peak measured
during training vs the plan's prediction, and the guard's device peak vs the same prediction.

    .venv/bin/python -m bench.train [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
warnings.simplefilter("ignore")

import torch  # noqa: E402

from memfit.plans import Plan  # noqa: E402
from memfit.training.data import ByteCorpus  # noqa: E402
from memfit.training.loop import train  # noqa: E402
from memfit.workloads import load_workload  # noqa: E402

SPEC, SEQ, BATCH, N = "gpt2:n_layer=4,n_embd=256,n_head=4,n_positions=256", 128, 8, 14
FIRST = 4  # first timed step
GUARD_BUDGET = "8GiB"  # far above the step's peak: the guard counts, never fires


# (label, memfit plan, the hand-written loop's techniques)
SETUPS = [("fp32", Plan(), False),
          ("bf16 autocast + block checkpointing", Plan(precision="bf16", checkpointing="blocks"), True)]


def memfit_seconds(steps: int, plan: Plan, budget: str | None = None) -> tuple[list[float], object]:
    with tempfile.TemporaryDirectory() as out:
        r = train(SPEC, plan=plan, budget=budget, steps=steps, out=out, seq_len=SEQ, batch_size=BATCH,
                  progress=False, checkpoint_every=0, report=False)
        stamps = [json.loads(line)["time"] for line in open(f"{out}/metrics.jsonl")]
    return _intervals(stamps), r


def _intervals(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps[FIRST - 2:], stamps[FIRST - 1:])]


def hand_seconds(steps: int, techniques: bool) -> list[float]:
    """The loop a user would write; with ``techniques``: torch.autocast(bf16) and Hugging Face's
    own gradient checkpointing of every block (non-reentrant)."""
    wl = load_workload(SPEC, seq_len=SEQ)
    stamps = []
    torch.manual_seed(0)
    model = wl.model()
    model.train()
    if techniques:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=techniques)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data, window = ByteCorpus(None).data, SEQ
    for i in range(steps):
        ids = data[i * BATCH * window:(i + 1) * BATCH * window].view(BATCH, window)
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        float(loss)
        stamps.append(time.time())
    return _intervals(stamps)


def guard_cost_small(repeats: int) -> tuple[float, float]:
    """The guard on a model of many small ops (GPT-2 2x64, seq 64, batch 4): median step times."""
    small, times = "gpt2:n_layer=2,n_embd=64,n_head=4,n_positions=128", {None: [], GUARD_BUDGET: []}
    for _ in range(repeats):
        for budget in times:
            with tempfile.TemporaryDirectory() as out:
                train(small, plan=Plan(), budget=budget, steps=30, out=out, seq_len=64, batch_size=4,
                      progress=False, checkpoint_every=0, report=False)
                times[budget] += _intervals([json.loads(line)["time"] for line in open(f"{out}/metrics.jsonl")])
    return statistics.median(times[None]), statistics.median(times[GUARD_BUDGET])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(f"{SPEC} seq {SEQ} batch {BATCH}, AdamW, {a.repeats} alternating repeats, median of "
          f"{a.repeats * (N - FIRST + 1)} step times each")
    for label, plan, techniques in SETUPS:
        mem, guarded, hand, result, gresult = [], [], [], None, None
        for _ in range(a.repeats):
            times, result = memfit_seconds(N, plan)
            mem += times
            times, gresult = memfit_seconds(N, plan, GUARD_BUDGET)
            guarded += times
            hand += hand_seconds(N, techniques)
        m, g, h = statistics.median(mem), statistics.median(guarded), statistics.median(hand)
        err = 100 * (result.predicted_peak_bytes - result.measured_peak_bytes) / result.measured_peak_bytes
        gerr = 100 * (gresult.guard_peak_bytes - gresult.predicted_peak_bytes) / gresult.predicted_peak_bytes
        print(f"{label}:")
        print(f"  hand-written   : {h * 1e3:.1f} ms/step (median)")
        print(f"  memfit train   : {m * 1e3:.1f} ms/step, overhead {100 * (m / h - 1):+.1f}% (target <= 3%)")
        print(f"  memfit train --budget {GUARD_BUDGET} (CPU budget guard on): {g * 1e3:.1f} ms/step, "
              f"{100 * (g / h - 1):+.1f}% vs hand-written")
        print(f"  steady-state peak: predicted {result.predicted_peak_bytes:,} B, measured "
              f"{result.measured_peak_bytes:,} B ({err:+.3f}%; target within 1%)")
        print(f"  guard's device peak {gresult.guard_peak_bytes:,} B vs predicted {gresult.predicted_peak_bytes:,} B "
              f"({gerr:+.3f}%)")
    plain, guarded_small = guard_cost_small(a.repeats)
    print(f"guard on a model of small ops (GPT-2 2x64, seq 64, batch 4, fp32): {plain * 1e3:.1f} -> "
          f"{guarded_small * 1e3:.1f} ms/step ({100 * (guarded_small / plain - 1):+.1f}%)")


if __name__ == "__main__":
    main()
