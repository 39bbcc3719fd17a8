"""Fine-tuning methods on this CPU: prediction vs the profiler's measurement (issue: PEFT, QLoRA and
diffusion models).

For each model and adapter, fp32 and bf16 autocast, with and without block checkpointing: the
predicted peak (fake tensors) beside the peak the PyTorch profiler's allocator events measure on a
real step. Each row runs in its own ``memfit profile --json`` process, as a user runs it.

    .venv/bin/python -m bench.finetune_cpu [--only NAME,NAME]
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
    "QDoRA (nf4), Llama-style LM": (LLAMA, ["--seq-len", "64", "--base-weights", "nf4", "--adapter", "dora:r=8"]),
}
VARIANTS = (("fp32", "none"), ("bf16", "none"), ("fp32", "blocks"), ("bf16", "blocks"))


DIT = ("dit-lumina2:num_layers=2,num_refiner_layers=1,hidden_size=64,num_attention_heads=4,num_kv_heads=2,"
       "cap_feat_dim=32,axes_dim_rope=8/4/4,multiple_of=16")
UNET = ("unet-sdxl:block_out_channels=32/64/64,attention_head_dim=2,transformer_layers_per_block=1,"
        "cross_attention_dim=32,addition_time_embed_dim=8,projection_class_embeddings_input_dim=80")
CASES["LoRA, diffusers DiT (Lumina2, 128 px)"] = (DIT, ["--resolution", "128", "--adapter", "lora:r=8"])
CASES["LoRA, diffusers UNet (SDXL, 128 px)"] = (UNET, ["--resolution", "128", "--adapter", "lora:r=8"])


def row(spec: str, args: list[str], precision: str, checkpointing: str) -> dict:
    cmd = [sys.executable, "-m", "memfit.cli.main", "profile", spec, "-b", "2", "--repeats", "1", "--json",
           "--precision", precision, "--checkpointing", checkpointing, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated case names (substrings)")
    opts = ap.parse_args()
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
