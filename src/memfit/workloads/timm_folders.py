"""timm models from a hub id or a folder: ``timm/vit_base_patch16_224.augreg2_in21k_ft_in1k``.

NOTE [ timm repositories ]
A timm checkpoint on the hub (the ``timm/`` organisation, and models others push with
``timm.models.push_to_hf_hub``) has a config.json of its own form: no ``model_type``, but the model's
registered name (``architecture``), its classes (``num_classes``), any constructor arguments
(``model_args``) and the pretrained config, whose ``input_size`` is the image the model was trained on.
memfit builds that model as ``timm.create_model(architecture, pretrained=False, num_classes=...,
**model_args)`` does (the weights are never read) and feeds it what an image classifier's fine-tuning
feeds it: a batch of images at ``input_size`` and one class each, with cross-entropy. ``--resolution
PX`` trains at another square size (a model with a fixed input size, ViT's position table, is built
for it with ``img_size``, as timm's own fine-tuning scripts do). It loads as a checkpoint loads: each
weight made on the device in its final form (memfit.techniques.loading).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfit.errors import UserError
from memfit.workload import Workload, WorkloadInfo


def is_timm_config(data: dict) -> bool:
    """A timm checkpoint's config.json: a registered model name, no transformers ``model_type``."""
    return isinstance(data.get("architecture"), str) and "model_type" not in data and "_class_name" not in data


def timm_workload(data: dict, name: str, where: str, seq_len: int | None,
                  resolution: int | tuple[int, int] | None) -> Workload:
    """The workload of a timm checkpoint's config.json (see the module's NOTE)."""
    try:
        import timm
    except ImportError:
        raise UserError(f"{where} is a timm model; install timm (pip install 'memfit[timm]', or pip install timm)") from None
    arch = data["architecture"]
    if not timm.is_model(arch):
        raise UserError(f"{where}: timm {timm.__version__} has no model {arch!r} (config.json's architecture); "
                        "upgrade timm, or write a file workload (path/to/file.py:NAME) that builds it")
    if seq_len is not None:
        raise UserError(f"{where}: --seq-len does not apply to an image model; give --resolution PIXELS instead")
    pretrained = data.get("pretrained_cfg") if isinstance(data.get("pretrained_cfg"), dict) else {}
    classes = data.get("num_classes", pretrained.get("num_classes", 1000))
    channels, height, width = tuple(pretrained.get("input_size") or (3, 224, 224))
    kwargs = {"num_classes": classes, **(data.get("model_args") or {})}
    if isinstance(data.get("global_pool"), str):
        kwargs["global_pool"] = data["global_pool"]
    if resolution is not None:  # (a side, or (width, height): NOTE [ A resolution's width ])
        width, height = resolution if isinstance(resolution, tuple) else (resolution, resolution)
        if pretrained.get("fixed_input_size"):
            kwargs["img_size"] = (height, width) if width != height else height

    def model():
        return timm.create_model(arch, pretrained=False, **kwargs)

    def batch(n: int):
        return torch.randn(n, channels, height, width), torch.randint(0, max(classes, 1), (n,))

    def loss(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    return Workload(model=model, batch=batch, loss=loss, name=name, default_batch_size=32, from_checkpoint=True,
                    info=WorkloadInfo(arch=arch, sample=f"a {width}x{height} image and its class",
                                      config={"model_class": f"timm {arch}", "classes": classes}))
