"""Grouped-query attention on a card without flash, by the torch that trains (``TORCH_EFFICIENT_GQA`` in
memfit.sdpa_backends): a rank-16 QLoRA of Llama-3.1-8B's sizes on the ``t4`` preset, predicted with torch 2.14's
rule (the memory-efficient kernel takes the K/V heads as transformers hands them, ``enable_gqa=True``) and with
2.13's (the math path and its scores), at two precisions. Predictions only: no GPU ran these, and the GPU rows
recorded so far ran torch 2.11.

The model is a config.json with Llama-3.1-8B's published sizes written to a temporary folder: no hub access.

    .venv/bin/python -m bench.gqa_by_torch [--seq-len 4096 --device t4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

warnings.simplefilter("ignore")

from memfit import sdpa_backends  # noqa: E402
from memfit.memory.estimate import estimate  # noqa: E402
from memfit.plans import Plan  # noqa: E402

LLAMA_31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
               "tie_word_embeddings": False}
PRECISIONS = ("fp32", "fp16-base")
GiB = 2 ** 30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--device", default="t4")
    opts = ap.parse_args(argv)
    installed = sdpa_backends.TORCH_EFFICIENT_GQA
    print(f"| precision | torch rule | allocated | reserved | seconds |  (Llama-3.1-8B sizes, QLoRA r=16, blocks, 8 loss "
          f"chunks, 1 x {opts.seq_len}, {opts.device}; installed torch's rule: {'2.14' if installed else '2.13'})")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA_31_8B))
        try:
            for precision in PRECISIONS:
                plan = Plan(adapter="lora:r=16", base_weights="nf4", checkpointing="blocks", loss_chunks=8,
                            precision=precision)
                for rule, efficient in (("2.14", True), ("2.13", False)):
                    sdpa_backends.TORCH_EFFICIENT_GQA = efficient
                    t0 = time.perf_counter()
                    r = estimate(tmp, plan, batch_size=1, seq_len=opts.seq_len, device=opts.device)
                    print(f"| {precision} | {rule} | {r.peak_bytes / GiB:.2f} GiB | {r.reserved_bytes / GiB:.2f} GiB | "
                          f"{time.perf_counter() - t0:.1f} |", flush=True)
        finally:
            sdpa_backends.TORCH_EFFICIENT_GQA = installed
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
