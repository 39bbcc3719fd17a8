"""Workload: *what* to train.

A workload is four functions, so that memfit controls where tensors are created (on fake tensors
for prediction, on real ones for measurement and training):

- ``model()`` builds the ``nn.Module``; memfit calls it under its device and fake-tensor context.
- ``batch(batch_size)`` builds one batch: a tensor, or a tuple/list/dict of tensors whose first
  dimension is the batch (micro-batching splits along it).
- ``loss(model, batch)`` returns a scalar tensor.
- ``optimizer(params)`` builds the optimizer; default ``torch.optim.AdamW(params, lr=1e-4)``.

Workloads are named on the command line as a built-in (``gpt2``, ``llama:num_hidden_layers=2``,
``cnn``; see ``memfit workloads``) or a user file ``path/to/file.py:NAME`` where NAME is a Workload
or a function returning one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from memfit.errors import UserError, brief, passes_through, raised_in_memfit, user_location


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


@dataclass(frozen=True)
class WorkloadInfo:
    """Facts about a workload: shown in reports, and what ``memfit train`` needs to feed it text."""

    arch: str | None = None
    """The built-in architecture (gpt2, cnn, ...), or None for a user's workload."""
    text_lm: bool = False
    """A language model that ``memfit train`` can feed byte-level text (ids 0-255)."""
    seq_len: int | None = None
    """Tokens per sample (language models)."""
    resolution: int | None = None
    """Pixels on a side of each generated image (image-generation models)."""
    resolution_step: int | None = None
    """Pixels between two resolutions the model takes (the VAE's factor times its patch size, or its
    UNet's halvings): one latent step."""
    vocab_size: int | None = None
    config: dict = field(default_factory=dict)
    """The architecture's sizes (config fields), for reports."""
    sample: str | None = None
    """What one sample of the synthetic batch is, in words (a hub model's: "2048 tokens", "30 s of
    16 kHz audio and 448 CTC labels"), shown with the estimate; None: not said."""
    coupled_samples: str | None = None
    """Why the step's samples are not independent of each other, or None: a loss over the whole batch
    (CLIP's contrastive loss compares each pair with every other pair of the batch). Micro-batches
    would then train on another objective, so the planner searches none and OOM adaptation does not
    re-split the batch."""
    adapter: str | None = None
    """An adapter checkpoint's adapter, as an ``adapter`` plan value (its adapter_config.json:
    ``lora:r=16,alpha=32,targets=q_proj+v_proj``); the workload is its base model. None: no adapter."""
    quantized: str | None = None
    """A pre-quantized checkpoint's base-weight format, as a ``base_weights`` plan value (its
    config.json's ``quantization_config``: bitsandbytes' ``nf4``, ``fp4``, ``int8``); None: full precision."""
    loaded: str | None = None
    """How the checkpoint is loaded to train where not as stored, in words (a format transformers trains only
    dequantized: memfit.workloads.checkpoint_formats.trained_dequantized), shown with the estimate and the plan; None: as stored."""


@dataclass
class Workload:
    model: Callable[[], torch.nn.Module]
    batch: Callable[[int], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    name: str = "workload"
    default_batch_size: int = 8
    """Batch size used when the user gives none."""
    info: WorkloadInfo = field(default_factory=WorkloadInfo)
    """Facts shown in reports (architecture, sizes, sequence length)."""
    split: Callable[[Any, int, int], list] | None = None
    """How a batch of ``batch_size`` samples splits into ``n`` micro-batches (``split(batch, batch_size, n)``);
    None: every tensor whose first dimension is the batch, in ``n`` equal parts (:func:`split_batch`). A
    vision-language model's image inputs hold each image's rows on it (memfit.workloads.image_text.split_images)."""
    from_checkpoint: bool = False
    """``model()`` describes a checkpoint's model, and the step loads it as its library loads one
    (``from_pretrained``): built on the meta device, each weight then materialised on the step's
    device in its final form, cast or quantized while loading (memfit.techniques.loading). The
    built-in, hub and folder workloads. False: ``model()`` runs as written, on the step's device
    (a model built there in full precision and converted afterwards leaves its segments reserved)."""
    warmup_steps: int = 0
    """Steps a trace runs before its two (memfit.memory.faketrace), where the steady state takes more than
    one step to reach: Wan 2.2's two experts train in turns, so the second holds both experts' optimizer
    states only from the third step (memfit.workloads.wan_experts)."""

    def build_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return (self.optimizer or default_optimizer)(params)


def call_workload(what: str, fn, *args):
    """Call one of the workload's functions; a failure in the user's code becomes one line naming
    the function and where in the user's file it failed. Out-of-memory errors, fake-tensor trace
    failures and missing kernels pass through to their handlers (:func:`memfit.errors.passes_through`),
    as does a failure raised by memfit's own code or a built-in workload's (a bug to report)."""
    try:
        return fn(*args)
    except Exception as e:
        err = _workload_error(what, fn, e)
        if err is e:
            raise
        raise err from e


def checked(what: str, fn):
    """``fn`` wrapped by :func:`call_workload` (e.g. a user's loss, called every micro-batch)."""
    if _builtin(fn):
        return fn

    def call(*args):
        return call_workload(what, fn, *args)
    return call


def _workload_error(what: str, fn, e: Exception) -> BaseException:
    """The error to raise for exception ``e`` of the workload's ``what``: ``e`` itself, or a UserError."""
    if passes_through(e) or raised_in_memfit(e) or _builtin(fn):
        return e
    at = user_location(e, fn)
    msg = brief(e)
    return UserError(f"the workload's {what} raised {type(e).__name__}: {msg}{f' (at {at})' if at else ''}; "
                     "fix the workload (run with --debug for the traceback)")


def _builtin(fn) -> bool:
    """A built-in workload's function (memfit.workloads): its failures are reported there (overrides)."""
    return str(getattr(fn, "__module__", None) or "").startswith("memfit.workloads")


def split_batch(batch: Any, batch_size: int, n: int) -> list[Any]:
    """Split every tensor whose first dimension is the batch into ``n`` equal micro-batches."""
    leaves, spec = tree_flatten(batch)
    if not any(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch_size for x in leaves):
        raise UserError(f"cannot split the batch into micro-batches: no tensor in it has a first dimension of "
                        f"{batch_size} (the batch size); make batch(batch_size) return tensors shaped [batch, ...]")
    parts = [x.chunk(n) if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch_size
             else [x] * n for x in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(n)]
