"""memfit train vs a hand-written loop with the same model and techniques (issue: train benchmark).

Per-step time of `memfit.training` (loop, metrics, data, OOM handling) against a plain PyTorch loop
(zero_grad, forward + loss, backward, AdamW step) on the same model, batch and text data. Each
side runs N and 2 steps; (time(N) - time(2)) / (N - 2) removes set-up (for memfit: the prediction
and the profiled first steps). Repeats alternate memfit and hand-written; medians are reported.
Also: the steady-state peak measured during training vs the plan's prediction.

    .venv/bin/python bench/train.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
warnings.simplefilter("ignore")

import torch  # noqa: E402

from memfit.training.data import ByteCorpus  # noqa: E402
from memfit.training.loop import train  # noqa: E402
from memfit.workload import load_workload  # noqa: E402

SPEC, SEQ, BATCH, N = "gpt2:n_layer=4,n_embd=256,n_head=4,n_positions=256", 128, 8, 14


def memfit_seconds(steps: int) -> tuple[float, object]:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        r = train(SPEC, steps=steps, out=out, seq_len=SEQ, batch_size=BATCH, progress=False, checkpoint_every=0)
        return time.perf_counter() - t0, r


def hand_seconds(steps: int) -> float:
    wl = load_workload(SPEC, seq_len=SEQ)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = wl.model()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    corpus, pos = ByteCorpus(None), 0
    for _ in range(steps):
        ids, pos = corpus.batch(pos, BATCH, SEQ - 1)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        float(loss)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    mem, hand, result = [], [], None
    for _ in range(a.repeats):
        (tn, result), (t2, _) = memfit_seconds(N), memfit_seconds(2)
        mem.append((tn - t2) / (N - 2))
        hand.append((hand_seconds(N) - hand_seconds(2)) / (N - 2))
    m, h = statistics.median(mem), statistics.median(hand)
    err = 100 * (result.predicted_peak_bytes - result.measured_peak_bytes) / result.measured_peak_bytes
    print(f"{SPEC} seq {SEQ} batch {BATCH}, fp32 AdamW, {a.repeats} alternating repeats")
    print(f"  memfit train   : {m * 1e3:.1f} ms/step (median)")
    print(f"  hand-written   : {h * 1e3:.1f} ms/step (median)")
    print(f"  overhead       : {100 * (m / h - 1):+.1f}% (target <= 3%)")
    print(f"  steady-state peak: predicted {result.predicted_peak_bytes:,} B, measured {result.measured_peak_bytes:,} B "
          f"({err:+.3f}%; target within 1%)")


if __name__ == "__main__":
    main()
