"""How memfit reads LLaMA-Factory's example configs: how many it reads, refuses (and why), and warns about.

Usage: ``python -m bench.llamafactory_examples PATH`` with PATH a checkout of LLaMA-Factory (its ``examples/``):
each YAML with a ``model_name_or_path`` is mapped as ``--from`` maps it (memfit.integrations.llamafactory, the
``h100-80gb`` preset; no model is built, nothing is traced), and the "is not mapped" warnings counted
(bench.config_examples). Its inference, merging and export configs (``do_train`` not true) are left out.

``python -m bench.llamafactory_examples --qwen7b``: LLaMA-Factory's LoRA and QLoRA examples
(tests/data/llamafactory/) on Qwen2.5-7B-Instruct at 2 x 2,048 tokens, estimated with ``--from`` on the ``rtx4090``
preset, as a user with the model's config.json alone in the Hugging Face cache runs them (offline, from
bench/hub_configs/): each one's line, its allocated, reserved and on-device bytes, and the seconds it took; then
``memfit plan --from`` the LoRA one (2 a device x 8 accumulated) ``--format llamafactory``: the chosen plan, its
LLaMA-Factory fields and the planning seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.config_examples import report, survey
from memfit.integrations.llamafactory import is_llamafactory, map_config


def _training(data: object) -> bool:
    return is_llamafactory(data) and data.get("do_train") is True


QWEN_ROWS = {"qwen3-lora-sft.yaml": {}, "qwen3-qlora-sft.yaml": {},
             "qwen3-lora-sft.yaml, pure_bf16": {"pure_bf16": True, "bf16": False}}
"""LLaMA-Factory's examples run on Qwen2.5-7B-Instruct: the file, and the fields changed beside the model and sizes."""


def qwen7b_rows() -> None:
    import json
    import os
    import subprocess
    import tempfile
    import time

    import yaml

    from bench.planning_time import hub_cache
    from memfit.plans import Plan
    home = Path(tempfile.mkdtemp(prefix="memfit-hf-"))
    hub_cache(home)
    data = Path(__file__).resolve().parents[1] / "tests" / "data" / "llamafactory"
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for row, changes in QWEN_ROWS.items():
        config = yaml.safe_load((data / row.split(",")[0]).read_text())
        config.update(model_name_or_path="Qwen/Qwen2.5-7B-Instruct", per_device_train_batch_size=2,
                      gradient_accumulation_steps=1, cutoff_len=2048, **changes)
        path = home / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "memfit.cli.main", "estimate", "--from", str(path), "--device", "rtx4090",
                              "--json"], capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - start
        if out.returncode:
            print(f"{row}: exit {out.returncode}: {out.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(out.stdout)
        gib = 2 ** 30
        plan = Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in r["plan"].items()}).describe()
        print(f"{row}: {plan}")
        print(f"  allocated {r['peak_bytes'] / gib:.2f} GiB, reserved {r['reserved_bytes'] / gib:.2f} GiB, at load "
              f"{r['load_peak_bytes'] / gib:.2f} GiB, fits: {r['fits']}; "
              f"{seconds:.1f} s")
    config = yaml.safe_load((data / "qwen3-lora-sft.yaml").read_text())
    config.update(model_name_or_path="Qwen/Qwen2.5-7B-Instruct", per_device_train_batch_size=2,
                  gradient_accumulation_steps=8, cutoff_len=2048)
    path = home / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([sys.executable, "-m", "memfit.cli.main", "plan", "--from", str(path), "--device", "rtx4090",
                          "--format", "llamafactory", "--json"], capture_output=True, text=True, env=env)
    r = json.loads(out.stdout)
    chosen = r["chosen"]
    print(f"plan --from qwen3-lora-sft.yaml (2 x 8 accumulated) --format llamafactory: "
          f"{Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in chosen['plan'].items()}).describe()}")
    print(f"  predicted {chosen['used_bytes'] / 2 ** 30:.2f} GiB on the device ({chosen['peak_bytes'] / 2 ** 30:.2f} GiB "
          f"allocated), {chosen['tokens_per_second']:,.0f} tokens/s; {r['planning_seconds']:.1f} s of planning, "
          f"{r['traces']} traces")
    print("  fields: " + ", ".join(f"{k}: {v}" for k, v in r["llamafactory_fields"].items()
                                   if k not in ("model_name_or_path", "stage", "do_train")))


def main(argv: list[str]) -> None:
    if argv == ["--qwen7b"]:
        qwen7b_rows()
        return
    if len(argv) != 1 or not (Path(argv[0]) / "examples").is_dir():
        sys.exit("usage: python -m bench.llamafactory_examples PATH (a checkout of LLaMA-Factory, with its examples/)")
    report(survey(Path(argv[0]), _training, map_config))


if __name__ == "__main__":
    main(sys.argv[1:])
