"""Prediction vs measurement for mixture-of-experts and speech models (issue 55).

Small configs (memfit.workloads.small_configs) of Mixtral, Qwen2-MoE (shared experts), DeepSeek-V3
(shared experts, group-limited routing), gpt-oss (expert biases, transposed weights) and
Whisper, built from config.json as model folders, each in fp32, bf16 autocast and pure bf16, with
and without block checkpointing, fully fine-tuned and with a LoRA on the attention (PEFT's
q and v projections) or on the experts (``params=``): the fake-tensor prediction, the measured peak
(PyTorch profiler allocator events, independent of memfit's tracker) and the error. The experts
run as transformers runs them by default (``grouped_mm``), or as ``batched_mm`` (each pair's
expert weights gathered); the rows marked ``eager`` run the
per-expert loop, measured with the router forced to the routing the prediction assumes
(balanced) and to the worst routing, against the reported bound.

    .venv/bin/python -m bench.moe_accuracy            # markdown table on stdout
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
warnings.simplefilter("ignore")

import contextlib  # noqa: E402

from memfit.memory.measure import profile  # noqa: E402
from memfit.memory.routing import BALANCED, WORST, ForcedRouting  # noqa: E402
from memfit.plans import Plan  # noqa: E402
from memfit.workloads.small_configs import MOE, write_folder  # noqa: E402

BATCH, SEQ = 2, 64
EXPERTS_LORA = "lora:r=8,params=experts.gate_up_proj+experts.down_proj"
ATTENTION = {"deepseek_v3": "q_b_proj+kv_b_proj"}  # its multi-head latent attention's up-projections


def attention_lora(name: str) -> str:
    return f"lora:r=8,targets={ATTENTION.get(name, 'q_proj+v_proj')}"


def rows():
    for name in (*MOE, "whisper"):
        adapters = ["none", attention_lora(name)] + ([EXPERTS_LORA] if name in MOE else [])
        for precision in ("fp32", "bf16", "bf16-pure"):
            for checkpointing in ("none", "blocks"):
                for adapter in adapters:
                    yield name, {}, precision, checkpointing, adapter, None
    for precision in ("fp32", "bf16"):
        for checkpointing in ("none", "blocks"):
            yield "mixtral", {"experts_implementation": "batched_mm"}, precision, checkpointing, "none", None
    for routing in (BALANCED, WORST):
        for precision in ("fp32", "bf16"):
            for checkpointing in ("none", "blocks"):
                yield "mixtral", {"experts_implementation": "eager"}, precision, checkpointing, "none", routing


def main() -> None:
    print(f"batch {BATCH}, seq {SEQ}, AdamW, device cpu\n")
    print("| model | experts | precision | checkpointing | adapter | routing | predicted (B) | measured (B) | error |")
    print("|---|---|---|---|---|---|---:|---:|---:|")
    worst = 0.0
    for name, changes, precision, checkpointing, adapter, routing in rows():
        folder = write_folder(name, **changes)
        plan = Plan(precision=precision, checkpointing=checkpointing, adapter=adapter)
        with ForcedRouting(routing) if routing else contextlib.nullcontext():
            r = profile(folder, plan, batch_size=BATCH, seq_len=SEQ, repeats=1)
        predicted = r.predicted.worst_routing_peak_bytes if routing == WORST else r.predicted_peak_bytes
        error = 100 * (predicted - r.peak_bytes) / r.peak_bytes
        worst = max(worst, abs(error))
        impl = changes.get("experts_implementation", "grouped_mm" if name in MOE else "-")
        shown = "full" if adapter == "none" else "lora (experts)" if adapter == EXPERTS_LORA else "lora (attention)"
        print(f"| {name} | {impl} | {precision} | {checkpointing} | {shown} | {routing or '-'} | {predicted:,} | "
              f"{r.peak_bytes:,} | {error:+.3f}% |", flush=True)
    print(f"\nworst |error|: {worst:.3f}% (target <= 1%)")


if __name__ == "__main__":
    main()
