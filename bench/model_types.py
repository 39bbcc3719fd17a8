"""Every model type transformers can build for a head memfit feeds, estimated as a new user's folder would be.

For each model type of the installed transformers' causal-LM, vision-language, speech seq2seq, CTC, seq2seq
and image-classification mappings, a folder holds its default config (``AutoConfig.for_model(type)``) cut to 2
layers (the lists that follow the layers cut with them), and ``memfit estimate FOLDER --adapter lora:r=8 -b 1
--device rtx4090`` runs on it in this process (image classifiers without the adapter and without a sequence
length). Each outcome is one of: estimated; a one-line refusal (exit 2: what memfit cannot feed, or a default
config that cannot build a model); an **internal error** (exit 1: a bug). A robustness check of what memfit does
with the models it meets, not figures: default configs are not checkpoints, and some do not build on their own.

Stop 114 (2026-12-06) ran it as subprocesses: 335 types, six internal errors, all fixed (docs in the stop's note).

    .venv/bin/python -m bench.model_types [--types llama,qwen3_5] [--only-errors]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import time

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "num_encoder_layers")
MAPPINGS = {"causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "vlm": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
            "speech": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
            "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
            "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"}


def shrink(config: dict) -> None:
    """``config`` (a dict) cut to 2 layers, with the per-layer lists and tables that follow them."""
    layers = None
    for key in LAYER_KEYS:
        if isinstance(config.get(key), int) and config[key] > 2:
            layers = layers or config[key]
            config[key] = 2
    if layers:
        for key, value in list(config.items()):
            if isinstance(value, list) and len(value) == layers:
                config[key] = value[:2]
            elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
                config[key] = {k: v for k, v in value.items() if int(k) < 2}
    for value in config.values():
        if isinstance(value, dict) and "model_type" in value:
            shrink(value)


def model_types(only: list[str] | None) -> list[tuple[str, str]]:
    from transformers.models.auto import modeling_auto
    seen, out = set(), []
    for kind, name in MAPPINGS.items():
        for model_type in getattr(modeling_auto, name, {}):
            if model_type not in seen and (not only or model_type in only):
                seen.add(model_type)
                out.append((kind, model_type))
    return out


def run(kind: str, model_type: str, root: str) -> tuple[str, str]:
    """(outcome, the last line memfit printed) of one model type's estimate."""
    from transformers import AutoConfig

    from memfit.cli.main import main
    try:
        config = AutoConfig.for_model(model_type).to_dict()
    except Exception as e:  # noqa: BLE001 - transformers cannot make its default: nothing of memfit's to try
        return "no default config", f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    shrink(config)
    folder = os.path.join(root, model_type)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, default=str)
    args = ["estimate", folder, "-b", "1", "--device", "rtx4090"]
    if kind != "image":
        args += ["--adapter", "lora:r=8", "--seq-len", "256"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    last = next((line for line in reversed(err.getvalue().splitlines()) if line.startswith("memfit")), "")
    return {0: "estimated", 2: "refused"}.get(code, "INTERNAL ERROR"), last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every one)")
    parser.add_argument("--only-errors", action="store_true", help="print internal errors only")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    counts: dict[str, int] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        for kind, model_type in model_types(args.types.split(",") if args.types else None):
            outcome, last = run(kind, model_type, root)
            counts[outcome] = counts.get(outcome, 0) + 1
            if not args.only_errors or outcome == "INTERNAL ERROR":
                print(f"{kind:9} {model_type:28} {outcome:17} {last[:160]}", flush=True)
    print(f"{sum(counts.values())} model types in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
