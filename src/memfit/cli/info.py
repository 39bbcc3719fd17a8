"""memfit workloads / memfit devices: what can be named on the command line."""

from __future__ import annotations

import argparse

from memfit.cli.common import add_command


def register(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "workloads", run_workloads, help="list built-in workloads")
    add_command(sub, "devices", run_devices, help="list device presets")


def run_workloads(args: argparse.Namespace) -> int:
    from memfit.workloads import builtin_names
    names = builtin_names()
    wide = max(map(len, names))
    for name, doc in names.items():
        print(f"{name:{wide}s} {doc}")
    print("\nOverride config fields as NAME:key=value,key=value (e.g. gpt2:n_layer=4,n_embd=256); "
          "user workloads as path/to/file.py:NAME; a local Hugging Face model folder as ./dir or hf:./dir, "
          "or a hub id as org/name[@revision] (built from its config.json alone, read through the Hugging "
          "Face cache: no weights read).")
    return 0


def run_devices(args: argparse.Namespace) -> int:
    from memfit.devices import GPU_PRESETS, cpu_device
    from memfit.units import fmt_bytes
    cpu = cpu_device()
    print(f"{'cpu':15s} {fmt_bytes(cpu.total_bytes):>11s}  this machine (CPU allocator)")
    for d in GPU_PRESETS.values():
        dtypes = "bf16+fp16" if d.bf16 else "fp16"
        major, minor = d.compute_capability
        print(f"{d.name:15s} {fmt_bytes(d.total_bytes):>11s}  {dtypes:9s} sm{major}{minor} {d.sm_count:3d} SMs, context "
              f"{d.context_bytes >> 20} MiB, {d.peak_flops['float16'] / 1e12:.0f} TFLOP/s fp16, "
              f"{d.mem_bandwidth / 1e12:.2f} TB/s")
    return 0
