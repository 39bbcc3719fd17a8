"""torch's *reentrant* checkpoint of a block, as the trainers that use it call it (``checkpointing:
blocks:reentrant=true``).

Reentrant checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``) is the older of
torch's two: an autograd Function runs the block under ``no_grad`` in forward, saving only its positional
inputs, and its backward runs the block's forward again with grad and calls ``torch.autograd.backward``
over that recomputed graph. Compute is the same as non-reentrant checkpointing (one more forward of each
block in backward). Memory is the same but for the gradient of what enters the first checkpointed block:
the inner backward accumulates it into the detached input's ``.grad``, one hidden state that the
non-reentrant checkpoint does not hold at that moment (measured on a 2- and a 4-layer Llama: exactly one
hidden state, the same at both depths: ``tests/unit/techniques/test_users_qlora_loop.py``).

It is what many users run without asking: peft's ``prepare_model_for_kbit_training`` passes no
``use_reentrant`` to transformers, so torch's default (reentrant, with a warning) applies; LLaMA-Factory's
``use_reentrant_gc`` is on by default; axolotl and ``TrainingArguments`` take it through
``gradient_checkpointing_kwargs``. So memfit predicts it as a value of its own rather than as
``blocks``.

It is called here as transformers calls it (``GradientCheckpointingLayer``): keyword arguments bound to
the block's forward, the positional ones passed through the checkpoint, and the model's input embeddings'
output made to require grad (``enable_input_require_grads``), without which a block of a frozen model gets
no input that requires grad and its adapters no gradient. Where the model has no such method, the block's
first floating-point positional input is made to require grad in place (LLaMA-Factory's way). Two things
the reentrant checkpoint cannot do are refused in one line rather than trained wrong: a tensor that needs a
gradient passed by keyword (its gradient would be dropped), and a block with trained weights but no tensor
input at all.
"""

from __future__ import annotations

import contextlib

import torch

from memfit.errors import UserError
from memfit.techniques.checkpoint_call import checkpoint


def require_input_grads(model: torch.nn.Module) -> None:
    """What transformers' checkpointing enable does for a language model: its input embeddings' output
    requires grad, so that the first checkpointed block's input does."""
    if getattr(model, "main_input_name", None) == "input_ids" and hasattr(model, "enable_input_require_grads"):
        try:
            model.enable_input_require_grads()
        except NotImplementedError:  # (a model without input embeddings: each block's input is made to, below)
            pass


def reentrant_forward(forward, block: torch.nn.Module, recompute_contexts, *args, **kwargs):
    """``forward(*args, **kwargs)`` of ``block`` under torch's reentrant checkpoint (the module docstring); the
    recomputation in backward runs under ``recompute_contexts`` (the step's: memfit.techniques.checkpointing)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    name = type(block).__name__
    lost = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if lost:
        raise UserError(f"checkpointing blocks:reentrant=true: {name} takes {', '.join(lost)} by keyword, a tensor that "
                        "needs a gradient, which torch's reentrant checkpoint drops; use checkpointing: blocks")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(p.requires_grad for p in block.parameters()) and not any(t.requires_grad for t in tensors):
        first = next((t for t in tensors if t.is_floating_point() and t.is_leaf), None)
        if first is None:
            raise UserError(f"checkpointing blocks:reentrant=true: {name} trains weights but takes no floating-point "
                            "tensor positionally, so torch's reentrant checkpoint gives them no gradient; use "
                            "checkpointing: blocks")
        first.requires_grad_(True)  # (LLaMA-Factory's custom_gradient_checkpointing_func does the same)
    calls = 0

    def run(*inputs):
        nonlocal calls
        calls += 1
        if calls == 1:  # (forward: the step's contexts are already held)
            return forward(*inputs, **kwargs)
        with contextlib.ExitStack() as stack:  # (the recomputation in backward)
            for make in recompute_contexts:
                stack.enter_context(make())
            return forward(*inputs, **kwargs)
    return checkpoint(run, *args, use_reentrant=True, preserve_rng_state=True)


def reentrant_of(kwargs, where: str = "gradient_checkpointing_kwargs") -> bool:
    """Whether transformers' checkpointing, given ``gradient_checkpointing_kwargs`` (TrainingArguments', axolotl's),
    runs torch's reentrant checkpoint: None is transformers' default (non-reentrant); a mapping without
    ``use_reentrant`` reaches torch's ``checkpoint`` without it, whose default is reentrant."""
    if kwargs is None:
        return False
    if not isinstance(kwargs, dict) or not isinstance(kwargs.get("use_reentrant", True), bool):
        raise UserError(f"{where}: {kwargs!r} is not a mapping with use_reentrant: true or false; write "
                        "{use_reentrant: false} (or true)")
    return kwargs.get("use_reentrant", True)


def non_reentrant_beside_compile_or_fsdp(fields: dict) -> bool:
    """A trainer's config mapped onto plan ``fields`` that asks for the reentrant checkpoint beside torch.compile or FSDP,
    which memfit runs with the non-reentrant one only: ``fields`` changed to that one (True), else left (False)."""
    if fields.get("checkpointing") != "blocks:reentrant=true" or \
            fields.get("compile") in (None, "none") and fields.get("shard") in (None, "none"):
        return False
    fields["checkpointing"] = "blocks"
    return True
