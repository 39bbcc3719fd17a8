"""Chunked cross-entropy: the language-model loss without the full logits.

A causal LM's logits are [batch, T, vocab] in fp32 for the loss: at GPT-2's vocabulary (50257)
and 8 x 1024 tokens that is 1.6 GiB, plus as much again for their gradient, often the largest
single tensor of the step. With ``loss_chunks: K`` the output head and the cross-entropy run on
K slices of the tokens, each under a checkpoint: one slice's logits exist at a time, and backward
recomputes them (one extra head matmul per slice). The result equals the unchunked loss.

The chunking lives in the model, as Liger-Kernel's fused linear cross-entropy does
(:func:`chunk_lm_loss`): the causal LM's ``forward`` is patched so that a call *with labels*
(in training mode) runs the model's own forward up to the head, then the chunked loss, and
returns ``.loss`` with ``.logits`` None. So every caller gets it: ``model(**batch).loss``, a
lambda such as ``m(input_ids=b, labels=b).loss``, the Hugging Face Trainer (``num_items_in_batch`` with
gradient accumulation) and Lightning. A call without labels, or in eval mode, is the model's
forward unchanged.

Applies to Hugging Face causal LMs (``...ForCausalLM`` whose output layer is a plain
``nn.Linear`` and whose loss is ``ForCausalLMLoss``). What such a model does to its logits between
the head and the loss is done slice by slice (:class:`LogitTransform`): Gemma's soft-capping
(``final_logit_softcapping``), Cohere's ``logit_scale`` and Granite's ``logits_scaling``, as Liger-Kernel
and Unsloth do. A forward that changes its logits in any other way is refused in one line when it runs
(NOTE [ Logits the model changes ]), never trained on a loss that skips the change. A loss that
computes its own cross-entropy from ``.logits`` is not chunked.

Plan key ``loss_chunks``: 0 (:class:`FullLoss`) or K > 0 (:class:`ChunkedLoss`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import UserError
from memfit.techniques.base import (
    Config,
    Export,
    Key,
    SearchContext,
    Technique,
    register,
    whole_number,
)
from memfit.techniques.checkpoint_call import checkpoint

IGNORE_INDEX = -100
MAX_CHUNKS = 2**31 - 1
SEARCHED = 8
"""The number of chunks the planner tries (the memory saving flattens out well before)."""
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
"""The keyword arguments of transformers' ``ForCausalLMLoss`` a causal LM's forward passes on."""
CHUNKS_ATTR = "memfit_loss_chunks"
"""Set on a patched ``forward``: its number of chunks."""
_ORIGINAL_ATTR = "_memfit_original_forward"


# -- the one chunked cross-entropy ----------------------------------------------------------------

@dataclass(frozen=True)
class LogitTransform:
    """What a causal LM's forward does to its logits between the output layer and the loss, in the
    head's dtype (before the loss's fp32 cast) and in the model's own order of operations."""

    multiply: float | None = None
    """Cohere: ``logits * self.logit_scale``."""
    divide: float | None = None
    """Granite: ``logits / config.logits_scaling``."""
    softcap: float | None = None
    """Gemma 2: ``tanh(logits / cap) * cap`` (``config.final_logit_softcapping``)."""

    @property
    def scales(self) -> tuple:
        """(multiply, divide, softcap): what the step carries (NOTE [ Plain numbers into a compiled region ])."""
        return (self.multiply, self.divide, self.softcap)


# NOTE [ Plain numbers into a compiled region ]
# The patched forward builds its :class:`ChunkedHead` inside the step, which ``compile: full`` captures
# whole; torch 2.11's Dynamo cannot take a user dataclass into an object it builds there (nor through
# a checkpoint), and broke the graph, so that the step ran, and was predicted, without that compile.
# The transform goes in as its fields, a tuple of numbers (:attr:`LogitTransform.scales`).
def _transformed(logits: torch.Tensor, multiply: float | None, divide: float | None,
                 softcap: float | None) -> torch.Tensor:
    """:class:`LogitTransform` ``(multiply, divide, softcap)`` on ``logits``."""
    if multiply is not None:
        logits = logits * multiply
    if divide is not None:
        logits = logits / divide
    if softcap is not None:
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    return logits


NO_TRANSFORM = LogitTransform()
_TRANSFORMS = (("config", "final_logit_softcapping", "softcap"), ("model", "logit_scale", "multiply"),
               ("config", "logits_scaling", "divide"))
"""(where the forward reads it, attribute, :class:`LogitTransform` field)."""


def _holders(lm: nn.Module):
    """(object, attribute, field) of each transform ``lm``'s forward may read (:data:`_TRANSFORMS`)."""
    return [(lm.config if where == "config" else lm, attr, field) for where, attr, field in _TRANSFORMS]


class _Unit:
    """Stands in for a scale the forward multiplies or divides its logits by: both leave them as they are."""

    def __rmul__(self, other):
        return other

    def __rtruediv__(self, other):
        return other


def logit_transform(lm: nn.Module) -> LogitTransform:
    """The transform ``lm``'s forward applies to its logits, from the attributes it reads; a UserError
    for one that is not a number."""
    found = {}
    for owner, attr, field in _holders(lm):
        value = getattr(owner, attr, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"loss_chunks: {type(lm).__name__}'s {attr} is a {type(value).__name__}, not a number "
                            "that chunking can apply slice by slice; set loss_chunks: 0")
        found[field] = float(value)
    return LogitTransform(**found)


@contextlib.contextmanager
def _transform_left_to_chunks(lm: nn.Module):
    """The forward's own logit transform switched off for one call (the chunks apply it): a soft-cap
    read as ``None``, a scale as :class:`_Unit`."""
    saved = []
    for owner, attr, field in _holders(lm):
        if getattr(owner, attr, None) is not None:
            saved.append((owner, attr, getattr(owner, attr)))
            object.__setattr__(owner, attr, None if field == "softcap" else _Unit())  # (configs check types)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            object.__setattr__(owner, attr, value)


def _chunk_loss(hidden, labels, weight, bias, ignore_index, multiply, divide, softcap):
    logits = _transformed(F.linear(hidden, weight, bias), multiply, divide, softcap).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


# NOTE [ One slice of logits at a time ]
# Each slice runs under a non-reentrant checkpoint, so forward keeps only the slice's scalar; backward
# recomputes one slice's [tokens/K, vocab] logits, takes their gradient and frees them before the next
# slice.
def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Linear, chunks: int, *,
                          ignore_index: int = IGNORE_INDEX, num_items_in_batch=None,
                          scales: tuple = NO_TRANSFORM.scales) -> torch.Tensor:
    """Cross-entropy of ``head(hidden)``, transformed by ``scales`` (:attr:`LogitTransform.scales`), against
    ``labels`` (aligned: already shifted), the tokens in ``chunks`` slices, each slice's logits recomputed in
    backward. Divided by ``num_items_in_batch`` when given (as transformers' ``fixed_cross_entropy``: the
    Trainer counts the tokens of all accumulated micro-batches), else by the tokens not ``ignore_index`` (the
    mean)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    total = None
    for h, y in zip(hidden.chunk(chunks), labels.chunk(chunks)):
        part = checkpoint(_chunk_loss, h, y, head.weight, head.bias, ignore_index, *scales, use_reentrant=False)
        total = part if total is None else total + part
    if num_items_in_batch is None:
        return total / (labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Token t predicts token t + 1; the last position predicts nothing (as ``ForCausalLMLoss``)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


# -- the patched forward ----------------------------------------------------------------------------

class ChunkedHead(nn.Module):
    """Stands in for the model's output layer during one forward with labels: it takes the last
    hidden states, computes the chunked loss into ``self.loss`` and returns ``placeholder``, an
    expanded fp32 zero with the logits' shape that holds 4 bytes (the forward's ``logits.float()``,
    if any, is a no-op on it). The real head's forward and its hooks do not run."""

    def __init__(self, head: nn.Linear, labels, chunks: int, ignore_index: int = IGNORE_INDEX,
                 num_items_in_batch=None, shift_labels=None, scales: tuple = NO_TRANSFORM.scales):
        super().__init__()
        self.parts = (head, labels, shift_labels, num_items_in_batch)  # (a tuple: not a submodule)
        self.chunks, self.ignore_index, self.scales = chunks, ignore_index, scales
        self.loss = self.placeholder = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.loss is not None:
            raise UserError("loss_chunks: the model's forward calls its output layer twice, which chunking does not "
                            "reproduce; set loss_chunks: 0")
        head, labels, shifted, num_items = self.parts
        targets = shift_labels(labels, self.ignore_index) if shifted is None else shifted
        self.loss = chunked_cross_entropy(hidden, targets, head, self.chunks, ignore_index=self.ignore_index,
                                          num_items_in_batch=num_items, scales=self.scales)
        self.placeholder = hidden.new_zeros((), dtype=torch.float32).expand(*hidden.shape[:-1], head.out_features)
        return self.placeholder


# NOTE [ The patched forward ]
# The instance's ``forward`` is replaced (hooks, FSDP2's among them, run around it as around the
# original). It runs the model's own forward with ``labels=None`` and the loss keywords removed, while
# :class:`ChunkedHead` stands in for the output layer, so everything up to the head (masks, positions,
# caches, ``hidden_states``) is the model's own code. The patch holds the model only weakly (no
# reference cycle keeps a dropped model's memory alive).
def chunk_lm_loss(model: nn.Module, chunks: int) -> nn.Module:
    """Patch ``model`` (a Hugging Face causal LM, or a PEFT model around one) so that a forward with
    ``labels`` in training mode computes its loss in ``chunks`` slices and returns ``.logits`` None;
    a forward without labels, or in eval mode (as Liger-Kernel: evaluation metrics read the
    logits, and no graph is kept), is unchanged. Patching again replaces the chunk count. Returns
    ``model``."""
    lm = check_supported(model)
    scales = logit_transform(lm).scales  # NOTE [ Plain numbers into a compiled region ]
    head = lm.get_output_embeddings()
    head_name = next(name for name, child in lm.named_children() if child is head)
    own = lm.__dict__.get("forward")
    original = getattr(own, _ORIGINAL_ATTR, own)  # None: the class's forward
    signature = inspect.signature(lm.forward)
    names = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    labels_at = names.index("labels") if "labels" in names else None
    ref = weakref.ref(lm)

    def forward(*args, **kwargs):
        m = ref()
        # (a partial, not ``forward.__get__(m)``: torch 2.11's Dynamo cannot trace a function's __get__)
        run = original if original is not None else functools.partial(type(m).forward, m)
        positional = "labels" not in kwargs and labels_at is not None and len(args) > labels_at
        labels = args[labels_at] if positional else kwargs.get("labels")
        if labels is None or not m.training:
            return run(*args, **kwargs)
        if positional:
            args = (*args[:labels_at], None, *args[labels_at + 1:])
        else:
            del kwargs["labels"]
        loss_kwargs = {k: kwargs.pop(k) for k in LOSS_KWARGS if k in kwargs}
        stand_in = ChunkedHead(m.get_output_embeddings(), labels, chunks, scales=scales, **loss_kwargs)
        with _standing_in(m, head_name, stand_in), _transform_left_to_chunks(m):
            out = run(*args, **kwargs)
        if stand_in.loss is None:
            raise UserError(f"loss_chunks: {type(m).__name__}.forward did not call its output layer {head_name!r}, "
                            "so there is no loss to chunk; set loss_chunks: 0")
        _check_logits_unchanged(m, out, stand_in.placeholder)
        return _with_loss(out, stand_in.loss, stand_in.placeholder)

    forward.__signature__ = signature  # (the Trainer reads it: dataset columns, loss keywords)
    forward.__name__ = forward.__qualname__ = "forward"
    forward.__doc__ = (original or type(lm).forward).__doc__
    setattr(forward, _ORIGINAL_ATTR, original)
    setattr(forward, CHUNKS_ATTR, chunks)
    lm.forward = forward
    return model


@contextlib.contextmanager
def _standing_in(model: nn.Module, name: str, stand_in: nn.Module):
    head = model._modules[name]
    model._modules[name] = stand_in
    try:
        yield
    finally:
        model._modules[name] = head


# NOTE [ Logits the model changes ]
# The stand-in head returns a placeholder, and the forward returns it as its logits unless it does
# something to them after the head. The transforms :class:`LogitTransform` knows are switched off for
# the call (the chunks apply them); any other change (another scale, a slice of the vocabulary, a
# soft-cap read from elsewhere) makes the returned logits another tensor. The loss chunking computed
# would then skip that change, so the call is refused rather than trained on.
def _check_logits_unchanged(model: nn.Module, out, placeholder) -> None:
    logits = [x for x in out if torch.is_tensor(x) and x.dim() > 0] if isinstance(out, tuple) \
        else [out.get("logits")] if hasattr(out, "get") else []
    if logits and logits[0] is not None and not any(x is placeholder for x in logits):
        raise UserError(f"loss_chunks: {type(model).__name__}.forward changes its logits after the output layer, "
                        "which chunking does not reproduce; set loss_chunks: 0")


def _with_loss(out, loss, placeholder):
    """The model's output with ``loss`` set and the placeholder logits removed (None)."""
    if isinstance(out, tuple):  # return_dict=False: HF tuples skip None fields, and start with the loss
        return (loss, *(x for x in out if x is not placeholder))
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    return type(out)(loss=loss, **fields)


def causal_lm(model: nn.Module) -> nn.Module:
    """The module whose forward is chunked: ``model``, or a PEFT model's base model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def check_supported(model) -> nn.Module:
    """The causal LM in ``model`` whose forward can be chunked, or a UserError naming why not."""
    try:
        from transformers import PreTrainedModel
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        PreTrainedModel, ForCausalLMLoss = (), None  # noqa: N806
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    causal = _causal_lm_classes() if ForCausalLMLoss else set()  # (FSDP2 subclasses a sharded model's class)
    if not isinstance(lm, PreTrainedModel) or head is None or getattr(config, "is_encoder_decoder", False) \
            or not any(c.__name__ in causal for c in type(lm).__mro__):
        raise UserError("loss_chunks needs a Hugging Face causal language model (a ...ForCausalLM called with labels); "
                        "set loss_chunks: 0 for this workload")
    cls = type(lm).__name__
    if not (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward) \
            or not any(child is head for child in lm.children()):
        raise UserError(f"loss_chunks: {cls}'s output layer is a {type(head).__name__}, not a plain nn.Linear child "
                        "of the model (lm_head) that chunking can apply slice by slice; set loss_chunks: 0")
    loss_function = getattr(lm, "loss_function", None)
    if loss_function is not ForCausalLMLoss:
        raise UserError(f"loss_chunks: {cls} computes its loss with {getattr(loss_function, '__name__', loss_function)}, "
                        "not transformers' ForCausalLMLoss that chunking reproduces; set loss_chunks: 0")
    return lm


def _causal_lm_classes() -> set[str]:
    """transformers' causal LMs, and its vision-language models (``...ForConditionalGeneration`` of the
    image-text-to-text mapping: a language model over image and text tokens, its loss ForCausalLMLoss on
    a plain ``lm_head``, which :func:`check_supported` checks of each)."""
    from transformers.models.auto import modeling_auto
    names = set()
    for mapping in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"):
        for v in getattr(modeling_auto, mapping, {}).values():
            names.update(v if isinstance(v, (list, tuple)) else [v])
    return names


# -- the technique --------------------------------------------------------------------------------

class LossChunking(Config):
    def values(self) -> dict:
        return {"loss_chunks": self.chunks}


@dataclass(frozen=True)
class FullLoss(LossChunking):
    """The model's own loss, on the full logits."""

    chunks = 0
    rank = 0


@dataclass(frozen=True)
class ChunkedLoss(LossChunking):
    """Head and cross-entropy over ``chunks`` token slices, each recomputed in backward."""

    chunks: int = SEARCHED
    """Token slices (> 0)."""
    rank = 1
    adds_work = True

    def apply(self, parts) -> None:
        chunk_lm_loss(parts.model, self.chunks)  # (the workload's loss runs: it calls the patched forward)

    def label(self, batch_size):
        return f"chunks={self.chunks}"

    def ablations(self):
        return [(f"chunked loss ({self.chunks})", FullLoss())]

    def export(self, into: Export) -> None:
        into.not_carried(self, axolotl=False)
        into.axolotl["loss_chunks"] = self.chunks  # (axolotl's is Liger's, in slices its model sets: axolotl_export)


def parse(values: dict) -> LossChunking:
    n = values["loss_chunks"]
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_CHUNKS:
        raise UserError(f"plan: loss_chunks must be a whole number from 0 to {MAX_CHUNKS}, got {n!r}")
    return ChunkedLoss(n) if n else FullLoss()


def search(ctx: SearchContext) -> list[int]:
    try:
        check_supported(ctx.model)
    except UserError:
        return [0]
    return [0, SEARCHED]


TECHNIQUE = register(
    Technique("loss_chunks", (Key("loss_chunks", 0, "Compute the language-model cross-entropy in this many chunks "
                                  "(0 = off).", annotation="int", from_text=whole_number("--loss-chunks"),
                                  metavar="LOSS"),),
              parse, search=search, depends_on_model=True),
    LossChunking, FullLoss, ChunkedLoss)
