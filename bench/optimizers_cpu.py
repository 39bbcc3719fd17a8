"""The optimizers of issue 51 on a small Llama, on this CPU: predicted peak against the profiler's.

A 2-layer Llama (width 256, MLP 688, 4 heads, vocabulary 1000), batch 2 x 64 tokens, fp32. For each
optimizer: the predicted peak (fake tensors), the measured peak (PyTorch profiler allocator events),
their error, the measured optimizer-state bytes at the peak, and one timed step (median of
``--repeats``; noisy on a shared machine: not a benchmark). GaLore and APOLLO at rank 32 (of 256);
their projection is renewed in the measured step (NOTE [ The projection step is the step traced ]).
Then the same plans estimated on a GPU preset, where the paged states are CUDA managed memory.

    PYTHONPATH=src python -m bench.optimizers_cpu [--repeats 1] [--only NAME,NAME] [--device rtx4090]
"""

from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
warnings.simplefilter("ignore")

from memfit.memory.estimate import estimate  # noqa: E402
from memfit.memory.measure import profile  # noqa: E402
from memfit.plans import Plan  # noqa: E402

LLAMA = ("llama:num_hidden_layers=2,hidden_size=256,intermediate_size=688,num_attention_heads=4,"
         "num_key_value_heads=4,vocab_size=1000")
OPTIMIZERS = ("adamw", "adamw8bit", "adamw8bit-paged", "adamw-paged", "galore:rank=32", "galore8bit:rank=32",
              "apollo:rank=32", "apollo-mini")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--only", default="")
    ap.add_argument("--device", default="rtx4090", help="the GPU preset of the second table")
    args = ap.parse_args()
    names = [n for n in OPTIMIZERS if not args.only or n in args.only.split(",")]
    print("| optimizer | predicted peak | measured peak | error | optimizer states (measured) | step (CPU, noisy) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        r = profile(LLAMA, Plan(optimizer=name), batch_size=2, seq_len=64, repeats=args.repeats)
        print(f"| `{name}` | {r.predicted_peak_bytes / 2**20:,.2f} MiB | {r.measured.peak_bytes / 2**20:,.2f} MiB | "
              f"{r.error_percent:+.3f}% | {r.measured.breakdown['optimizer_states'] / 2**20:,.2f} MiB | "
              f"{r.step_seconds * 1e3:,.0f} ms |", flush=True)
    print(f"\n{args.device} preset (estimate: fake tensors, CUDA kernel model):\n")
    print("| optimizer | peak allocated | reserved | managed (paged) | on the card |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        e = estimate(LLAMA, Plan(optimizer=name), batch_size=2, seq_len=64, device=args.device)
        on_card = e.reserved_bytes + e.cuda_context_bytes + e.managed_bytes
        print(f"| `{name}` | {e.peak_bytes / 2**20:,.2f} MiB | {e.reserved_bytes / 2**20:,.2f} MiB | "
              f"{e.managed_bytes / 2**20:,.2f} MiB | {on_card / 2**20:,.2f} MiB |", flush=True)


if __name__ == "__main__":
    main()
