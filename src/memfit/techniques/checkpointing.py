"""Activation checkpointing: keep less for backward, recompute the rest.

Without checkpointing every block keeps its intermediate results until backward: activation
memory grows with layers x batch x sequence. A checkpointed block keeps only its inputs and runs
its forward again during backward (about +33% compute for a transformer block: one more forward
for two units of backward). Variants, as torchtitan's AC classes:

- ``blocks``: every repeated block (detected automatically: the ModuleLists / Sequentials whose
  children share one class, e.g. Hugging Face decoder layers) is checkpointed;
- ``blocks:every=N``: one block in N, trading memory for less recompute;
- ``selective``: op-level policy (``create_selective_checkpoint_contexts``): inside each block
  the outputs of matmuls, convolutions and attention are saved, cheap pointwise ops recomputed:
  most of the memory saving at a fraction of the recompute.

All use non-reentrant ``torch.utils.checkpoint`` with the RNG state restored, so dropout gives
the same result, and the model's code and module types stay unchanged (only the blocks'
``forward`` is wrapped).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.errors import UserError

aten = torch.ops.aten

# NOTE [ Selective checkpointing policy ]: save what is expensive to recompute (matmuls,
# convolutions, attention kernels); recompute everything else (pointwise, norms, softmax).
SAVE_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_cudnn_attention.default,
    aten.mkldnn_rnn_layer.default,
}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True)
class CheckpointConfig:
    mode: str = "none"
    """none | blocks | selective."""
    every: int = 1
    """Checkpoint one block in ``every``."""

    @classmethod
    def parse(cls, text: str) -> CheckpointConfig:
        if text == "none":
            return cls()
        if text == "blocks":
            return cls("blocks")
        if text.startswith("blocks:every="):
            return cls("blocks", int(text.split("=", 1)[1]))
        if text == "selective":
            return cls("selective")
        raise UserError(f"checkpointing {text!r} is not supported by this technique")


def find_blocks(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The repeated blocks: containers whose children (>= 2) share one class, outermost first.

    Nested repeats (a repeated block inside a repeated block) are not returned twice.
    """
    found: list[tuple[str, list[nn.Module]]] = []
    claimed: set[int] = set()
    for name, mod in model.named_modules():
        if id(mod) in claimed or not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1 and \
                sum(p.numel() for p in children[0].parameters()) > 0:
            found.append((name, children))
            for c in children:
                claimed.update(id(m) for m in c.modules())
    return found


def _checkpointed_forward(original, context_fn, *args, **kwargs):
    if not torch.is_grad_enabled():
        return original(*args, **kwargs)
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _context_fn(selective: bool, recompute_contexts: tuple):
    """checkpoint's context_fn: (forward context, recompute context). The recomputation runs under
    the step's contexts too (e.g. chunked attention), so it repeats the forward exactly."""
    def make():
        if selective:
            fwd, rec = create_selective_checkpoint_contexts(_policy)
        else:
            fwd, rec = contextlib.nullcontext(), contextlib.nullcontext()
        stack = contextlib.ExitStack()

        class _Recompute:
            def __enter__(self_inner):
                stack.enter_context(rec)
                for make_ctx in recompute_contexts:
                    stack.enter_context(make_ctx())
                return self_inner

            def __exit__(self_inner, *exc):
                return stack.__exit__(*exc)
        return fwd, _Recompute()
    return make


class Checkpointing:
    """Apply a CheckpointConfig to a model in place; ``remove()`` restores it.

    ``recompute_contexts``: context factories the step holds around forward (e.g. chunked
    attention's function mode), entered again around each recomputation.
    """

    def __init__(self, config: CheckpointConfig, recompute_contexts: tuple = ()):
        self.config = config
        self.recompute_contexts = recompute_contexts
        self.wrapped: list[nn.Module] = []

    def apply(self, model: nn.Module) -> nn.Module:
        if self.config.mode == "none":
            return model
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", False):
            # Hugging Face models update a KV cache in forward when use_cache is on, so a recomputed
            # forward would differ from the first one; training needs no cache (HF does the same).
            config.use_cache = False
        blocks = find_blocks(model)
        if not blocks:
            raise UserError("checkpointing: found no repeated blocks (a ModuleList or Sequential of modules of one "
                            "class) in the model; use checkpointing: none, or structure the model in blocks")
        context_fn = (_context_fn(self.config.mode == "selective", self.recompute_contexts)
                      if self.config.mode == "selective" or self.recompute_contexts else None)
        for _, children in blocks:
            for i, block in enumerate(children):
                if i % self.config.every:
                    continue
                block.forward = functools.partial(_checkpointed_forward, block.forward, context_fn)
                self.wrapped.append(block)
        return model

    def remove(self) -> None:
        for block in self.wrapped:
            del block.forward  # the instance attribute shadowed the class's forward
        self.wrapped.clear()
