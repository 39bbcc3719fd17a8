"""Fine-tuning methods on this CPU: prediction vs the profiler's measurement (issue: PEFT, QLoRA and
diffusion models).

For each model and adapter, fp32 and bf16 autocast, with and without block checkpointing: the
predicted peak (fake tensors) beside the peak the PyTorch profiler's allocator events measure on a
real step. Each row runs in its own ``memfit profile --json`` process, as a user runs it.

    .venv/bin/python bench/finetune_cpu.py [--only NAME,NAME]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

LLAMA = ("llama:num_hidden_layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4,"
         "num_key_value_heads=4,vocab_size=1000")
GPT2 = "gpt2:n_layer=2,n_embd=128,n_head=4,vocab_size=1000,n_positions=128"
CASES = {
    "LoRA, Llama-style LM": (LLAMA, ["--seq-len", "64", "--adapter", "lora:r=8,alpha=16,dropout=0.05"]),
    "LoRA, GPT-2 + modules_to_save": (GPT2, ["--seq-len", "64", "--adapter", "lora:r=8,targets=c_attn,save=lm_head"]),
    "DoRA, Llama-style LM": (LLAMA, ["--seq-len", "64", "--adapter", "dora:r=8,targets=q_proj+v_proj"]),
    "QLoRA (nf4), Llama-style LM": (LLAMA, ["--seq-len", "64", "--base-weights", "nf4", "--adapter", "lora:r=8"]),
}
VARIANTS = (("fp32", "none"), ("bf16", "none"), ("fp32", "blocks"), ("bf16", "blocks"))


def add_diffusion_cases() -> None:
    """The built-in diffusion workloads at toy sizes, when this memfit has them."""
    from memfit.workloads.builtin import builtin_names
    names = builtin_names()
    for name, label in (("dit-lumina2", "LoRA, diffusers DiT (Lumina2)"), ("unet-sd15", "LoRA, diffusers UNet")):
        if name in names:
            CASES[label] = (name, ["--tiny", "--resolution", "64", "--adapter", "lora:r=8"])


def row(spec: str, args: list[str], precision: str, checkpointing: str) -> dict:
    cmd = [sys.executable, "-m", "memfit.cli.main", "profile", spec, "-b", "2", "--repeats", "1", "--json",
           "--precision", precision, "--checkpointing", checkpointing, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated case names (substrings)")
    opts = ap.parse_args()
    add_diffusion_cases()
    print("| case | precision | checkpointing | predicted | measured | error |")
    print("|---|---|---|---|---|---|")
    for name, (spec, args) in CASES.items():
        if opts.only and not any(s in name for s in opts.only.split(",")):
            continue
        for precision, checkpointing in VARIANTS:
            r = row(spec, args, precision, checkpointing)
            print(f"| {name} | {precision} | {checkpointing} | {r['predicted_peak_bytes'] / 2**20:.2f} MiB | "
                  f"{r['peak_bytes'] / 2**20:.2f} MiB | {r['error_percent']:+.3f}% |", flush=True)


if __name__ == "__main__":
    main()
