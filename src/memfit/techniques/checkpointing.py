"""Activation checkpointing: keep less for backward, recompute the rest.

Without checkpointing every block keeps its intermediate results until backward: activation
memory grows with layers x batch x sequence. A checkpointed block keeps only its inputs and runs
its forward again during backward (about +33% compute for a transformer block: one more forward
for two units of backward). Variants, as torchtitan's AC classes:

- :class:`BlocksAC` (``blocks``, ``blocks:every=N``): every repeated block (detected
  automatically: the ModuleLists / Sequentials whose children share one class, e.g. Hugging Face
  decoder layers) is checkpointed, or one in N, trading memory for less recompute;
- :class:`SelectiveAC` (``selective``): op-level policy (``create_selective_checkpoint_contexts``):
  inside each block the outputs of matmuls, convolutions and attention are saved, cheap pointwise
  ops recomputed: most of the memory saving at a fraction of the recompute;
- :class:`MemoryBudgetAC` (``budget:F``, with ``compile``): torch.compile's min-cut partitioner
  keeps a fraction F of the activations of the compiled regions, recomputing the cheapest rest;
- :class:`NoAC` (``none``).

All use non-reentrant ``torch.utils.checkpoint`` with the RNG state restored (``blocks:reentrant=true``:
torch's reentrant one, as many users' trainers run it: memfit.techniques.reentrant_checkpoint), so dropout gives
the same result, and the model's code and module types stay unchanged (only the blocks'
``forward`` is wrapped). The recomputation runs under the contexts the step holds around forward
(``StepParts.recompute_contexts``, e.g. chunked attention), so it repeats the forward exactly.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memfit.errors import UserError
from memfit.techniques.base import (
    AdaptContext,
    Config,
    Export,
    GraphSize,
    Key,
    SearchContext,
    Technique,
    register,
)
from memfit.techniques.checkpoint_call import HOOKS_KWARGS, checkpoint
from memfit.techniques.forwards import forward_of
from memfit.techniques.reentrant_checkpoint import reentrant_forward, reentrant_of, require_input_grads

aten = torch.ops.aten

# NOTE [ Selective checkpointing policy ]: save what is expensive to recompute (matmuls,
# convolutions, attention kernels); recompute everything else (pointwise, norms, softmax).
SAVE_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_cudnn_attention.default,
    aten.mkldnn_rnn_layer.default,
}
BUDGET_LADDER = (0.5, 0.1)
"""Activation memory budgets the planner searches and OOM adaptation steps down (NOTE [ Activation
budget ladder ])."""
BUDGET_ESCALATION = 5
"""A compiled plan's budget is lowered before micro-batches (accumulation's escalation: 10)."""
BUDGET_RECORDING = ((0.1, 43.8, 89.9), (0.5, 41.8, 129.5), (1.0, 35.2, 45.6))
"""(budget fraction, ms/step, compile seconds) measured on one H100: a hand-written GPT-2 124M, batch
8 x 1024, bf16 autocast, AdamW, ``torch.compile(model)``, no memfit
(gpu-ground-truth/h100-handwritten-gpt2-compile.jsonl; compile seconds: the first step's warm-up less
eager's 0.76 s); fraction 1 is compile without a budget. The GPU-preset time model's budget costs
are interpolated in this one recording (:func:`recorded_cost`; below 0.1: the 0.1 figures); nothing
else calibrates them."""


def find_blocks(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The repeated blocks: containers whose children (>= 2) share one class, outermost first, and lists
    of blocks of a few classes each repeated (a hybrid decoder's: Jamba's attention and Mamba layers).

    Nested repeats (a repeated block inside a repeated block) are not returned twice. A list whose classes
    are not each repeated is not one (a UNet's down blocks: three with attention, one without). A list of
    models that hold repeated blocks themselves is not one either: their blocks are (NOTE [ A model within the
    model ]).
    """
    found: list[tuple[str, list[nn.Module]]] = []
    claimed: set[int] = set()
    for name, mod in model.named_modules():
        if id(mod) in claimed or not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.children())
        if repeated(children, isinstance(mod, nn.ModuleList)) and not _models_of_blocks(children):
            found.append((name, children))
            for c in children:
                claimed.update(id(m) for m in c.modules())
    return found


# NOTE [ A model within the model ]
# A UNet's cross-attention blocks hold Transformer2DModels, each a diffusers model of its own with a list
# of BasicTransformerBlocks (SDXL: 2 or 10 of them). diffusers' ``enable_gradient_checkpointing`` (which
# ai-toolkit and diffusers' scripts call) and kohya's own SDXL UNet checkpoint each BasicTransformerBlock
# and each resnet, not the Transformer2DModel: recomputing ten blocks at once in backward holds all ten
# blocks' activations together (SDXL LoRA at 1024 px on the rtx4090 preset: 6.57 GiB allocated against
# the 6.21 of diffusers' own checkpointing). So a repeated list whose blocks are library models (a class
# that supports gradient checkpointing itself: LIBRARY_MODEL_FLAGS) that hold repeated blocks is passed
# over, and the blocks inside are the blocks. A decoder layer is no model
# (its MoE experts stay inside the block); a Transformer2DModel of one block (SD 1.5's) holds no repeat and
# stays the block.
LIBRARY_MODEL_FLAGS = ("_supports_gradient_checkpointing", "supports_gradient_checkpointing")
"""Class attributes of a library's models that checkpoint their own blocks: diffusers' ``ModelMixin``'s, transformers'
``PreTrainedModel``'s."""


def _models_of_blocks(children: list[nn.Module]) -> bool:
    return all(any(getattr(type(c), flag, False) for flag in LIBRARY_MODEL_FLAGS) and
               any(repeated(list(m.children()), isinstance(m, nn.ModuleList))
                   for m in c.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)))
               for c in children)


def repeated(children: list[nn.Module], in_list: bool = True) -> bool:
    """Whether ``children`` of a container (``in_list``: a ModuleList, else a Sequential) are repeated blocks
    (:func:`find_blocks`); a list of single layers is not (NOTE [ A list of single layers ])."""
    classes = collections.Counter(type(c) for c in children)
    several = in_list and min(classes.values(), default=0) >= 2 and \
        all(next(c.parameters(), None) is not None for c in children)
    return len(children) >= 2 and (len(classes) == 1 or several) and \
        sum(p.numel() for p in children[0].parameters()) > 0 and not (in_list and all(map(_one_layer, children)))


# NOTE [ A list of single layers ]
# A ModuleList whose every module holds its parameters in one layer (a Linear, a norm, a projection wrapping
# one Linear) is not a stack of blocks. Such lists hold parallel projections, heads and norms, each run on an
# input of its own: HiDream-I1's 49 caption projections (one Linear each: a Llama layer's states per block, and T5's),
# Chroma's guidance norms, Gemma-3n's AltUp projections; none of its trainers checkpoints or swaps them, and
# the planner's "blocks swapped" would count them beside the transformer blocks. Checkpointing one layer keeps
# what the layer keeps for backward (its input), so it saves nothing where it would run in a chain. A
# Sequential's children do run in a chain (each on the one before's output): a Sequential of one class stays a
# stack however small its modules.
def _one_layer(module: nn.Module) -> bool:
    return sum(next(m.parameters(recurse=False), None) is not None for m in module.modules()) == 1


# NOTE [ Nothing saved from under no_grad ]
# Selective checkpointing caches the outputs of SAVE_OPS in forward and hands them back, in the same order,
# when backward recomputes the block. An op a block runs under ``no_grad`` gives backward nothing to use, and
# the block may change its output in place: HiDream-I1's routed experts (``moe_infer``, what diffusers' LoRA
# script runs) scale each expert's output with ``mul_``, and torch's SAC then refuses the recomputation on any
# device ("Tensor cached during selective activation checkpoint has been mutated"). So only ops run with grad
# are saved; the others are recomputed, as block checkpointing recomputes everything.
def _policy(ctx, op, *args, **kwargs):
    saved = op in SAVE_OPS and torch.is_grad_enabled()  # NOTE [ Nothing saved from under no_grad ]
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed_forward(original, selective: bool, recompute_contexts, *args, **kwargs):
    if not torch.is_grad_enabled():
        return original(*args, **kwargs)
    # ``recompute_contexts`` is read when the block runs, so contexts that techniques applied
    # after this one add to the step are included; without any, checkpoint's default applies.
    if recompute_contexts:
        extra = {"context_fn": _context_fn(selective, recompute_contexts)}
    elif selective:  # the policy's own contexts (dispatch modes, as torch.compile requires of a context_fn)
        extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _policy)}
    else:
        extra = {}
    return checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True, **HOOKS_KWARGS, **extra,
                      **kwargs)


def _context_fn(selective: bool, recompute_contexts: list):
    """checkpoint's context_fn: (forward context, recompute context)."""
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


def checkpoint_blocks(model: nn.Module, *, every: int = 1, selective: bool = False, reentrant: bool = False,
                      recompute_contexts: list | None = None) -> list[nn.Module]:
    """Wrap the forward of every ``every``-th repeated block of ``model`` in a checkpoint (in
    place; ``reentrant``: torch's reentrant one, memfit.techniques.reentrant_checkpoint); returns the
    wrapped blocks. ``del block.forward`` restores one."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # Hugging Face models update a KV cache in forward when use_cache is on, so a recomputed
        # forward would differ from the first one; training needs no cache (HF does the same).
        config.use_cache = False
    blocks = find_blocks(model)
    if not blocks:
        raise UserError("checkpointing: found no repeated blocks (a ModuleList of modules of one class, each more "
                        "than one layer, or a Sequential of one class) in the model; use checkpointing: none, or "
                        "structure the model in blocks")
    recompute_contexts = recompute_contexts if recompute_contexts is not None else ()  # (none to come)
    wrapped = []
    for _, children in blocks:
        for i, block in enumerate(children):
            if i % every:
                continue
            block.forward = functools.partial(reentrant_forward, forward_of(block), block, recompute_contexts) \
                if reentrant else functools.partial(_checkpointed_forward, forward_of(block), selective, recompute_contexts)
            wrapped.append(block)
    if reentrant:
        require_input_grads(model)
    return wrapped


def _checkpoint_step_blocks(parts, **options) -> None:
    """The step's blocks checkpointed, each re-entering the step's recompute contexts: the list while
    techniques apply (a later one may add to it), a tuple once all have (NOTE [ Wrapped forwards that
    torch.compile does not tie to one model ] in memfit.techniques.forwards: Dynamo guards a list
    inside a compiled region by its identity, one list per model copy)."""
    blocks = checkpoint_blocks(parts.model, recompute_contexts=parts.recompute_contexts, **options)
    wrappers = [block.forward for block in blocks]  # (a later technique may wrap them in turn: kept as they are)

    def freeze(parts) -> None:
        for wrapper in wrappers:  # (the same partial, its list now a tuple)
            args = tuple(tuple(a) if isinstance(a, list) else a for a in wrapper.args)
            wrapper.__setstate__((wrapper.func, args, wrapper.keywords, None))
    parts.finalizers.append(freeze)


class Checkpointing(Config):
    adds_work = True

    def label(self, batch_size):
        return f"ckpt={self.text.replace('blocks:every=', 'every').replace('blocks:', '').replace('=true', '')}"

    def ablations(self):
        return [(f"checkpointing {self.text}", NoAC())]

    def export(self, into: Export) -> None:
        into.not_carried(self)  # TrainingArguments checkpoints every layer or none

    @classmethod
    def from_arguments(cls, given: Export) -> Checkpointing | None:
        """``TrainingArguments(gradient_checkpointing=True)`` checkpoints every block (torch's reentrant checkpoint
        where its ``gradient_checkpointing_kwargs`` ask: memfit.techniques.reentrant_checkpoint.reentrant_of)."""
        if not given.hf.get("gradient_checkpointing"):
            return None
        return BlocksAC(reentrant=reentrant_of(given.hf.get("gradient_checkpointing_kwargs")))


@dataclass(frozen=True)
class NoAC(Checkpointing):
    """Keep every activation for backward."""

    rank = 0
    adds_work = False

    def values(self) -> dict:
        return {"checkpointing": "none"}

    def label(self, batch_size):
        return None

    def ablations(self):
        return []

    def export(self, into: Export) -> None:
        pass

    def escalation(self, ctx: AdaptContext):
        return BUDGET_ESCALATION if _compiles(ctx.plan) else self.technique.escalation

    # NOTE [ Activation budget ladder ]
    # A compiled plan without checkpointing runs at torch's default budget (1: keep what the
    # partitioner keeps anyway). Lowering F buys memory inside the compiled regions with the batch
    # kept whole (H100, GPT-2: F 0.5 took 5.5 GiB at +19% step time where compile alone took 6.6 GiB),
    # so OOM adaptation lowers it first, along ``BUDGET_LADDER`` (1 -> 0.5 -> 0.1), then splits the
    # batch; the planner searches the same fractions. The ladder stops at 0.1, not 0: at budget 0 a
    # whole-model graph (``compile: full``) recomputes its entire forward before the first backward op
    # and holds it, so its peak can exceed that of no budget (+12% predicted for the 2-layer GPT-2 at
    # batch 4 x 128 whose compiled peaks tests/unit/techniques/test_compile.py checks against the
    # profiler), while 0.1 came out below 0.5 for whole-model graphs and blocks alike (the H100
    # recording; predictions of that GPT-2). Peak memory is not monotone in F for whole-model graphs
    # (0.25 above 0.5 on that GPT-2), so budgets stay out of the memory order the planner prunes by
    # (``rank = None``). A compiled plan that checkpoints blocks or selectively keeps its mode (the
    # budget is a checkpointing mode of its own).
    def frugal(self, ctx: AdaptContext):
        if _compiles(ctx.plan):  # NOTE [ Activation budget ladder ]
            return _lower_budget(ctx, 1.0)
        if not find_blocks(ctx.model):
            return None
        return BlocksAC(), "checkpointing: blocks"


@dataclass(frozen=True)
class BlocksAC(Checkpointing):
    """Checkpoint whole repeated blocks: only each block's input is kept."""

    every: int = 1
    """Checkpoint one block in ``every`` (1: all of them)."""
    reentrant: bool = False
    """torch's reentrant checkpoint (memfit.techniques.reentrant_checkpoint), as users' trainers run it."""

    @property
    def rank(self) -> int:
        return 2 if self.every == 1 else 1

    def values(self) -> dict:
        options = ",".join([f"every={self.every}"] * (self.every != 1) + ["reentrant=true"] * self.reentrant)
        return {"checkpointing": f"blocks:{options}" if options else "blocks"}

    def check(self, plan) -> None:
        for other, on in (("compile", plan.config("compile").compiles), ("shard: fsdp", plan.config("shard").fsdp2)):
            if self.reentrant and on:
                raise UserError(f"plan: checkpointing {self.text} with {other} is not supported (torch.compile and "
                                "FSDP2 take the non-reentrant checkpoint); use checkpointing: blocks")

    def apply(self, parts) -> None:
        _checkpoint_step_blocks(parts, every=self.every, reentrant=self.reentrant)

    def export(self, into: Export) -> None:
        if self.every != 1:
            return super().export(into)
        into.hf.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": self.reentrant})
        into.kohya["gradient_checkpointing"] = into.ai_toolkit["train.gradient_checkpointing"] = True
        into.axolotl["gradient_checkpointing"] = True
        if self.reentrant:
            into.axolotl["gradient_checkpointing_kwargs"] = {"use_reentrant": True}
        into.not_carried(self, hf=False, kohya=self.reentrant, axolotl=False)


@dataclass(frozen=True)
class SelectiveAC(Checkpointing):
    """Checkpoint blocks op by op: save matmul, convolution and attention outputs, recompute the rest."""

    rank = 1

    def values(self) -> dict:
        return {"checkpointing": "selective"}

    def apply(self, parts) -> None:
        _checkpoint_step_blocks(parts, selective=True)


@dataclass(frozen=True)
class MemoryBudgetAC(Checkpointing):
    """torch.compile's activation memory budget (``torch._functorch.config.activation_memory_budget``):
    in each compiled region the min-cut partitioner keeps this fraction of the activations it would
    save, recomputing the cheapest rest in backward. The compile technique compiles with it."""

    fraction: float = 0.5
    """0 keeps as little as it can (recompute all it can), 1 keeps what compile keeps anyway."""
    rank = None
    warms_up = True  # the partitioner's search

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise UserError(f"plan: checkpointing {self.text!r}: the budget fraction must be in [0, 1]")

    def values(self) -> dict:
        return {"checkpointing": f"budget:{self.fraction:g}"}

    def check(self, plan) -> None:
        if not plan.config("compile").compiles:
            raise UserError(f"plan: checkpointing {self.text} sets torch.compile's activation memory budget, so it "
                            "needs compile: blocks or compile: full")

    def label(self, batch_size):
        return f"budget={self.fraction:g}"

    def escalation(self, ctx: AdaptContext):
        return BUDGET_ESCALATION

    def frugal(self, ctx: AdaptContext):
        return _lower_budget(ctx, self.fraction)

    def warmup_seconds(self, graph: GraphSize, plan) -> float:
        """The partitioner's extra compile time, from ``BUDGET_RECORDING``."""
        return plan.config("compile").warmup_seconds(graph, plan) * (recorded_cost(self.fraction)[1] - 1)


def _compiles(plan) -> bool:
    return plan.config("compile").compiles


def _lower_budget(ctx: AdaptContext, fraction: float):
    """A budget down ``BUDGET_LADDER`` from ``fraction``: the next one, or with predictions
    (``ctx.fits``) the first predicted to fit, else the lowest."""
    lower = [f for f in BUDGET_LADDER if f < fraction]
    if not lower:
        return None
    chosen, predicted = lower[0], False
    if ctx.fits is not None:
        chosen = next((f for f in lower if ctx.fits(ctx.plan.with_config(MemoryBudgetAC(f)))), lower[-1])
        predicted = ctx.fits(ctx.plan.with_config(MemoryBudgetAC(chosen)))
    return (MemoryBudgetAC(chosen), f"checkpointing: budget:{chosen:g} (the compiled regions' activation memory "
            f"budget, was {fraction:g}" + ("; the largest predicted to fit)" if predicted else ")"))


def recorded_cost(fraction: float) -> tuple[float, float]:
    """(step time, compile time) at budget ``fraction``, relative to compile without a budget,
    interpolated in ``BUDGET_RECORDING``."""
    f = min(max(fraction, BUDGET_RECORDING[0][0]), 1.0)
    for (f0, s0, c0), (f1, s1, c1) in zip(BUDGET_RECORDING, BUDGET_RECORDING[1:]):
        if f <= f1:
            w = (f - f0) / (f1 - f0)
            _, step, compile_s = BUDGET_RECORDING[-1]
            return (s0 + w * (s1 - s0)) / step, (c0 + w * (c1 - c0)) / compile_s
    raise AssertionError(fraction)


_GRAMMAR = re.compile(r"^(none|blocks|blocks:(every=(\d+)|(every=(\d+),)?reentrant=(true|false))|selective|"
                      r"budget:([0-9]*\.?[0-9]+))$")


def parse(values: dict) -> Checkpointing:
    text = values["checkpointing"]
    m = _GRAMMAR.match(str(text))
    if not m:
        raise UserError(f"plan: checkpointing {text!r} is not valid; use none, blocks, blocks:every=N, "
                        "blocks:reentrant=true, selective or budget:FRACTION (e.g. budget:0.5)")
    if m.group(2) is not None:
        every = int(m.group(3) or m.group(5) or 1)
        if every < 1:
            raise UserError("plan: checkpointing blocks:every=N needs N >= 1")
        return BlocksAC(every, reentrant=m.group(6) == "true")
    if m.group(7) is not None:
        return MemoryBudgetAC(float(m.group(7)))
    return {"none": NoAC(), "blocks": BlocksAC(), "selective": SelectiveAC()}[text]


def search(ctx: SearchContext) -> list[str]:
    """Budgets too: plans that do not compile refuse them (the planner searches compile where asked)."""
    budgets = [f"budget:{f:g}" for f in BUDGET_LADDER]
    return (["none", "blocks:every=2", "selective", "blocks"] if find_blocks(ctx.model) else ["none"]) + budgets


TECHNIQUE = register(
    Technique("checkpointing", (Key("checkpointing", "none", "Activation checkpointing: none | blocks | "
                                    "blocks:every=N | blocks:reentrant=true | selective | budget:FRACTION.", metavar="CHECKPOINTING"),),
              parse, search=search, escalation=20, depends_on_model=True),
    Checkpointing, NoAC, BlocksAC, SelectiveAC, MemoryBudgetAC)
