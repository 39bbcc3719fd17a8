"""Diffusion models with their text encoders in the step, and the trainers' configs that run them.

Prints the tables of docs/fine-tuning.md (Text encoders in the step) and the `--from` figures of
docs/estimate.md: allocated, reserved and on-the-device bytes (reserved + the preset's CUDA context) of

- FLUX.1-dev, LoRA r=16 on every linear layer, fp8 base weights, bf16-base, blocks, batch 1 at 1024 px on
  the rtx4090 preset, with its text encoders cached, CLIP-L trained over T5's cached states, frozen, trained;
- SD3 medium (the same LoRA, no fp8) on rtx3060-12gb, and Lumina 2 on rtx4090, in the same modes;
- sd-scripts' basic FLUX command and ai-toolkit's 24 GB FLUX example (tests/data), as `--from` reads them;
  ai-toolkit's examples for SD3.5 Large, Lumina 2, Qwen-Image, Wan 2.1 (14B, 1.3B) and Z-Image Turbo
  (``--only ai-toolkit``).

Predictions only (fake tensors on this CPU, a GPU preset's kernels); about 30 s an estimate.

    .venv/bin/python -m bench.text_encoders [--only flux,sd3,lumina,configs,ai-toolkit]
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

warnings.simplefilter("ignore")

from memfit.devices import get_device  # noqa: E402
from memfit.integrations.from_file import read_training_config  # noqa: E402
from memfit.memory.estimate import estimate  # noqa: E402
from memfit.plans import Plan  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
LORA = {"adapter": "lora:r=16,alpha=16,targets=all-linear", "precision": "bf16-base", "checkpointing": "blocks"}
MODES = ("", "text_encoders=trained,t5=cached", "text_encoders=frozen", "text_encoders=trained")
CASES = {
    "flux": ("dit-flux", MODES, {**LORA, "base_weights": "fp8"}, "rtx4090"),
    "sd3": ("dit-sd3", MODES, {**LORA, "adapter": "lora:r=16,targets=all-linear"}, "rtx3060-12gb"),
    "lumina": ("dit-lumina2", ("", "text_encoders=frozen", "text_encoders=trained"),
               {**LORA, "adapter": "lora:r=16,targets=all-linear"}, "rtx4090"),
}
CONFIGS = (("kohya/flux-docs-basic.toml", "rtx4090"), ("ai_toolkit/train_lora_flux_24gb.yaml", "rtx4090"))
AI_TOOLKIT = tuple((f"ai_toolkit/{name}.yaml", "rtx4090") for name in (
    "train_lora_sd35_large_24gb", "train_lora_lumina", "train_lora_qwen_image_24gb", "train_lora_wan21_14b_24gb",
    "train_lora_wan21_1b_24gb", "train_lora_zimage_turbo_32gb"))
"""ai-toolkit's examples for other models, each for a 24 GB card (``--only ai-toolkit``)."""


def _row(label: str, report, seconds: float) -> str:
    gib = 2 ** 30
    on_device = (report.reserved_bytes or report.peak_bytes) + (report.cuda_context_bytes or 0)
    return (f"| {label} | {report.breakdown['parameters'] / gib:.2f} | {report.peak_bytes / gib:.2f} | "
            f"{(report.reserved_bytes or 0) / gib:.2f} | {on_device / gib:.2f} | {seconds:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="flux,sd3,lumina,configs")
    only = parser.parse_args().only.split(",")
    header = "| case | parameters GiB | allocated GiB | reserved GiB | on the device GiB | time |\n|---|---:|---:|---:|---:|---:|"
    for name, (arch, modes, plan, device) in CASES.items():
        if name not in only:
            continue
        print(f"\n{arch}, {Plan(**plan).describe()}, batch 1 at 1024 px, {device}\n{header}")
        for mode in modes:
            t0 = time.perf_counter()
            report = estimate(f"{arch}:{mode}" if mode else arch, Plan(**plan), batch_size=1, device=device,
                              resolution=1024)
            print(_row(mode or "(cached)", report, time.perf_counter() - t0), flush=True)
    for section, configs in (("configs", CONFIGS), ("ai-toolkit", AI_TOOLKIT)):
        if section not in only:
            continue
        print(f"\n--from the trainers' configs\n{header}")
        for path, device in configs:
            t0 = time.perf_counter()
            c = read_training_config(DATA / path, get_device(device))
            report = estimate(c.workload, c.plan, batch_size=c.batch_size, device=device, resolution=c.resolution)
            print(_row(f"{path} ({c.workload}, batch {c.batch_size}, {device})", report, time.perf_counter() - t0),
                  flush=True)


if __name__ == "__main__":
    main()
