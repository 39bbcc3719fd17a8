"""torchtune's own Llama-3.1-8B single-device configs, read with ``--from`` as a torchtune user has them, predicted
for the ``rtx4090`` preset beside what torchtune's README publishes for them on an RTX 4090.

Usage: ``python -m bench.torchtune_published [--no-compile]``. Each config (tests/data/torchtune, copied from
pytorch/torchtune) is set as the README's table says its figures were taken: batch 2 without accumulation, a dataset
packed to 2,048 tokens (``tokenizer.max_seq_len: 2048``), ``compile: True``; its ``checkpointer.checkpoint_dir``
points at a folder holding Llama-3.1-8B-Instruct's config.json (bench/hub_configs), as ``tune download`` leaves it.
Prints memfit's allocated and reserved peaks (``memfit estimate --from``, in this process) beside the README's
"Peak Memory per GPU" (18.9, 16.2 and 7.4 GiB) and its tokens/s, which memfit's estimate does not give.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml

from bench.planning_time import _cpu_model

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "data" / "torchtune"
LLAMA_31_8B = Path(__file__).resolve().parent / "hub_configs" / "meta-llama--Meta-Llama-3.1-8B-Instruct"
PUBLISHED = {"llama3_1_8B_full_single_device": ("full", 18.9, 1650),
             "llama3_1_8B_lora_single_device": ("LoRA", 16.2, 3083),
             "llama3_1_8B_qlora_single_device": ("QLoRA", 7.4, 2413)}
"""Config -> (method, GiB, tokens/s) of torchtune's README table (Llama 3.1 8B, 1x 4090, batch 2, packed 2048,
compile)."""


def as_published(name: str, folder: Path, compiled: bool) -> Path:
    """The config ``name`` set as the README's figures were taken, written under ``folder``."""
    data = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    data["checkpointer"]["checkpoint_dir"] = str(LLAMA_31_8B)
    data["tokenizer"]["max_seq_len"] = 2048
    data.update(batch_size=2, gradient_accumulation_steps=1, compile=compiled)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> None:
    import memfit
    from memfit.devices import get_device
    from memfit.integrations.from_file import read_training_config
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="the configs' own compile: False")
    args = parser.parse_args()
    print(f"machine: {_cpu_model()}; preset rtx4090")
    card = get_device("rtx4090")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (method, gib, tokens) in PUBLISHED.items():
            if not (CONFIGS / f"{name}.yaml").is_file():
                print(f"{name}: not in {CONFIGS}")
                continue
            c = read_training_config(as_published(name, Path(tmp), not args.no_compile), card)
            t0 = time.perf_counter()
            r = memfit.estimate(c.workload, c.plan, batch_size=c.batch_size, seq_len=c.seq_len, device=card)
            print(f"{method}: {c.plan.describe()}: predicted {r.peak_bytes / 2**30:.2f} GiB allocated, "
                  f"{r.reserved_bytes / 2**30:.2f} GiB reserved ({time.perf_counter() - t0:.0f} s); torchtune's README "
                  f"{gib} GiB, {tokens} tokens/s", flush=True)


if __name__ == "__main__":
    main()
