"""The files a SimpleTuner config names, as memfit reads them (memfit.integrations.simpletuner reads the config):
its data backends (``data_backend_config``, multidatabackend.json: each dataset's ``resolution``,
``resolution_type``, ``train_batch_size`` and clip length) and its LyCORIS network (``lycoris_config``).

Read from SimpleTuner's source: simpletuner/helpers/data_backend/factory.py (a dataset's ``resolution`` and
``resolution_type`` fall back to the config's; ``pixel_area`` becomes an area of ``resolution`` squared; a video's
``num_frames`` defaults to 5 seconds at 30 fps), simpletuner/helpers/data_backend/dataset_types.py
(``resolve_dataset_train_batch_size``: a dataset's own ``train_batch_size`` wins), simpletuner/helpers/multiaspect/
image.py (a bucket's sides rounded to ``aspect_bucket_alignment``, default 64) and simpletuner/helpers/training/
trainer.py (``init_trainable_peft_adapter``: ``linear_dim``, ``linear_alpha``, ``apply_preset``).

SimpleTuner draws each step's batch from one dataset: memfit's step is the one that holds the most (its batch times
its bucket's pixels times its frames), said where there are several.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from memfit.errors import UserError, parse_problem

SKIPPED = ("text_embeds", "image_embeds", "conditioning_image_embeds", "distillation_cache", "caption", "eval",
           "conditioning", "audio", "grounding")
"""Dataset types that are no batch of the denoiser's own (caches, references, evaluation)."""
LYCORIS_EXAMPLE = {"algo": "lokr", "multiplier": 1.0, "full_matrix": True, "linear_alpha": 1, "factor": 16,
                   "apply_preset": {"target_module": ["Attention", "FeedForward"],
                                    "module_algo_map": {"Attention": {"factor": 16}, "FeedForward": {"factor": 8}}}}
"""SimpleTuner's config/lycoris_config.json.example, read where a config's ``lycoris_config`` is not found."""


def find(name: str, base: Path | None) -> Path | None:
    """A file a config names: as given, beside the config, or under a folder above it (SimpleTuner runs from its
    repository's root, where configs name ``config/...``; ``config/examples/`` is its package's ``examples/``)."""
    path = Path(name).expanduser()
    tries = [path]
    if base is not None and not path.is_absolute():
        tries += [folder / path for folder in (base, *list(base.parents)[:3])]
        if path.parts[:2] == ("config", "examples"):
            tries += [folder / Path(*path.parts[1:]) for folder in (base, *list(base.parents)[:3])]
    return next((p for p in tries if p.is_file()), None)


def read_json(path: Path, where: str, what: str):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--from {where}: cannot read {what} {path} ({e}); check the file") from None
    except ValueError as e:
        raise UserError(f"--from {where}: {what} {path} is not valid JSON ({parse_problem(e)}); fix the file") from None


def datasets(args: dict, where: str, base: Path | None, warnings: list[str]) -> list[dict] | None:
    """The enabled datasets of ``data_backend_config`` (a path, or the list itself); None where there is none here."""
    value = args.get("data_backend_config")
    if isinstance(value, str) and value.strip().startswith("["):
        value = read_json_text(value, where)
    if isinstance(value, str) and value.strip():
        path = find(value.strip(), base)
        if path is None:
            warnings.append(f"SimpleTuner config {where}: data_backend_config {value} is not found here; the batch "
                            "and size are the config's train_batch_size and resolution")
            return None
        value = read_json(path, where, "data_backend_config")
    if value is None or value == "":
        return None
    if not isinstance(value, list) or not all(isinstance(d, dict) for d in value):
        raise UserError(f"--from {where}: data_backend_config must be a list of datasets (multidatabackend.json), "
                        f"got {type(value).__name__}")
    return [d for d in value if not (d.get("disabled") or d.get("disable"))]


def read_json_text(text: str, where: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise UserError(f"--from {where}: data_backend_config is not valid JSON ({parse_problem(e)})") from None


def trained(sets: list[dict]) -> list[dict]:
    """The datasets whose samples are the denoiser's batches."""
    return [d for d in sets if str(d.get("dataset_type") or "image") not in SKIPPED]


def side(resolution, kind: str, align: int, where: str, who: str) -> int:
    """A bucket's side: ``pixel`` (the shorter side), ``pixel_area`` (an area of the side squared) and ``area``
    (megapixels), rounded to the alignment as SimpleTuner rounds a bucket's sides."""
    if isinstance(resolution, str):
        try:
            resolution = float(resolution)
        except ValueError:
            pass
    if isinstance(resolution, bool) or not isinstance(resolution, (int, float)) or resolution <= 0:
        raise UserError(f"--from {where}: {who} resolution must be a number > 0, got {resolution!r}")
    if kind not in ("pixel", "area", "pixel_area"):
        raise UserError(f"--from {where}: {who} resolution_type {kind!r} is not one of pixel, area, pixel_area")
    edge = math.sqrt(resolution * 1e6) if kind == "area" else resolution
    return max(align, round(edge / align) * align)


def largest(sets: list[dict] | None, args: dict, batch: int, frames_of, vae: bool, where: str,
            warnings: list[str]) -> tuple[int, int, int]:
    """(micro-batch, side, frames) of the step that holds the most; ``frames_of(dataset)``: a dataset's clip;
    ``vae``: the config's own ``vae_cache_ondemand`` or ``vae_cache_disable``."""
    align = int(args.get("aspect_bucket_alignment", 64) or 64)
    resolution, kind = args.get("resolution", 1024), str(args.get("resolution_type", "pixel_area"))
    if not sets:
        _pixel_said(kind, {}, where, warnings)
        _vae_said(vae, where, warnings)
        return batch, side(resolution, kind, align, where, "the config's"), 1
    steps = []
    for d in trained(sets):
        who = f"dataset {d.get('id')!r}"
        size = d.get("train_batch_size", batch)
        if isinstance(size, str) and size.isdecimal():
            size = int(size)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise UserError(f"--from {where}: {who} train_batch_size must be a whole number >= 1, got {size!r}")
        one = side(d.get("resolution", resolution), str(d.get("resolution_type", kind)), align, where, who)
        count = frames_of(d)
        steps.append((size * one * one * count, size, one, count, d))
    if not steps:
        raise UserError(f"--from {where}: data_backend_config holds no image or video dataset; give the one the "
                        "config trains on")
    _, size, one, count, chosen = max(steps, key=lambda s: s[0])
    if len(steps) > 1:
        warnings.append(f"SimpleTuner config {where}: {len(steps)} datasets; memfit's step is dataset "
                        f"{chosen.get('id')!r}'s, the largest ({size} x {one} px" +
                        (f" x {count} frames)" if count > 1 else ")"))
    _pixel_said(str(chosen.get("resolution_type", kind)), chosen, where, warnings)
    _vae_said(vae or any(d.get("vae_cache_disable") or d.get("vae_cache_ondemand") for d in trained(sets)), where,
              warnings)
    return size, one, count


def _vae_said(vae: bool, where: str, warnings: list[str]) -> None:
    if vae:
        warnings.append(f"SimpleTuner config {where}: vae_cache_ondemand or vae_cache_disable: the VAE encodes in the "
                        "step; memfit's batch is the cached latents, so the VAE is not in the estimate")


def _pixel_said(kind: str, dataset: dict, where: str, warnings: list[str]) -> None:
    square = dataset.get("crop") and dataset.get("crop_aspect") == "square"
    if kind == "pixel" and not square:
        warnings.append(f"SimpleTuner config {where}: resolution_type pixel sizes an image's shorter side; memfit's "
                        "image is that side squared (low for other aspects: give --resolution WxH)")


def lycoris(args: dict, where: str, base: Path | None, warnings: list[str]) -> dict:
    """The LyCORIS network's config (``lycoris_config``, a JSON file), or SimpleTuner's example where not found."""
    name = str(args.get("lycoris_config") or "config/lycoris_config.json")
    path = find(name, base)
    if path is None:
        warnings.append(f"SimpleTuner config {where}: lycoris_config {name} is not found here; read as SimpleTuner's "
                        "example (LoKr, full matrix, factor 16, Attention and FeedForward)")
        return dict(LYCORIS_EXAMPLE)
    config = read_json(path, where, "lycoris_config")
    if not isinstance(config, dict) or "algo" not in config:
        raise UserError(f"--from {where}: lycoris_config {path} must be a JSON object with algo (SimpleTuner asserts it)")
    return config
