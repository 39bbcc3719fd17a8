"""A fine-grained FP8 checkpoint planned card by card (NOTE [ FP8 checkpoints by card ] in
memfit.workloads.checkpoint_formats): predicted bytes of a rank-16 LoRA over Qwen3-8B-FP8's sizes on cards
below and above compute capability 8.9, beside the same model stored in bf16. Predictions only: no GPU ran these.

The checkpoint is a config.json with Qwen3-8B's published sizes and Qwen3-8B-FP8's ``quantization_config``
(``quant_method: fp8``, e4m3, 128 x 128 blocks), written to a temporary folder: no hub access.

    .venv/bin/python -m bench.fp8_checkpoints [--batch 2 --seq-len 2048]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

warnings.simplefilter("ignore")

from memfit.memory.estimate import estimate  # noqa: E402
from memfit.plans import Plan  # noqa: E402

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
PLAN = Plan(adapter="lora:r=16", precision="bf16-pure", checkpointing="blocks", loss_chunks=8)
CARDS = ("rtx3090", "a100-80gb", "rtx4090", "h100-80gb")
GiB = 2 ** 30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    opts = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name, config in (("fp8 checkpoint", {**QWEN3_8B, "quantization_config": FP8}), ("bf16 checkpoint", QWEN3_8B)):
            folders[name] = Path(tmp) / name.split()[0]
            folders[name].mkdir()
            (folders[name] / "config.json").write_text(json.dumps(config))
        print(f"LoRA r=16, bf16-pure, blocks checkpointed, 8 loss chunks; batch {opts.batch} x {opts.seq_len}")
        print(f"{'card':11s} {'checkpoint':16s} {'base_weights':12s} {'parameters':>11s} {'allocated':>10s} "
              f"{'reserved':>10s} {'seconds':>8s}")
        for card in CARDS:
            for name, folder in folders.items():
                t0 = time.perf_counter()
                r = estimate(str(folder), PLAN, batch_size=opts.batch, seq_len=opts.seq_len, device=card)
                print(f"{card:11s} {name:16s} {r.plan['base_weights']:12s} {r.breakdown['parameters'] / GiB:9.2f} GiB "
                      f"{r.peak_bytes / GiB:6.2f} GiB {r.reserved_bytes / GiB:6.2f} GiB {time.perf_counter() - t0:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
