"""The built-in workloads' registry: the Hugging Face architectures, the plain-torch zoo and the
diffusers image and video models (the only ones that take ``--resolution``). The Hugging Face and
diffusers models, hub ids and model folders load as their library loads a checkpoint
(``Workload.from_checkpoint``: each weight reaches the device in its final form, bf16 or quantized);
the zoo's plain-torch models are built as written.
A diffusers repository (a hub id or a folder) builds its denoiser from its own config.json and loads as
``from_pretrained`` loads it (NOTE [ diffusers repositories ] in memfit.workloads.diffusers_folders)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from memfit.errors import UserError
from memfit.units import parse_key_values
from memfit.workload import Workload
from memfit.workloads import (
    adapter_folders,
    caption_dits,
    cogvideo,
    diffusion,
    hf,
    hidream,
    hub,
    ltx2,
    ltx_video,
    packed_dits,
    video_dits,
    zimage,
    zoo,
)
from memfit.workloads.checks import (
    blamed,
    check_resolution,
    check_seq_len,
    guarded,
    split_resolution,
    width_said_as_given,
)
from memfit.workloads.config_overrides import parse_overrides

IMAGE_BUILDERS = {**diffusion.BUILDERS, **packed_dits.BUILDERS, **video_dits.BUILDERS, **zimage.BUILDERS,
                  **caption_dits.BUILDERS, **cogvideo.BUILDERS, **ltx_video.BUILDERS,
                  **ltx2.BUILDERS, **hidream.BUILDERS}
"""The built-ins that take ``--resolution`` (the image and video diffusion models)."""

_REGISTRY: dict[str, tuple[Callable[..., Workload], str]] = {
    **{name: (fn, doc) for name, (fn, doc) in hf.BUILDERS.items()},
    **{name: (fn, doc) for name, (fn, doc) in zoo.BUILDERS.items()},
    **{name: (fn, doc) for name, (fn, doc) in IMAGE_BUILDERS.items()},
}


def builtin_names() -> dict[str, str]:
    """Built-in workload names with a one-line description."""
    return {name: doc for name, (_, doc) in _REGISTRY.items()}


def builtin_workload(spec: str, *, seq_len: int | None = None, resolution: int | None = None) -> Workload:
    arch, _, override_text = spec.partition(":")
    arch = arch.strip().lower()
    if arch not in _REGISTRY:
        raise UserError(f"unknown workload {arch!r}; {_suggestion(arch)}choose a built-in ({', '.join(_REGISTRY)}), "
                        "a Hugging Face hub id (org/name: its config.json), a file (path/to/file.py:NAME) or a model "
                        "folder (./dir holding config.json)")
    check_seq_len(seq_len)
    check_resolution(resolution)
    builder, _ = _REGISTRY[arch]
    overrides = parse_key_values(override_text, arch)
    if arch in IMAGE_BUILDERS:
        height, sized = split_resolution(resolution, overrides, arch)  # NOTE [ A resolution's width ]
        with width_said_as_given(resolution, overrides):
            wl = builder(sized, seq_len, height)
    else:
        if resolution is not None:
            raise UserError(f"{arch}: --resolution applies to the image- and video-generation built-ins "
                            f"({', '.join(IMAGE_BUILDERS)}); drop it (image sizes of other models are overrides)")
        wl = builder(overrides, seq_len)
    return dataclasses.replace(wl, model=guarded(arch, overrides, "building the model", wl.model),
                               batch=guarded(arch, overrides, "batch(batch_size)", wl.batch),
                               loss=guarded(arch, overrides, "loss(model, batch)", wl.loss),
                               from_checkpoint=arch in hf.BUILDERS or wl.from_checkpoint)


def folder_workload(path: str, *, seq_len: int | None = None, resolution: int | None = None,
                    load: Callable[..., Workload] | None = None, overrides: str = "") -> Workload:
    """A local Hugging Face model folder, built from its config.json (NOTE [ Model folders ] in
    :mod:`memfit.workloads.hf`; a diffusers pipeline: NOTE [ diffusers repositories ]; a PEFT adapter, its
    base loaded with ``load``: NOTE [ Adapter checkpoints ]); a failure to build or run it is the
    config's, named as such. ``overrides``: ``key=value,...`` of its config.json (NOTE [ Overrides of a
    config.json ])."""
    check_seq_len(seq_len)
    check_resolution(resolution, text_only=True)
    where = f"model folder {path}"
    folder = Path(path).expanduser()
    if load is not None and adapter_folders.is_adapter_folder(folder):
        _no_adapter_overrides(overrides, where)
        return adapter_folders.adapter_workload(folder, path, where, load, seq_len, resolution)
    wl = hf.folder(path, seq_len, resolution=resolution, name=f"{path}:{overrides}" if overrides else None,
                   overrides=parse_overrides(overrides, path))
    return _blamed_on_config(wl, where, "change the overrides" if overrides else "fix its config.json")


def hub_workload(hub_id: str, *, seq_len: int | None = None, resolution: int | None = None,
                 load: Callable[..., Workload] | None = None, overrides: str = "") -> Workload:
    """A Hugging Face hub id (``org/name[@revision]``): its config.json alone (a diffusers pipeline's:
    its denoiser's; a PEFT adapter's: its adapter_config.json, its base loaded with ``load``), from the
    hub's cache or fetched into it, built as a model folder (NOTE [ Hub ids ] in :mod:`memfit.workloads.hub`)."""
    check_seq_len(seq_len)
    check_resolution(resolution, text_only=True)
    source = f"hub model {hub_id}"
    snapshot = hub.hub_config_folder(hub_id)
    if load is not None and adapter_folders.is_adapter_folder(snapshot):
        _no_adapter_overrides(overrides, source)
        return adapter_folders.adapter_workload(snapshot, hub_id, source, load, seq_len, resolution)
    wl = hf.folder(str(snapshot), seq_len, name=f"{hub_id}:{overrides}" if overrides else hub_id, where=source,
                   resolution=resolution, overrides=parse_overrides(overrides, hub_id))
    return _blamed_on_config(wl, source, "change the overrides" if overrides else
                             "write a file workload (path/to/file.py:NAME) that builds it")


def _no_adapter_overrides(overrides: str, where: str) -> None:
    if overrides:
        raise UserError(f"{where} is a PEFT adapter, whose config has no model fields to override; drop the overrides")


def _blamed_on_config(wl: Workload, source: str, fix: str) -> Workload:
    return dataclasses.replace(wl, model=blamed(source, fix, "building the model", wl.model),
                               batch=blamed(source, fix, "batch(batch_size)", wl.batch),
                               loss=blamed(source, fix, "loss(model, batch)", wl.loss), from_checkpoint=True)


FAMILIES = {
    "llama2": "llama", "llama-2": "llama", "flux": "dit-flux", "flux1": "dit-flux", "sdxl": "unet-sdxl",
    "sd15": "unet-sd15", "sd1.5": "unet-sd15", "sd3": "dit-sd3", "lumina2": "dit-lumina2", "wan": "dit-wan",
    "qwenimage": "dit-qwenimage", "qwen-image": "dit-qwenimage", "chroma": "dit-chroma", "hunyuan": "dit-hunyuan-video",
    "sana": "dit-sana", "pixart": "dit-pixart-sigma", "pixart-sigma": "dit-pixart-sigma", "auraflow": "dit-auraflow",
    "cogvideox": "dit-cogvideox", "cogvideo": "dit-cogvideox", "ltx": "dit-ltx-video", "ltx-video": "dit-ltx-video",
    "ltx2": "dit-ltx2", "ltx-2": "dit-ltx2", "hidream": "dit-hidream", "hidream-i1": "dit-hidream",
    "llama3": "meta-llama/Meta-Llama-3-8B", "llama-3": "meta-llama/Meta-Llama-3-8B",
    "llama3.1": "meta-llama/Llama-3.1-8B", "mistral": "mistralai/Mistral-7B-v0.3",
    "mixtral": "mistralai/Mixtral-8x7B-v0.1", "qwen": "Qwen/Qwen2.5-7B-Instruct", "qwen2": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5": "Qwen/Qwen2.5-7B-Instruct", "qwen3": "Qwen/Qwen3-8B", "gemma": "google/gemma-2-9b",
    "gemma2": "google/gemma-2-9b", "gemma3": "google/gemma-3-4b-it", "phi": "microsoft/Phi-3-mini-4k-instruct",
    "phi3": "microsoft/Phi-3-mini-4k-instruct", "whisper": "openai/whisper-large-v3",
}
"""A family name people type -> the built-in, or a hub id of the family (a suggestion: memfit reads any hub id)."""


def _suggestion(name: str) -> str:
    """'did you mean ...? or ' for an unknown workload name that is a family's or close to a built-in's, else ''."""
    import difflib
    family = FAMILIES.get(name.replace("_", "-")) or FAMILIES.get(name.replace("-", "").replace("_", ""))
    close = difflib.get_close_matches(name, list(_REGISTRY), n=1, cutoff=0.8)
    guess = family or (close[0] if close else None)
    return f"did you mean {guess} ({'a hub id' if '/' in guess else 'a built-in'})? or " if guess else ""
