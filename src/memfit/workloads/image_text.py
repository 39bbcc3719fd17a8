"""Vision-language models fed what they fine-tune on: an image and its tokens in each sample.

NOTE [ Image-text batches ]
A vision-language model (transformers' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING``: Qwen2/2.5/3-VL,
LLaVA and LLaVA-NeXT/OneVision, Gemma 3, PaliGemma, Mistral 3 (Pixtral), SmolVLM, LFM2-VL, ...) trains on
samples of an image and text. The image runs through the vision tower, and its features replace
the image tokens of the sequence, whose number the image's size and the processor decide (256 for
Gemma 3 at any size; one per 28x28 pixels for Qwen2.5-VL). The vision tower's activations and the
image tokens are a large part of such a step, so feeding text alone under-counts what users run.

memfit makes each sample's image as the model's own processor would:

1. The image processor is the model type's (transformers' image-processor mapping), configured by
   the folder's ``preprocessor_config.json`` where there is one (a hub id's is downloaded with its
   config.json, if the repository has it), else by its defaults fitted to the vision config (its
   ``image_size``, ``patch_size``, ``spatial_merge_size``, ``temporal_patch_size``).
2. It processes one random RGB image of ``--resolution`` pixels a side (default: the vision
   config's ``image_size``, else :data:`DEFAULT_SIDE`), so resizing, tiling and patching are the
   processor's: ``pixel_values`` and its companions (``image_grid_thw``, ``image_sizes``, ...).
3. The number of image tokens is the model's own answer: its ``get_image_features`` runs once on
   fake tensors (the vision tower at full depth, one language layer), with the tracker's real
   values for the integer inputs (NOTE [ Real values of small integer tensors ]), and counts the
   feature rows.
4. Each sample's ``--seq-len`` tokens (default: the language model's, as a text model's) hold that
   many image tokens after the first token (Qwen's ``vision_start`` token before them, its
   ``vision_end`` after), then random text. Text ids avoid every special id of the config, so the
   image tokens are exactly those placed. Llama 3.2 Vision cross-attends to its image's tiles: one
   ``<|image|>`` token, and a ``cross_attention_mask`` from it to the end, as its processor makes. Labels ignore the image (``-100``, as trainers' collators
   do); ``token_type_ids`` or ``mm_token_type_ids`` mark it where the model's forward takes them.

A batch of B samples is B copies of that image's inputs, concatenated as a processor concatenates
images. ``--resolution 0`` feeds text only (a text fine-tune of a multimodal checkpoint: Gemma 3).
Where any step fails (a model type without an image processor, a processor that needs files, a
vision tower the fake trace cannot count), the sample is text only and the report says why.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from memfit.errors import UserError, brief
from memfit.workload import split_batch

DEFAULT_SIDE = 448
"""Pixels a side of the synthetic image of a model whose vision config fixes no size (Qwen2-VL's
kind, which takes any size): 1,024 patches of 14 px, 256 tokens for Qwen2.5-VL."""
TEXT_ONLY = 0
"""``--resolution 0``: no image, text only."""


@dataclass
class OneImage:
    """One sample's image, as its processor makes it."""

    inputs: dict[str, torch.Tensor]
    """The processor's outputs for one image (``pixel_values``, ``image_grid_thw``, ...)."""
    tokens: int
    """Image tokens the sample's sequence holds for it."""
    size: str
    """The image fed to the processor, width by height in pixels (``448x448``)."""
    shape: str
    """What the processor made of it, in words (``1024 patches``, ``5 tiles of 384x384``)."""


def with_images(cls, config, folder: Path | None, seq: int, vocab: int, resolution: int | None, where: str,
                text_batch: Callable[[int], dict], text_sample: str
                ) -> tuple[Callable[[int], dict], str, Callable | None, str | None]:
    """(batch, one sample in words, how it splits into micro-batches, why no image where one could not be made):
    :func:`image_text_batch`'s, else the text batch given, with why in the words, and None. A batch with an image
    is trained on by :func:`image_text_loss`; a text batch by the model's loss, :func:`fed_text_only` around it."""
    try:
        made = image_text_batch(cls, config, folder, seq, vocab, resolution, where)
    except TextOnly as e:
        return text_batch, (f"{text_sample}; text only: no image, as {e}, so the vision encoder's weights count "
                            "and its activations do not"), None, str(e)
    if made is None:
        return text_batch, f"{text_sample}; text only (--resolution 0): the vision encoder's weights count", None, None
    return *made, split_images, None


def fed_text_only(loss: Callable, why: str, where: str) -> Callable:
    """``loss`` of a vision-language model fed text only because no image could be made (``why``): where the model
    refuses a batch without one (BLIP-2, IDEFICS, Kosmos-2: "missing pixel_values"), one line saying so, not a
    fault of its config.json."""
    def text_loss(model, batch):
        try:
            return loss(model, batch)
        except (TypeError, ValueError) as e:
            if not any(w in str(e).lower() for w in ("pixel", "image")):
                raise
            raise UserError(f"{where}: {type(model).__name__} trains on images and was fed text only ({brief(e, 100)}), "
                            f"as memfit could not make its image: {why}; write a file workload (path/to/file.py:NAME) "
                            "whose batch holds its images") from None
    return text_loss


def split_images(batch: dict, batch_size: int, n: int) -> list[dict]:
    """``n`` micro-batches of an image-text batch. Its image inputs hold each image's rows on the first
    dimension, as processors concatenate them (Qwen2-VL's ``pixel_values``: 1,024 patch rows an image, not
    one), and split with their samples into ``n`` equal parts; the rest splits as any batch. Before, a
    micro-batch held every image's patches and one image's grid (the planner's plans of micro-batches of a
    Qwen2.5-VL failed their trace, and so would a step accumulating them)."""
    images = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0
              and v.shape[0] != batch_size and v.shape[0] % batch_size == 0}
    text = split_batch({k: v for k, v in batch.items() if k not in images}, batch_size, n)
    parts = {k: v.chunk(n) for k, v in images.items()}
    return [{**t, **{k: p[i] for k, p in parts.items()}} for i, t in enumerate(text)]


def image_text_batch(cls, config, folder: Path | None, seq: int, vocab: int, resolution: int | None,
                     where: str) -> tuple[Callable[[int], dict], str] | None:
    """(batch(batch_size), one sample in words) of a vision-language model, or None for text only
    (``--resolution 0``); see NOTE [ Image-text batches ]. Raises :class:`TextOnly` with the reason
    where no image can be made (its words follow "no image, as")."""
    if resolution == TEXT_ONLY:
        return None
    image = one_image(cls, config, folder, resolution)
    image_id = image_token_id(config)
    start = 1 + (getattr(config, "vision_start_token_id", None) is not None)
    end = start + image.tokens + (getattr(config, "vision_end_token_id", None) is not None)
    if end >= seq:
        raise UserError(f"{where}: a {image.size} image takes {image.tokens} tokens, more than "
                        f"--seq-len {seq} holds with its text; raise --seq-len or lower --resolution")
    high, avoid = _text_ids(config, vocab)
    filler = max(set(range(high - len(avoid) - 1, high)) - set(avoid))  # (a text id that is no special one)
    params = inspect.signature(cls.forward).parameters
    type_ids = next((k for k in ("mm_token_type_ids", "token_type_ids") if k in params), None)
    prefix = getattr(config, "model_type", "") == "paligemma"  # (its type ids: 0 the image and prompt, 1 the rest)
    cross = "cross_attention_mask" in params

    def batch(batch_size: int) -> dict:
        ids = torch.randint(0, high, (batch_size, seq))
        for special in avoid:  # (a low special id, Pixtral's image token 10: no text token may be one)
            ids.masked_fill_(ids == special, filler)
        ids[:, start:start + image.tokens] = image_id
        if start > 1:
            ids[:, start - 1] = config.vision_start_token_id
        if end > start + image.tokens:
            ids[:, end - 1] = config.vision_end_token_id
        labels = ids.clone()
        labels[:, :end] = -100
        out = {"input_ids": ids, "labels": labels}
        if type_ids is not None:  # (the image's tokens 1; PaliGemma's: 0 for its prefix, the image with it)
            kinds = torch.ones_like(ids) if prefix else torch.zeros_like(ids)
            if prefix:
                kinds[:, :end] = 0
            else:
                kinds[:, start:start + image.tokens] = 1
            out[type_ids] = kinds
        for key, t in image.inputs.items():
            out[key] = _copies(t, batch_size)
        if cross:  # (Llama 3.2 Vision: every token from the image's on attends to its tiles)
            tiles = out["aspect_ratio_mask"]
            mask = torch.zeros((batch_size, seq, *tiles.shape[1:]), dtype=torch.long)
            mask[:, start:] = tiles[:, None]
            out["cross_attention_mask"] = mask
        return out

    sample = (f"a {image.size} image ({image.shape}, {image.tokens} image tokens) in "
              f"{seq} tokens")
    return batch, sample


def image_text_loss(model, batch) -> torch.Tensor:
    """The model's own loss on an image-text batch (NOTE [ Tensors from lists of fake scalars ])."""
    with _ScalarsRead():
        return model(**batch).loss


# NOTE [ Tensors from lists of fake scalars ]
# ``torch.tensor([t0, t1])`` of 0-dim tensors reads each one's data directly, with no op that a dispatch
# mode sees, so on fake tensors it fails ("its data is not allocated yet"). Qwen2-VL's position index
# builds its rope deltas that way (``torch.tensor(mrope_position_deltas)``). So an image-text model's
# forward runs under a function mode that reads such a list's fake tensors first (``.tolist()``, which
# the tracker answers, from real values where it has them: NOTE [ Real values of small integer tensors ]).
# On real tensors it changes nothing. (Not a patch of ``torch.tensor``: torch's device contexts keep the
# function they intercept by identity, in a cache made once, and a patch in place at that moment kept
# ``torch.tensor(...)`` off the device for the rest of the process.)
class _ScalarsRead(TorchFunctionMode):
    """See NOTE [ Tensors from lists of fake scalars ]."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.tensor and args and isinstance(args[0], (list, tuple)) and _holds_fake(args[0]):
            args = (_read(args[0]), *args[1:])
        return func(*args, **(kwargs or {}))


def _holds_fake(data) -> bool:
    return any(isinstance(x, FakeTensor) or isinstance(x, (list, tuple)) and _holds_fake(x) for x in data)


def _read(data):
    if isinstance(data, FakeTensor):
        return data.tolist()
    return [_read(x) for x in data] if isinstance(data, (list, tuple)) else data


class TextOnly(Exception):
    """No image can be made for this model: the reason, said in the report."""


def image_token_id(config) -> int:
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    raise TextOnly("its config names no image token (image_token_id)")


def language_config(config):
    """The config of ``config``'s language model: a multimodal model's ``text_config``, the decoder's where a
    model has a text encoder too (MusicGen's ``text_encoder`` and ``decoder``), else ``config`` itself."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def config_and_text(config) -> list:
    """``config`` and its language model's own config (:func:`language_config`), once each."""
    text = language_config(config)
    return [config] if text is config else [config, text]


def _text_ids(config, vocab: int) -> tuple[int, list[int]]:
    """(text ids are drawn below this, special ids below it that a drawn id must not be)."""
    specials = set()
    for c in config_and_text(config):
        for key, value in vars(c).items():
            if (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int) and value >= 0:
                specials.add(value)
    high = min([vocab] + [s for s in specials if s >= vocab // 2])
    return high, sorted(s for s in specials if s < high)


def _copies(t: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` images' inputs from one's: concatenated on the first dimension, as processors do. Integer
    inputs are lifted from their values (so the trace knows them); pixels are random."""
    if t.is_floating_point():
        return torch.randn((n * t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.tensor(t.tolist(), dtype=t.dtype).repeat(n, *([1] * (t.dim() - 1)))


def one_image(cls, config, folder: Path | None, resolution: int | tuple[int, int] | None) -> OneImage:
    """One sample's image made by the model's processor, and the image tokens it takes; ``resolution``: its
    side, or its (width, height)."""
    processor = image_processor(config, folder)
    vision = getattr(config, "vision_config", None)
    size = getattr(vision, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) and size else size
    side = size if isinstance(size, int) else DEFAULT_SIDE
    width, height = resolution if isinstance(resolution, tuple) else (resolution or side,) * 2  # (NOTE [ A resolution's width ])
    try:
        import numpy as np
        from PIL import Image
        pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
        made = processor(images=[Image.fromarray(pixels)], return_tensors="pt")
    except ImportError as e:
        raise TextOnly(f"making its image needs {e.name} (pip install pillow torchvision)") from None
    except Exception as e:  # noqa: BLE001 - whatever the processor refuses: said, then text only
        raise TextOnly(f"its image processor {type(processor).__name__} failed ({brief(e, 120)})") from None
    if isinstance(made, torch.Tensor):  # (IDEFICS's processor returns the pixels alone)
        made = {"pixel_values": made}
    inputs = {k: v for k, v in made.items() if isinstance(v, torch.Tensor)}
    if "pixel_values" not in inputs:
        raise TextOnly(f"its image processor {type(processor).__name__} makes no pixel_values")
    return OneImage(inputs=inputs, tokens=_image_tokens(cls, config, inputs), size=f"{width}x{height}",
                    shape=_shape_words(inputs["pixel_values"]))


def image_processor(config, folder: Path | None):
    """The model type's image processor: the folder's preprocessor_config.json, else its defaults
    fitted to the vision config."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(config.model_type)
    if isinstance(names, dict):
        names = [names.get("torchvision"), names.get("pil")]
    elif isinstance(names, str):
        names = [names]
    classes = [getattr(transformers, n) for n in names or () if n and hasattr(transformers, n)]
    if not classes:
        raise TextOnly(f"transformers has no image processor for model_type {config.model_type!r}")
    saved = folder / "preprocessor_config.json" if folder is not None else None
    kwargs = {}
    if saved is not None and saved.is_file():
        try:
            kwargs = {k: v for k, v in json.loads(saved.read_text(encoding="utf-8")).items()
                      if not k.startswith("_") and k not in ("image_processor_type", "processor_class", "auto_map")}
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            kwargs = {}
    for processor_cls in classes:
        try:
            made = processor_cls(**kwargs) if kwargs else _fitted(processor_cls, config)
            return made
        except ImportError:
            continue
        except Exception as e:  # noqa: BLE001
            raise TextOnly(f"its image processor {processor_cls.__name__} cannot be built ({brief(e, 120)})") from None
    raise TextOnly("its image processor needs torchvision or pillow (pip install torchvision)")


def _fitted(processor_cls, config):
    """The processor's defaults, with the config's sizes where the two name the same thing."""
    default = processor_cls()
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return default
    fields = {}
    pinpoints = getattr(config, "image_grid_pinpoints", None)  # (LLaVA-NeXT's tiling: the config's is the model's)
    if pinpoints and getattr(default, "image_grid_pinpoints", None) is not None:
        fields["image_grid_pinpoints"] = pinpoints
    size = getattr(vision, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) and size and len(set(size)) == 1 else size
    if isinstance(size, int):
        had = getattr(default, "size", None)
        if getattr(had, "height", None) is not None:
            fields["size"] = {"height": size, "width": size}
        elif getattr(had, "shortest_edge", None) is not None and getattr(default, "crop_size", None) is not None:
            fields["size"] = {"shortest_edge": size}
            fields["crop_size"] = {"height": size, "width": size}
    patch = getattr(vision, "patch_size", None)
    patch = patch[0] if isinstance(patch, (list, tuple)) and patch and len(set(patch)) == 1 else patch
    if isinstance(patch, int) and getattr(default, "patch_size", None) is not None:
        fields["patch_size"] = {"height": patch, "width": patch} if isinstance(default.patch_size, dict) else patch
    for mine, theirs in (("merge_size", "spatial_merge_size"), ("temporal_patch_size", "temporal_patch_size")):
        value = getattr(vision, theirs, None)
        if isinstance(value, int) and getattr(default, mine, None) is not None:
            fields[mine] = value
    return processor_cls(**fields) if fields else default


def _image_tokens(cls, config, inputs: dict[str, torch.Tensor]) -> int:
    """Feature rows the model's ``get_image_features`` returns for ``inputs``: run on fake tensors."""
    from memfit.fake_mode import fake_mode
    from memfit.quiet import silenced_warnings, stand_in_values
    from memfit.real_values import KnownValues
    if "cross_attention_mask" in inspect.signature(cls.forward).parameters and "aspect_ratio_mask" in inputs:
        return 1  # (Llama 3.2 Vision: the image is cross-attended, one <|image|> token in the sequence)
    if not hasattr(cls, "get_image_features"):
        raise TextOnly(f"{cls.__name__} has no get_image_features to count its image tokens")
    shallow = copy.deepcopy(config)
    text = language_config(shallow)
    if isinstance(getattr(text, "num_hidden_layers", None), int):  # (the count is the vision tower's)
        text.num_hidden_layers = 1
        if isinstance(getattr(text, "layer_types", None), list):
            text.layer_types = text.layer_types[:1]
    try:
        with silenced_warnings(), fake_mode(), KnownValues() as known:
            known.unknown_reads_zero = True
            with stand_in_values():
                model = cls(shallow)
            known.unknown_reads_zero = False
            fed = {k: torch.randn(v.shape, dtype=v.dtype) if v.is_floating_point()
                   else torch.tensor(v.tolist(), dtype=v.dtype) for k, v in inputs.items()}
            features = model.get_image_features(**fed)
            features = getattr(features, "pooler_output", features)
            parts = list(features) if isinstance(features, (list, tuple)) else [features]
            return sum(t.numel() // t.shape[-1] for t in parts)
    except TextOnly:
        raise
    except Exception as e:  # noqa: BLE001 - a tower the fake trace cannot run: said, then text only
        raise TextOnly(f"counting its image tokens failed ({type(e).__name__}: {brief(e, 120)})") from None


def _shape_words(pixels: torch.Tensor) -> str:
    if pixels.dim() == 2:  # (flattened patches: Qwen2-VL's kind)
        return f"{pixels.shape[0]:,} patches"
    if pixels.dim() >= 5 or pixels.dim() == 4 and pixels.shape[0] > 1:
        tiles = pixels.shape[:-3].numel()
        return f"{tiles} tiles of {pixels.shape[-2]}x{pixels.shape[-1]}"
    return f"{pixels.shape[-2]}x{pixels.shape[-1]}"
