"""The field's published step rates on cards never lent here, against memfit's step-time model (issue 51).

torchtune's README ("Memory and training speed") publishes tokens per second for its Llama-3.1-8B
single-device recipes on one RTX 4090: batch 2, a dataset packed to 2,048 tokens, no gradient
accumulation, torch.compile on. Each row here is that recipe run through memfit's own step for the
``rtx4090`` preset, with the reference host (``h100-box``: a desktop's is unknown), priced two ways: the
planner's time model (the eager step's ops, a compiled plan's memory-bound time scaled by the fusion
factor fitted on GPT-2, paged states' migration added) and the compiled step's own ops
(``tools.fit.compiled_ops``: Inductor's kernels as its wrapper launches them).

    PYTHONPATH=. .venv/bin/python -m bench.published_rows [--only LoRA]

The published figure is an epoch's mean with torchtune's own model code and kernels (torchao's NF4 for
QLoRA), not memfit's step: a row says how far the model is from what the field measured, and what a
step of those FLOPs needs of the card (the GEMMs' share of the card's bf16 peak), not a fitted target.
"""

from __future__ import annotations

import argparse
import time
import warnings

LLAMA_31_8B = ("llama:hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,"
               "num_key_value_heads=8,vocab_size=128256,max_position_embeddings=8192")
TOKENS = 2 * 2048
"""A step's tokens in every row: batch 2 x 2,048, packed (no padding)."""
ROWS = (
    # (recipe, tokens/s published, plan: llama3_1/8B_*_single_device.yaml with compile on, as the README ran them)
    ("torchtune full (1 GPU)", 1650, dict(precision="bf16-pure", compile="blocks", checkpointing="blocks",
                                          optimizer="adamw8bit-paged", optimizer_in_backward=True, loss_chunks=8)),
    ("torchtune LoRA (1 GPU)", 3083, dict(adapter="lora:r=8,alpha=16,targets=q_proj+v_proj+o_proj+gate_proj+up_proj+"
                                                  "down_proj", precision="bf16-pure", compile="blocks",
                                          checkpointing="blocks", loss_chunks=8)),
    ("torchtune QLoRA (1 GPU)", 2413, dict(base_weights="nf4", adapter="lora:r=8,alpha=16,targets=q_proj+k_proj+v_proj+"
                                                                        "o_proj+gate_proj+up_proj+down_proj",
                                           precision="bf16-pure", compile="blocks", checkpointing="blocks",
                                           loss_chunks=8)),
)
SOURCE = "pytorch/torchtune README.md, 'Memory and training speed' (Llama 3.1 8B, 1x 4090)"


def predict(plan: dict, preset: str = "rtx4090") -> dict:
    """memfit's figures for ``plan`` of Llama-3.1-8B at batch 2 x 2,048 on ``preset``."""
    import memfit
    from memfit.devices import get_device
    from memfit.memory.managed import step_migration
    from memfit.planner.ops import ATTENTION, MATMUL
    from memfit.planner.roofline import H100
    from memfit.planner.timing import record_ops, simulate, step_seconds
    from memfit.plans import Plan
    from memfit.target import Target

    device = get_device(preset)
    target = Target.resolve(LLAMA_31_8B, Plan(**plan), 2, preset, seq_len=2048)
    report = memfit.estimate(LLAMA_31_8B, Plan(**plan), batch_size=2, seq_len=2048, device=preset)
    moved = step_migration(report.reserved_bytes, device.context_bytes, report.managed_bytes, device).seconds
    own = record_ops(target, as_planned=True)
    gemm = sum(o.flops for o in own if o.kind == MATMUL)
    attention = sum(o.flops * (0.5 if o.is_causal else 1.0) for o in own if o.kind == ATTENTION)
    return {"time_model": step_seconds(target, H100).seconds + moved, "compiled_ops": simulate(own, device, H100).seconds
            + moved, "migration": moved, "gemm_flops": gemm, "attention_flops": attention,
            "peak_flops": device.peak_flops["bfloat16"], "reserved": report.reserved_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="a substring of the recipes to run")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    print(f"source: {SOURCE}; memfit's rtx4090 preset, reference host\n")
    print("| recipe | published ms (tok/s) | time model ms | error | compiled ops ms | error | migration ms | "
          "GEMMs + attention at the bf16 peak ms | the peak's share the published step needs of the GEMMs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, rate, plan in ROWS:
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        p = predict(plan)
        published = TOKENS / rate
        at_peak = (p["gemm_flops"] + p["attention_flops"]) / p["peak_flops"]
        share = p["gemm_flops"] / p["peak_flops"] / max(published - p["migration"], 1e-9)
        print(f"| {name} | {published * 1e3:.0f} ({rate:,}) | {p['time_model'] * 1e3:.0f} | "
              f"{p['time_model'] / published - 1:+.1%} | {p['compiled_ops'] * 1e3:.0f} | "
              f"{p['compiled_ops'] / published - 1:+.1%} | {p['migration'] * 1e3:.0f} | {at_peak * 1e3:.0f} | "
              f"{share:.2f} |", flush=True)
        print(f"<!-- {name}: {time.perf_counter() - t0:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
