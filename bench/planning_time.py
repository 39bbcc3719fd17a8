"""Planning time of ``memfit plan`` on the issues' target cases, each in a cold process of its own.

Each case runs ``memfit plan`` as a user would, in a new Python process with an empty Inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` in a new temporary folder: cold, as on a user's first run; ``--warm``
keeps one cache per case across repeats). The wall time is the command's, from the process starting
to its exit (Python and torch starting included). Also printed: the planning seconds the header
reports, the traces, and the chosen plan. Target (issue 32): <= 60 s cold on a 2-core machine for
every README example, negative answers included.

``--against DIR`` times another checkout's ``src`` too, in turns with this one (A, B, A, B...), so
that a ratio is measured under the same load: this VM's speed drifts by 10-30% over minutes.
``--breakdown`` runs each command with ``--json`` and prints, per method, where its search spent its
traces: the phase (before the walk: the default plan and each value alone; the walk), the kind of
trace (shallow, full-depth, at a micro-batch size, the deep stream's replay), how many and the
CPU seconds in the processes that ran them.

Hub ids (issue 49: ``Qwen/Qwen2.5-7B-Instruct``) are read from a Hugging Face cache this script lays
out in a temporary HF_HOME from ``bench/hub_configs/`` (config.json alone, offline), as a user's cache
holding only the config would be.

    .venv/bin/python -m bench.planning_time [--cases gpt2-2,readme-gpt2] [--repeat 3] [--against /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    # the README's examples (issue 32: <= 60 s cold)
    "readme-gpt2": "gpt2:n_layer=2 --batch-size 8 --seq-len 1024 --device rtx4090 --budget 4GiB",
    "readme-llama": "llama -b 1 --seq-len 2048 --device rtx4090",
    "readme-methods": "llama --methods full,lora,qlora --device rtx4090 -b 1",
    # a negative answer (nothing fits), and GPT-2 at tight budgets (issue 32: "gpt2 at 2 GiB")
    "llama-14": "llama -b 1 --seq-len 2048 --device rtx4090 --budget 14GiB",
    "gpt2-2": "gpt2 -b 8 --seq-len 1024 --device h100-80gb --budget 2GiB",
    "gpt2-4": "gpt2 -b 8 --seq-len 1024 --device h100-80gb --budget 4GiB",
    # the GPU-preset planner's first targets
    "llama-40": "llama --device h100-80gb --budget 40GiB",
    "gpt2-8": "gpt2 -b 8 --seq-len 1024 --device h100-80gb --budget 8GiB",
    # issue 49: a hub model with a 152k vocabulary and 28 layers (<= 60 s one method, <= 90 s three)
    "qwen-qlora": "Qwen/Qwen2.5-7B-Instruct --device rtx4090 -b 2 --seq-len 2048 --adapter lora:r=16 --base-weights nf4",
    "qwen-full": "Qwen/Qwen2.5-7B-Instruct --device rtx4090 -b 2 --seq-len 2048",
    "qwen-methods": "Qwen/Qwen2.5-7B-Instruct --methods full,lora,qlora --device rtx4090 -b 2 --seq-len 2048",
    # a 32-layer hub model whose LoRA trains 25M parameters (its states: 403 MB, 1.9% of the budget)
    "phi3-methods": "microsoft/Phi-3-mini-4k-instruct --methods full,lora,qlora --device rtx4090 -b 2 --seq-len 2048",
    # hub models not written here: Gemma-2-9B (42 layers, 256k vocabulary, soft-capped logits), its LoRA
    # swapping blocks on a 24 GB card (NOTE [ A shallow pair of a plan that swaps the last N blocks ])
    "gemma-lora": "google/gemma-2-9b --device rtx4090 -b 2 --seq-len 2048 --adapter lora:r=16",
    "gemma-methods": "google/gemma-2-9b --methods full,lora,qlora --device rtx4090 -b 2 --seq-len 2048",
    # a vision-language model (a 448 px image a sample): 32 vision blocks and 28 text ones, cut to 4 + t and t
    # (NOTE [ Stacks of unrelated depths ])
    "qwenvl-qlora": "Qwen/Qwen2.5-VL-7B-Instruct --device rtx4090 -b 2 --seq-len 2048 --adapter lora:r=16 --base-weights nf4",
    # issue 53: FLUX.1-dev's LoRA, fp8 base, 1024 px, on a 12 GB card (two stacks; blocks swapped)
    "flux-12": "dit-flux --adapter lora:r=16 --base-weights fp8 --precision bf16-pure --resolution 1024 -b 1 "
               "--device rtx4090 --budget 12GiB",
    # FLUX.1-dev with CLIP-L and T5-XXL frozen in the step (four stacks: 12 + 24 encoder layers, 19 + 38 blocks)
    "flux-encoders": "dit-flux:text_encoders=frozen --adapter lora:r=16 --base-weights fp8 --precision bf16-pure "
                     "--resolution 1024 -b 1 --device rtx4090",
    # SDXL's UNet with CLIP-L and OpenCLIP-bigG frozen in the step (12 + 32 encoder layers, the UNet's small stacks)
    "sdxl-encoders": "unet-sdxl:text_encoders=frozen --adapter lora:r=16 --precision bf16-base --resolution 1024 -b 1 "
                     "--device rtx4090",
    # Qwen-Image (20.4B, 60 blocks, rotary tables as plain tensors: NOTE [ Plain tensors of a meta build ])
    "qwenimage-lora": "dit-qwenimage --adapter lora:r=16 --device rtx4090 -b 1",
    # issue 52: compile searched for a long run (--steps), each distinct graph compiled once per worker
    "p2-compiled": "gpt2 -b 8 --seq-len 1024 --device h100-80gb --budget 2.05GiB --steps 10000 --precision bf16-pure "
                   "--loss-chunks 32",
    "llama-compiled": "llama -b 1 --seq-len 2048 --device rtx4090 --steps 1000",
    "lumina-compiled": "dit-lumina2 --adapter lora:r=16 --resolution 1024 --device rtx4090 -b 2 --steps 1000",
    "qwen-lora-compiled": "Qwen/Qwen2.5-7B-Instruct --device rtx4090 -b 2 --seq-len 2048 --adapter lora:r=16 --steps 1000",
}
HUB_CONFIGS = Path(__file__).resolve().parent / "hub_configs"
"""``org--name/config.json`` per hub id the cases name."""
DEFAULT = "readme-gpt2,readme-llama,readme-methods,llama-14,gpt2-2,gpt2-4"

HEADER = re.compile(r"candidate plans, (\d+) traced, ([\d.]+) s")


def hub_cache(home: Path) -> None:
    """A Hugging Face cache under ``home`` holding each of ``HUB_CONFIGS``'s config files, laid out
    as huggingface_hub lays it out."""
    for folder in HUB_CONFIGS.iterdir():
        repo = home / "hub" / f"models--{folder.name}"
        snapshot = repo / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True, exist_ok=True)
        for file in folder.iterdir():  # (config.json; a vision-language model's preprocessor_config.json)
            (snapshot / file.name).write_bytes(file.read_bytes())
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text("0" * 40)


def run_case(args: str, src: Path, cache: str | None, breakdown: bool = False) -> dict:
    """One ``memfit plan`` process: its wall seconds, the header's planning seconds and traces, the choice
    (``breakdown``: run with --json and keep each search's trace seconds)."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as cold, tempfile.TemporaryDirectory() as hf_home:
        hub_cache(Path(hf_home))
        env["HF_HOME"] = hf_home
        env["TORCHINDUCTOR_CACHE_DIR"] = cache or cold
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "memfit.cli.main", "plan", *args.split(),
                               *(["--json"] if breakdown else [])], env=env,
                              capture_output=True, text=True, cwd=tempfile.gettempdir())
        wall = time.perf_counter() - t0
    if breakdown:
        return _from_json(proc, wall)
    out = proc.stdout
    traces = [int(m.group(1)) for m in HEADER.finditer(out)]
    planning = [float(m.group(2)) for m in HEADER.finditer(out)]
    lines = out.splitlines()
    chosen = [line.split(" · ")[0].removeprefix("chosen: ") for line in lines if line.startswith("chosen:")]
    chosen += [" ".join(line.split()) for line in lines if line.split()[:1] in (["full"], ["lora"], ["dora"], ["qlora"])]
    chosen = chosen or [line.strip() for line in lines if "nothing fits" in line.lower()][:1]
    return {"rc": proc.returncode, "wall_s": round(wall, 1), "planning_s": planning, "traces": traces,
            "chosen": chosen, "error": proc.stderr.strip().splitlines()[-1:] if proc.returncode else []}


def _from_json(proc, wall: float) -> dict:
    """``run_case``'s figures from a ``--json`` run, with each search's trace seconds."""
    out = {"rc": proc.returncode, "wall_s": round(wall, 1), "error": proc.stderr.strip().splitlines()[-1:]
           if proc.returncode else [], "searches": []}
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {**out, "planning_s": [], "traces": [], "chosen": []}
    results = [(m["method"], m) for m in data["methods"]] if "methods" in data else [("plan", data)]
    for name, r in results:
        out["searches"].append({"search": name, "planning_s": round(r["planning_seconds"], 1), "traces": r["traces"],
                                "chosen": r["chosen"]["plan"] if r["chosen"] else None,
                                "trace_seconds": r.get("trace_seconds", {})})
    out["planning_s"] = [s["planning_s"] for s in out["searches"]]
    out["traces"] = [s["traces"] for s in out["searches"]]
    out["chosen"] = [f"{s['search']}: fits" if s["chosen"] else f"{s['search']}: nothing fits" for s in out["searches"]]
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT, help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--warm", action="store_true", help="one Inductor cache per case, kept across repeats")
    parser.add_argument("--against", type=Path, help="another checkout, timed in turns with this one")
    parser.add_argument("--out", type=Path, help="append each run as a JSON line here")
    parser.add_argument("--breakdown", action="store_true", help="per search: traces and seconds by phase and kind")
    args = parser.parse_args()
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    sources = {"this": ROOT / "src", **({"against": args.against / "src"} if args.against else {})}
    print(f"machine: {_cpu_model()}, {os.cpu_count()} cores; "
          f"{'warm' if args.warm else 'cold'} Inductor cache; commands: memfit plan <case's arguments>")
    for name in args.cases.split(","):
        walls: dict[str, list[float]] = {k: [] for k in sources}
        caches = {k: tempfile.mkdtemp() if args.warm else None for k in sources}
        for i in range(args.repeat):
            for which, src in sources.items():
                r = run_case(CASES[name], src, caches[which], args.breakdown)
                walls[which].append(r["wall_s"])
                print(f"{name:14s} {which:7s} run {i + 1}: {r['wall_s']:6.1f} s wall  planning {r['planning_s']} s  "
                      f"traces {r['traces']}  rc {r['rc']}  chosen: {'; '.join(r['chosen']) or r['error']}", flush=True)
                for search in r.get("searches", ()):
                    for key, (n, sec) in sorted(search["trace_seconds"].items()):
                        print(f"{'':14s}   {search['search']:6s} {key:42s} {n:3d} traces {sec:7.1f} s", flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps({"case": name, "args": CASES[name], "source": which, "run": i + 1,
                                            "warm": args.warm, **r}) + "\n")
        line = "  ".join(f"{k} median {statistics.median(v):.1f} s" for k, v in walls.items())
        if args.against:
            ratios = [a / b for a, b in zip(walls["this"], walls["against"])]
            line += f"  this/against {statistics.median(ratios):.2f}x (median of {len(ratios)} turns)"
        print(f"{name:14s} {line}  [memfit plan {CASES[name]}]", flush=True)


if __name__ == "__main__":
    main()
