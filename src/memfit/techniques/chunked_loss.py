"""Chunked cross-entropy: the language-model loss without the full logits.

A causal LM's logits are [batch, T, vocab] in fp32 for the loss: at GPT-2's vocabulary (50257)
and 8 x 1024 tokens that is 1.6 GiB, plus as much again for their gradient, often the largest
single tensor of the step. With ``loss_chunks: K`` memfit runs the model's body to the last
hidden states, then applies the output head and cross-entropy to K slices of the tokens, each
under a checkpoint: one slice's logits exist at a time, and backward recomputes them (one extra
head matmul). The result equals the unchunked mean over the non-ignored tokens.

Applies to Hugging Face causal LMs (``...ForCausalLM``, labels in the batch), as the built-in
workloads are; the head's plain linear map is used (models with logit soft-capping or scaling
are refused).

Plan key ``loss_chunks``: 0 (:class:`FullLoss`) or K > 0 (:class:`ChunkedLoss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memfit.errors import UserError, brief, passes_through, raised_in_memfit, user_location
from memfit.techniques.base import (
    Config,
    Export,
    Key,
    SearchContext,
    Technique,
    register,
    whole_number,
)

IGNORE_INDEX = -100
MAX_CHUNKS = 2**31 - 1
SEARCHED = 8
"""The number of chunks the planner tries (the memory saving flattens out well before)."""


def _chunk_loss(hidden, labels, weight, bias):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


FORWARD_METHOD = "memfit_chunked_loss"
"""The model's method that runs the chunked loss when the model is sharded (see
:func:`as_sharded_forward`)."""


def chunked_lm_loss(model, batch, chunks: int) -> torch.Tensor:
    method = getattr(model, FORWARD_METHOD, None)
    if method is not None:
        return method(batch, chunks)
    return _chunked_lm_loss(model, batch, chunks)


def as_sharded_forward(model) -> None:
    """With FSDP2, the root module's parameters (embeddings, final norm, head) are gathered around
    its ``forward``, and the chunked loss calls the body and the head instead. So the loss becomes
    one of the root's forward methods (FSDP2's ``register_fsdp_forward_method``): the root's
    parameters are gathered for it, and their gradients reduce-scattered after its backward."""
    import types

    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    if not isinstance(model, FSDPModule):
        return
    setattr(model, FORWARD_METHOD, types.MethodType(_chunked_lm_loss, model))
    register_fsdp_forward_method(model, FORWARD_METHOD)


def _chunked_lm_loss(model, batch, chunks: int) -> torch.Tensor:
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = model.base_model(**inputs).last_hidden_state
    head = model.get_output_embeddings()
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    labels = labels[:, 1:].reshape(-1)
    total = None
    for h, y in zip(hidden.chunk(chunks), labels.chunk(chunks)):
        part = checkpoint(_chunk_loss, h, y, head.weight, head.bias, use_reentrant=False)
        total = part if total is None else total + part
    return total / (labels != IGNORE_INDEX).sum()


def check_supported(model) -> None:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = ()  # noqa: N806
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    causal = _causal_lm_classes()  # (FSDP2 makes a subclass, FSDP<class>, of a sharded model's class)
    if not isinstance(model, PreTrainedModel) or head is None or getattr(config, "is_encoder_decoder", False) \
            or not any(c.__name__ in causal for c in type(model).__mro__):
        raise UserError("loss_chunks needs a Hugging Face causal language model (a ...ForCausalLM with labels in "
                        "the batch); set loss_chunks: 0 for this workload")
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attr, None):
            raise UserError(f"loss_chunks: this model applies {attr} to its logits, which chunking does not "
                            "reproduce; set loss_chunks: 0")


def _causal_lm_classes() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    names = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(v if isinstance(v, (list, tuple)) else [v])
    return names


def chunked_loss_fn(loss_fn, model, chunks: int):
    """The step's loss for ``model`` with the LM cross-entropy computed in ``chunks`` slices
    (``loss_fn`` itself is not called: the chunked loss replaces it)."""
    check_supported(model)
    as_sharded_forward(model)

    def loss(m, batch):
        if not isinstance(batch, dict) or "labels" not in batch:
            raise UserError("loss_chunks needs a batch dict with 'labels' (as Hugging Face causal LMs take)")
        try:
            return chunked_lm_loss(m, batch, chunks)
        except Exception as e:
            err = _batch_error(e)
            if err is e:
                raise
            raise err from e
    return loss


class LossChunking(Config):
    def values(self) -> dict:
        return {"loss_chunks": self.chunks}


@dataclass(frozen=True)
class FullLoss(LossChunking):
    """The workload's own loss, on the full logits."""

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
        parts.loss_fn = chunked_loss_fn(parts.loss_fn, parts.model, self.chunks)

    def label(self, batch_size):
        return f"chunks={self.chunks}"

    def ablations(self):
        return [(f"chunked loss ({self.chunks})", FullLoss())]

    def export(self, into: Export) -> None:
        into.not_carried(self)


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


def _batch_error(e: Exception) -> BaseException:
    """A failure of the model's forward on the workload's batch is the batch's; memfit's own
    failures, out-of-memory errors and trace failures pass through unchanged."""
    if passes_through(e) or raised_in_memfit(e):
        return e
    at = user_location(e)
    msg = brief(e)
    return UserError(f"loss_chunks: the model's forward on the workload's batch raised {type(e).__name__}: {msg}"
                     f"{f' (at {at})' if at else ''}; fix the batch (the keys the model takes, plus 'labels') or "
                     "set loss_chunks: 0")


TECHNIQUE = register(
    Technique("loss_chunks", (Key("loss_chunks", 0, "Compute the language-model cross-entropy in this many chunks "
                                  "(0 = off).", annotation="int", from_text=whole_number("--loss-chunks"),
                                  metavar="LOSS"),),
              parse, order=80, search=search, depends_on_model=True),
    LossChunking, FullLoss, ChunkedLoss)
