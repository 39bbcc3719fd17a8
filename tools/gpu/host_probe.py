"""The host behind a device call, measured (NOTE [ One kind of machine, several hosts ] in memfit.hosts).

A loan names the card, not the machine around it, and the host sets the pace of every step that is
host-bound (Python dispatch, an optimizer stepped on the host, pinned copies). Each device call now
records, once, beside its rows (``$OUT/host.json``, printed too):

- ``cpu``, ``cores``, ``threads``: /proc/cpuinfo's model name, ``os.cpu_count()``, torch's intra-op threads;
- ``launch_seconds``: memfit.hosts.launch_seconds (one small CUDA op issued from Python), the dispatch
  figure; ``dispatch_vs_reference`` once the reference machine's figure is recorded;
- ``adamw_fused_bytes_per_second``: memfit.hosts.adamw_bandwidth at its default size, and
  ``memory_vs_reference``: that over the reference constant ``host_fused_bw`` (memfit.hosts.Host.memory
  for this machine, as ``--host measure`` reads it); the same over ``--params`` parameters beside it;
- ``h2d_bytes_per_second`` and ``d2h_bytes_per_second``: one pinned 1 GiB copy each way, on a GPU; ``duplex``:
  both at once on two streams, over the longer alone (the time model's ``duplex``);
- ``linear_call_seconds`` and ``qlora_call_seconds``: one forward and backward of a small bf16 ``nn.Linear`` and of
  bitsandbytes' ``Linear4bit`` (nf4, double quantization, bf16 compute), issued back to back and synchronised at the
  end, so the host's Python sets the pace. The held-out QLoRA row of Qwen2.5-7B (h200.jsonl 95) is 24.8% low,
  64 ms a step: ~110 us a 4-bit layer call (588 a step) that its ops' dispatch costs do not hold, if the miss is
  the host's. The difference of these two says whether it is.

    python -m tools.gpu.host_probe [--out host.json] [--params 268435456]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> dict:
    """Pinned host <-> device copy bandwidth, bytes/s each way (``h2d``, ``d2h``): ``nbytes`` copied, the
    median of ``repeats`` (bench.offload_bound's link term too)."""
    import torch
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return {name: nbytes / median_seconds(lambda dst=dst, src=src: dst.copy_(src, non_blocking=True), repeats)
            for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items()}


def link_bandwidth(nbytes: int = 1 << 30) -> dict:
    import torch
    one_way = copy_bandwidth(nbytes)
    out = {f"{name}_bytes_per_second": round(bw) for name, bw in one_way.items()}
    # Both ways at once, each on a stream of its own, as an offloaded optimizer's prefetch and copy out run: the
    # time model's ``duplex`` (memfit.planner.roofline.Constants) is that time over the longer copy alone
    # (2.0: no faster than in turn, as fitted on the H100 machine; 1.0: both at full speed).
    host_in, host_out = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev_in, dev_out = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def both_ways():
        with torch.cuda.stream(streams[0]):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            host_out.copy_(dev_out, non_blocking=True)
    out["duplex"] = round(median_seconds(both_ways, 3) / (nbytes / min(one_way.values())), 3)
    return out


def layer_call_seconds(calls: int = 300, width: int = 256, tokens: int = 16, device: str = "cuda") -> dict:
    """Seconds a forward and backward of one small layer takes when the host sets the pace: a bf16 ``nn.Linear``
    and bitsandbytes' 4-bit one (the median of 5 runs of ``calls``)."""
    import bitsandbytes as bnb
    import torch
    dense = torch.nn.Linear(width, width, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
    four = bnb.nn.Linear4bit(width, width, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                             compress_statistics=True)
    four.weight = bnb.nn.Params4bit(dense.weight.detach().cpu().clone(), requires_grad=False, quant_type="nf4",
                                    compress_statistics=True)
    four = four.to(device)  # (quantized as it moves, as from_pretrained's)
    x = torch.randn(1, tokens, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = {}
    for name, layer in (("linear_call_seconds", dense), ("qlora_call_seconds", four)):
        def run(layer=layer):
            for _ in range(calls):
                layer(x).sum().backward()
        run()
        out[name] = median_seconds(run, 5, device) / calls
    return out


def median_seconds(run, repeats: int, device: str = "cuda") -> float:
    """The median wall seconds of ``run()`` on the GPU, synchronised before and after."""
    import torch
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runs = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def probe(params: int) -> dict:
    import torch

    from memfit.hosts import (
        REFERENCE_HOST_FUSED_BW,
        REFERENCE_LAUNCH_SECONDS,
        adamw_bandwidth,
        launch_seconds,
    )
    row: dict = {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads()}
    bw = adamw_bandwidth()  # (--host measure's memory figure, at its size)
    row["adamw_fused_bytes_per_second"] = round(bw)
    row["memory_vs_reference"] = round(bw / REFERENCE_HOST_FUSED_BW, 3)
    row[f"adamw_fused_bytes_per_second_{params}"] = round(adamw_bandwidth(params))  # (a size past any cache)
    if torch.cuda.is_available():
        row["launch_seconds"] = launch_seconds("cuda")
        if REFERENCE_LAUNCH_SECONDS:
            row["dispatch_vs_reference"] = round(row["launch_seconds"] / REFERENCE_LAUNCH_SECONDS, 3)
        row.update(link_bandwidth())
        try:
            row.update(layer_call_seconds())
        except Exception as e:  # noqa: BLE001 - the other figures are still recorded (bitsandbytes travels as a wheel)
            row["qlora_call_seconds"] = f"{type(e).__name__}: {str(e)[:120]}"
        row["gpu"] = torch.cuda.get_device_name()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the figures here as JSON")
    ap.add_argument("--params", type=int, default=1 << 28, help="parameters of the fused AdamW probe")
    args = ap.parse_args(argv)
    row = probe(args.params)
    print("host:", json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
