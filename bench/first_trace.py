"""A process's first trace of a plan against its second (NOTE [ Modules loaded during a trace ] in
memfit.untraced_imports): each case estimated twice in one new Python process, as a user's first
``memfit estimate`` runs, and the two compared (allocated peak, reserved bytes, the breakdown by category).

    .venv/bin/python -m bench.first_trace [--cases gpt2-bf16,llama-8bit] [--qwen7b]

``--qwen7b``: Qwen2.5-7B-Instruct at full size, from its hub config (a cache of bench/hub_configs, offline), QLoRA
(nf4, LoRA r=16, bf16-pure, blocks) at batch 2 x 2048 on ``rtx4090``, in place of the small cases.

Prints one line a case: ``same`` or the two figures. A case differs where something the step imports lazily
(a library, a model's file) makes tensors as it loads and the trace books them, once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.planning_time import _cpu_model

LLAMA = "llama:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2," \
        "vocab_size=512"
GPT2 = "gpt2:n_layer=2,n_embd=64,n_head=2"
CASES = {
    "gpt2-bf16": (GPT2, "h100-80gb", {"precision": "bf16"}),
    "gpt2-qlora": (GPT2, "rtx4090", {"adapter": "lora:r=4", "base_weights": "nf4", "precision": "bf16-pure"}),
    "llama-purebf16-blocks": (LLAMA, "rtx4090", {"precision": "bf16-pure", "checkpointing": "blocks"}),
    "llama-8bit-chunks": (LLAMA, "rtx4090", {"optimizer": "adamw8bit", "precision": "bf16-pure", "loss_chunks": 4}),
    "llama-compiled-blocks": (LLAMA, "rtx4090", {"compile": "blocks"}),
    "llama-4bit-ao": (LLAMA, "rtx4090", {"optimizer": "adamw4bit-ao"}),
    "t5-bf16": ("t5:num_layers=2,d_model=64,d_ff=128,num_heads=2", "h100-80gb", {"precision": "bf16"}),
    "bert": ("bert:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=2", "h100-80gb", {}),
    "flux-lora-blocks": ("dit-flux:num_layers=2,num_single_layers=3,attention_head_dim=16,num_attention_heads=2,"
                         "joint_attention_dim=32,in_channels=16,axes_dims_rope=4/6/6,pooled_projection_dim=16",
                         "rtx4090", {"adapter": "lora:r=4", "precision": "bf16-pure", "checkpointing": "blocks"}),
    "lumina2-fp8-lora": ("dit-lumina2:num_layers=2,num_refiner_layers=1,hidden_size=64,num_attention_heads=4,"
                         "num_kv_heads=2,cap_feat_dim=32,axes_dim_rope=8/4/4,multiple_of=16", "rtx4090",
                         {"adapter": "lora:r=4", "precision": "bf16-pure", "base_weights": "fp8"}),
    "unet-sd15-bf16": ("unet-sd15:block_out_channels=32/32/64/64,attention_head_dim=2,cross_attention_dim=32,"
                       "layers_per_block=1", "rtx4090", {"precision": "bf16"}),
    "lstm": ("lstm", "h100-80gb", {}),
}
QWEN7B = {"qwen7b-qlora": ("Qwen/Qwen2.5-7B-Instruct", "rtx4090", {"adapter": "lora:r=16", "base_weights": "nf4",
                                                                    "precision": "bf16-pure", "checkpointing": "blocks"})}

TWICE = """
import json, sys
from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
spec, device, fields = json.loads(sys.argv[1])
size = {"resolution": 64} if spec.startswith(("dit", "unet")) else {"seq_len": 2048 if "/" in spec else 64}
out = []
for _ in range(2):
    with silenced_warnings():
        r = estimate(spec, Plan.from_dict(fields), device=device, batch_size=2, **size)
    out.append([r.peak_bytes, r.reserved_bytes, r.load_peak_bytes, sorted(r.breakdown.items())])
print(json.dumps(out))
"""


def first_and_second(spec: str, device: str, fields: dict, env: dict | None = None) -> list:
    done = subprocess.run([sys.executable, "-c", TWICE, json.dumps([spec, device, fields])], capture_output=True,
                          text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help=f"comma-separated, of: {', '.join(CASES)} (default: all)")
    parser.add_argument("--qwen7b", action="store_true", help="Qwen2.5-7B QLoRA at full size instead")
    args = parser.parse_args()
    cases, env = (QWEN7B, _hub_env()) if args.qwen7b else (CASES, None)
    names = args.cases.split(",") if args.cases else list(cases)
    print(f"machine: {_cpu_model()}; each case estimated twice in one new process")
    same = 0
    for name in names:
        first, second = first_and_second(*cases[name], env=env)
        same += first == second
        figures = ", ".join(f"{what} {n:,} B" for what, n in zip(("peak", "reserved", "load peak"), first[:3])
                            if n is not None)
        print(f"{name:24s} " + (f"same: {figures}" if first == second else f"first {first[:3]} second {second[:3]}"))
    print(f"{same} of {len(names)} the same")


def _hub_env() -> dict:
    """The environment of a process that reads the hub configs from a new cache, offline."""
    from bench.planning_time import hub_cache
    home = Path(tempfile.mkdtemp(prefix="memfit-hf-"))
    hub_cache(home)
    return {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


if __name__ == "__main__":
    main()
