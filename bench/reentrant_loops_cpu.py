"""Users' loops with torch's reentrant checkpoint on this CPU, predicted by ``checkpointing: blocks:reentrant=true``
and by ``blocks`` (memfit.techniques.reentrant_checkpoint).

Usage: ``python -m bench.reentrant_loops_cpu [--hub]``. The 4-layer Llama of bench.qlora_loops_cpu (512 wide, 2 x 128
tokens), saved in bf16 and loaded with ``from_pretrained``; peft's LoRA (rank 8 on q and v), AdamW, bf16 autocast:

- QLoRA as peft's guide writes it: NF4 with double quantization and bf16 compute, ``prepare_model_for_kbit_training``
  with its default checkpointing (no ``use_reentrant``: torch's reentrant checkpoint), against ``precision: bf16``;
- LoRA over the bf16 model with ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
  True})``, against ``precision: bf16-base``.

Measured: the built model's bytes and the third step's peak over them (bench.qlora_loops_cpu.third_step_peak, the
profiler). ``--hub``: also Qwen2.5-7B-Instruct's sizes from its hub config (the Hugging Face cache; offline), batch 2
x 2,048 on the ``rtx4090`` preset, QLoRA and LoRA, each predicted with both values.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.planning_time import _cpu_model
from bench.qlora_loops_cpu import BATCH, CONFIG, SEQ, third_step_peak

TARGETS = ["q_proj", "v_proj"]
ADAPTER = "lora:r=8,alpha=16,targets=q_proj+v_proj"


def measured(folder: Path, quantized: bool) -> int:
    import transformers
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16,
                                            bnb_4bit_use_double_quant=True, bnb_4bit_quant_type="nf4") if quantized else None
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                              quantization_config=quant, device_map={"": "cpu"})
    if quantized:  # (its default: use_gradient_checkpointing=True, no use_reentrant)
        model = prepare_model_for_kbit_training(model)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, task_type="CAUSAL_LM"))
    return third_step_peak(model, CONFIG["vocab_size"], BATCH, SEQ)


def main() -> None:
    import transformers

    import memfit
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hub", action="store_true", help="also Qwen2.5-7B-Instruct's sizes from its hub config")
    args = parser.parse_args()
    print(f"machine: {_cpu_model()}")
    folder = Path(tempfile.mkdtemp(prefix="memfit-reentrant-")) / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16).save_pretrained(folder)
    for loop, quantized, fields in (
            ("QLoRA, prepare_model_for_kbit_training's default checkpointing", True,
             {"base_weights": "nf4:double_quant=true", "precision": "bf16"}),
            ("LoRA, use_reentrant=True", False, {"precision": "bf16-base"})):
        real = measured(folder, quantized)
        line = [f"{loop}: measured {real:,} B"]
        for checkpointing in ("blocks:reentrant=true", "blocks"):
            plan = memfit.Plan(adapter=ADAPTER, checkpointing=checkpointing, **fields)
            predicted = memfit.estimate(str(folder), plan, batch_size=BATCH, seq_len=SEQ, device="cpu").peak_bytes
            line.append(f"{checkpointing} {predicted:,} B ({predicted / real - 1:+.2%})")
        print("; ".join(line), flush=True)
    if args.hub:
        for name, fields in (("QLoRA", {"base_weights": "nf4:double_quant=true", "precision": "bf16-base"}),
                             ("LoRA", {"precision": "bf16-base"})):
            for checkpointing in ("blocks:reentrant=true", "blocks"):
                t0 = time.perf_counter()
                plan = memfit.Plan(adapter="lora:r=16,alpha=16", checkpointing=checkpointing, **fields)
                r = memfit.estimate("Qwen/Qwen2.5-7B-Instruct", plan, batch_size=2, seq_len=2048, device="rtx4090")
                print(f"Qwen2.5-7B {name}, {checkpointing}, rtx4090, 2 x 2048: peak {r.peak_bytes:,} B, reserved "
                      f"{r.reserved_bytes:,} B ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
