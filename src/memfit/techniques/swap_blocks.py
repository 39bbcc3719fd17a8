"""Block swap: the frozen weights of N repeated blocks live in host memory and visit the device
one block at a time (kohya's ``--blocks_to_swap``, diffusers' group offloading).

Memory/compute trade-off. A LoRA (or an fp8 base) trains a few parameters beside a frozen model
that must still sit on the device: FLUX.1-dev's 11.9B weights are 23.8 GB in bf16, more than a
24 GB card holds with activations. With ``swap_blocks: N`` the last N repeated blocks' frozen
weights stay in pinned host memory; before a swapped block's forward its weights are copied to the
device, and dropped after it; before its backward (and the recomputation of a checkpointed block)
they are copied again. The device holds the other blocks and at most two swapped blocks at a time:
the one running and the next, whose copy runs on a side stream while the current block computes
(the prefetch). The host holds the N blocks' weights (page-locked RAM). Nothing goes back: the
weights are frozen, and the host copy stays the truth; trainable parameters (the LoRA's matrices),
their gradients and optimizer states stay on the device.

The price is time: each swapped block's weights cross the host link twice per micro-batch (a
FLUX.1-dev double block, 680 MB in bf16, 340 MB in fp8: about 27 and 14 ms each way at PCIe 4's
25 GB/s). A copy hides behind the previous block's compute; the step waits where the copy takes
longer, so small batches and low resolutions (little compute per block) on a slow link show it,
and the planner prices each copy at the card's link bandwidth (``swap_blocks: N`` in its search:
none, a quarter, half, three quarters and all of the blocks, where the weights fill most of the
budget). The first swapped block of forward and of backward is copied with nothing to hide behind.
Exact: the same weights in the same ops, so the gradients are bit-identical to the step without it.

Blocks are the model's repeated blocks (memfit.techniques.checkpointing.find_blocks), in the order
their containers are registered, which is the order they run in for the models memfit knows
(FLUX.1-dev: 19 double-stream then 38 single-stream blocks); a block that runs out of that order is
copied when it starts (correct, not prefetched). A model that loads as a checkpoint has the swapped
weights copied to the host one weight at a time as they load (after their quantization, with
``base_weights: fp8``), so the full model never sits on the device.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from memfit.errors import UserError
from memfit.techniques.base import Config, Export, Key, SearchContext, Technique, register, whole_number
from memfit.techniques.base_weights import least_weight_bytes
from memfit.techniques.checkpointing import find_blocks
from memfit.techniques.placement import HostPlacement, doing


def model_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every repeated block of ``model``, in the order of their containers (see the docstring)."""
    return [block for _, children in find_blocks(model) for block in children]


def _swapped(model: torch.nn.Module, count: int) -> tuple[list[torch.nn.Module], set[int]]:
    """The model's blocks and the indices of the last ``count`` (the user errors of the key)."""
    found = find_blocks(model)
    blocks = [block for _, children in found for block in children]
    if not blocks:
        raise UserError(f"plan: swap_blocks {count}: the model has no repeated blocks (a ModuleList or Sequential "
                        "of modules of one class) to swap; use swap_blocks: 0")
    if count > len(blocks):
        where = ", ".join(f"{name or 'model'}: {len(children)}" for name, children in found)
        raise UserError(f"plan: swap_blocks {count} exceeds the model's {len(blocks)} repeated blocks ({where}); "
                        f"use swap_blocks <= {len(blocks)}")
    return blocks, set(range(len(blocks) - count, len(blocks)))


def _swappable(model: torch.nn.Module, base_weights: str | None) -> bool:
    """Blocks to swap, in a format the swap streams (as-is or fp8, not bitsandbytes' layers)."""
    return str(base_weights or "as-is") in ("as-is", "fp8") and bool(model_blocks(model))


def least_resident_bytes(model: torch.nn.Module, base_weights: str | None, adapter: bool = True) -> int | None:
    """Bytes of the weights that stay on the device however many blocks are swapped; None where no
    block can be swapped (:func:`resident_weight_bytes` of every block)."""
    if not _swappable(model, base_weights):
        return None
    return resident_weight_bytes(model, base_weights, len(model_blocks(model)), adapter)


def resident_weight_bytes(model: torch.nn.Module, base_weights: str | None, count: int, adapter: bool = True,
                          other: int = 2) -> int:
    """Bytes of the weights on the device with the last ``count`` blocks swapped: all but those
    blocks' frozen weights, and those of the two largest of them (the one running and the one being
    fetched), in ``other`` bytes (16 bits; 4 where the plan's weights are fp32) or ``base_weights``' format
    (memfit.techniques.base_weights.least_weight_bytes). ``adapter``: an adapter freezes the blocks' weights
    (without one, only those the model freezes itself are frozen). A lower bound of what any plan with
    ``swap_blocks: count`` allocates."""
    base = str(base_weights or "as-is")
    blocks = model_blocks(model)
    swapped = blocks[len(blocks) - count:] if 0 < count <= len(blocks) else []
    sizes = sorted((least_weight_bytes([p for p in b.parameters() if adapter or not p.requires_grad], model, base, other)
                    for b in swapped), reverse=True)
    return least_weight_bytes(model.parameters(), model, base, other) - sum(sizes) + sum(sizes[:2])


# NOTE [ Weights saved for backward ]
# A swapped parameter's ``.data`` is its host copy while its block is away and a device copy while it
# is there. Autograd keeps a leaf it saves as the parameter itself, which follows ``.data``; but an op
# may save a view of a weight (``nn.Linear`` saves ``weight.t()`` for the input's gradient), and a view
# holds the device copy it was made from until backward: every swapped block's weights would stay on
# the device from forward to backward. So while a swapped block runs forward, saved-tensor hooks pack
# a view of one of its weights as (which weight, size, stride, offset) and rebuild it, in backward,
# from the weight's device copy of then, which the block's backward pre-hook has fetched. Any other
# tensor goes to the hooks held outside (offloaded activations), or is kept as it is. A checkpointed
# block saves only its inputs in forward; its recomputation in backward runs with its weights there.
class BlockSwapper:
    """Streams the frozen weights of the swapped blocks (see the module docstring).

    ``weights[i]``: block ``i``'s frozen parameters and their host copies; see NOTE [ Weights saved
    for backward ] for how backward finds them.
    """

    def __init__(self, blocks: list[torch.nn.Module], weights: dict[int, list[tuple[torch.nn.Parameter, torch.Tensor]]],
                 placement: HostPlacement, device: torch.device):
        self.blocks, self.weights, self.placement, self.device = blocks, weights, placement, device
        self.swapped = sorted(weights)
        self.there: dict[int, tuple[list[torch.Tensor], object]] = {}
        """Blocks on the device (fetched or on their way): their device copies, and the CUDA event
        their copy records (None: done, or waited for)."""
        self._stream = None
        self._marked = False
        self.handles = []
        for k, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(lambda m, args, k=k: self._before_forward(k)))
            self.handles.append(block.register_full_backward_pre_hook(lambda m, grad, k=k: self._before_backward(k)))
            if k in weights:
                self.handles.append(block.register_forward_hook(lambda m, args, out, k=k: self._release(k)))
                block.forward = functools.partial(self._forward, k, block.forward)

    def _forward(self, k: int, forward, *args, **kwargs):
        """Block ``k``'s forward with its weights' views saved by reference (NOTE [ Weights saved for
        backward ])."""
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (pack, unpack) held outside, or None
        copies = {t.untyped_storage()._cdata: i for i, t in enumerate(self.there[k][0])}

        def pack(t: torch.Tensor):
            i = None if isinstance(t, torch.nn.Parameter) else copies.get(t.untyped_storage()._cdata)
            if i is not None:
                return _WeightView(k, i, tuple(t.shape), t.stride(), t.storage_offset())
            return outer[0](t) if outer is not None else t

        def unpack(packed):
            if isinstance(packed, _WeightView):
                weight = self.weights[packed.block][packed.index][0]
                return weight.data.as_strided(packed.shape, packed.stride, packed.offset)
            return outer[1](packed) if outer is not None else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return forward(*args, **kwargs)

    # -- the hooks ---------------------------------------------------------------------------------
    def _before_forward(self, k: int) -> None:
        self._mark_host()
        following = next((j for j in self.swapped if j > k), None)
        self._keep({k, following})
        if k in self.weights:
            self._use(k)
        if following is not None:
            self._fetch(following, ahead=True)

    def _before_backward(self, k: int) -> None:
        preceding = next((j for j in reversed(self.swapped) if j < k), None)
        self._keep({k, preceding})  # (the blocks after k have had their backward)
        if k in self.weights:
            self._use(k)
        if preceding is not None:
            self._fetch(preceding, ahead=True)

    def release_all(self, step=None) -> None:
        """After the last backward of a step: every block back to its host copy."""
        self._keep(set())
        self._marked = False

    # -- moving weights ------------------------------------------------------------------------------
    def _mark_host(self) -> None:
        """Tell the step's observer, once a step, which storages are host memory (the copies were
        made while the step was built, before anyone watched)."""
        if not self._marked:
            self.placement.mark_host([host for pairs in self.weights.values() for _, host in pairs])
            self._marked = True

    def _keep(self, keep: set) -> None:
        for j in [j for j in self.there if j not in keep]:
            self._release(j)

    def _use(self, k: int) -> None:
        copies, event = self.there.get(k) or self._fetch(k, ahead=False)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            self.there[k] = (copies, None)
        for (param, _), copy in zip(self.weights[k], copies):
            param.data = copy

    def _release(self, k: int) -> None:
        entry = self.there.pop(k, None)
        if entry is None:
            return
        if entry[1] is not None:  # fetched ahead, never used: its block is reused after the copy
            torch.cuda.current_stream(self.device).wait_event(entry[1])
        for param, host in self.weights[k]:
            param.data = host

    def _fetch(self, k: int, *, ahead: bool):
        """Start block ``k``'s copy to the device (``ahead``: on the side stream, after what the compute
        stream has queued); returns (the device copies, the copy's event or None)."""
        if k in self.there:
            return self.there[k]
        hosts = [host for _, host in self.weights[k]]
        if self.device.type != "cuda" or not ahead:
            with doing("in") if ahead else contextlib.nullcontext():  # (the op recorder: a side-stream copy)
                entry = ([self.placement.to_device(h, self.device) for h in hosts], None)
        else:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
            # allocated on the compute stream (its pool, as the estimate books it), filled on the side one
            copies = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in hosts]
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for copy, h in zip(copies, hosts):
                    copy.copy_(h, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            entry = (copies, event)
        self.there[k] = entry
        return entry


class _WeightView(NamedTuple):
    """A saved view of a swapped weight: rebuilt from the weight's device copy when backward needs it."""

    block: int
    index: int
    shape: tuple
    stride: tuple
    offset: int


@dataclass(frozen=True)
class SwapBlocks(Config):
    """Keep the frozen weights of the last ``count`` repeated blocks in host memory (0: none)."""

    count: int = 0
    """How many blocks, counted from the last (0 <= count <= the model's repeated blocks)."""
    adds_work = True

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 0:
            raise UserError(f"plan: swap_blocks must be a whole number >= 0 (blocks kept in host memory), got "
                            f"{self.count!r}")

    def values(self) -> dict:
        return {"swap_blocks": self.count}

    @property
    def rank(self) -> int:
        return self.count

    def check(self, plan) -> None:
        if not self.count:
            return
        if not plan.config("compile").is_default:
            raise UserError("plan: swap_blocks moves weights between a block's calls, which a compiled graph does not "
                            "see; use compile: none with swap_blocks, or swap_blocks: 0")
        if plan.config("shard").fsdp2:
            raise UserError("plan: swap_blocks with shard: fsdp2 is not supported (FSDP2 owns the parameters' "
                            "storage); use shard_offload for sharded weights, or swap_blocks: 0")
        if plan.base_weights in ("int8",) or str(plan.base_weights).startswith(("nf4", "fp4")):
            raise UserError(f"plan: swap_blocks streams plain or fp8 weights, not bitsandbytes' {plan.base_weights} "
                            "layers; use base_weights: fp8 or as-is with swap_blocks, or swap_blocks: 0")

    def on_load(self, model, load) -> None:
        """The swapped blocks' parameters load into host memory (quantized there with fp8)."""
        if self.count:
            blocks, swapped = _swapped(model, self.count)
            load.on_host.update(id(p) for k in swapped for p in blocks[k].parameters())

    def apply(self, parts) -> None:
        if not self.count:
            return
        blocks, swapped = _swapped(parts.model, self.count)
        device = torch.device(parts.device_type)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        weights = {}
        for k in sorted(swapped):
            _buffers_to(blocks[k], device)
            frozen = []
            for p in blocks[k].parameters():
                if p.requires_grad:
                    if p.device != device and device.type == "cuda":  # (an adapter made beside a host weight)
                        p.data = p.data.to(device)
                    continue
                frozen.append((p, p.data if parts.loaded else parts.placement.to_host(p.data)))
                p.data = frozen[-1][1]
            if not frozen:
                raise UserError(f"plan: swap_blocks streams frozen weights, and block {k} has none (every weight "
                                "trains); train an adapter (adapter: lora:r=16) or use swap_blocks: 0")
            weights[k] = frozen
        swapper = BlockSwapper(blocks, weights, parts.placement, device)
        parts.before_update.append(swapper.release_all)

    def label(self, batch_size):
        return f"swap={self.count}" if self.count else None

    def ablations(self):
        return [("swap_blocks", SwapBlocks())] if self.count else []

    def export(self, into: Export) -> None:
        if self.count:
            into.kohya["blocks_to_swap"] = self.count  # (FLUX's: sd-scripts' own count, memfit.integrations.kohya_export)
            into.ai_toolkit["model.swapped_blocks"] = self.count  # (as layer_offloading's share: ai_toolkit_export)
            into.not_carried(self, kohya=False, ai_toolkit=False)


def _buffers_to(block: torch.nn.Module, device: torch.device) -> None:
    """Buffers stay on the device (fp8 scales made on the host while loading, a few bytes a row)."""
    if device.type != "cuda":
        return
    for module in block.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


def parse(values: dict) -> SwapBlocks:
    value = values["swap_blocks"]
    if value is None:
        value = 0
    return SwapBlocks(value)


SEARCHED_OVER = 0.75
"""The share of the budget the weights must take for swap to be searched. Under it the weights leave a
quarter of the card or more for activations, which block checkpointing makes small: a 7B LoRA in
bf16 on a 24 GB card (0.6-0.7) fits without swap, and searching it there cost the planner a full-depth
trace per swapped count (70 s of a Qwen2.5-7B LoRA's plan). FLUX.1-dev in fp8 takes 0.93 of a 12 GiB
budget, 0.52 of a 24 GB card's (kohya swaps blocks on 12 and 16 GB cards, not on 24 GB ones)."""
WITH_INPUTS_OVER = 0.85
"""Or the share the weights and what block checkpointing keeps (each block's input: memfit.planner.space's
NOTE [ What the repeated blocks take in ]) must take together, where the weights take at least
``INPUTS_ASKED_OVER``: a video model's tokens make block checkpointing keep gigabytes (Wan 14B in fp8
at 81 frames on a 24 GB card: 0.63 of the budget, 0.97 with its 40 blocks' inputs), a language model's
do not (Qwen2.5-7B's LoRA at 2 x 2048: 0.75 with them)."""
INPUTS_ASKED_OVER = 0.5


def search(ctx: SearchContext) -> list[int]:
    """None, about a quarter, half and three quarters, and all of the blocks (of the denoiser's, behind text
    encoders' stacks), on GPU presets where the
    weights take more than ``SEARCHED_OVER`` of the budget (or whatever they take, with the option
    ``swap_everywhere``: NOTE [ Swap searched when nothing fits ] in memfit.planner.search) (in the format the plan stores them:
    ``base_weights``), or they and the blocks' inputs more than ``WITH_INPUTS_OVER``; else none (the host is the device on a CPU, and a model far under its budget
    gains nothing). "About": NOTE [ Swapped counts the planner traces shallow ]."""
    budget, base = ctx.options.get("budget_bytes"), ctx.options.get("base_weights")
    if not ctx.device.is_gpu or budget is None or not _swappable(ctx.model, base):
        return [0]
    weights = least_weight_bytes(ctx.model.parameters(), ctx.model, str(base or "as-is"))
    if weights <= SEARCHED_OVER * budget and not ctx.options.get("swap_everywhere"):
        inputs = ctx.options.get("block_inputs") if weights > INPUTS_ASKED_OVER * budget else None
        taken = inputs() if inputs is not None else None
        if taken is None or weights + taken <= WITH_INPUTS_OVER * budget:
            ctx.narrowed.append("swap_blocks")
            return [0]
    lengths = [len(blocks) for _, blocks in find_blocks(ctx.model)]
    tail = ctx.options.get("swap_tail") or lengths  # (the shares: of the blocks a shallow pair swaps, the last stacks)
    depth = math.gcd(*tail)
    return sorted({0, *(_near(sum(tail), depth, share) for share in (0.25, 0.5, 0.75)), sum(tail)})


# NOTE [ Swapped counts the planner traces shallow ]
# The planner measures a plan by traces of the model cut to a few blocks a stack (memfit.planner.shallow),
# keeping the full model's share of swapped blocks: N of the blocks, at depth d of D (a stack's blocks,
# or units of stacks of two depths), swaps N * d / D, which is whole every D / gcd(D, N) blocks, and
# the cut model is a few such periods deep. A quarter of Gemma-2's 42 blocks (10) repeats every 21 and
# three quarters (31) every 42: each such plan was traced at full depth, 21 s a trace, where 14 and 28
# (a third, two thirds) repeat every 3 blocks and cost two traces of 6 and 9 blocks, or 3 and 6. So
# each share is the count within an eighth of the blocks of it whose share repeats soonest, the nearest
# of those: 14, 21 and 28 of 42; 8, 16 and 24 of 32 as before; 19, 28 and 38 of FLUX.1's 57 (19 + 38:
# 19 and 38 repeat every unit, 28 at full depth only). Which counts are searched is a choice of grid
# (kohya's users set any), not of what is predicted. Where text encoders' stacks come first (FLUX.1 with its
# encoders in the step), the shares are of the denoiser's blocks behind them (``swap_tail``: NOTE [ Stacks of
# unequal blocks ] in memfit.planner.stacks); swapping the encoders' blocks too is the user's to ask.
def _near(n: int, depth: int, share: float) -> int:
    """The count of ``n`` blocks (``depth`` deep: memfit.planner.shallow.depth_of) within an eighth of them
    of ``share`` whose share repeats in the fewest blocks, nearest ``share`` among those."""
    window = [k for k in range(1, n) if abs(k - share * n) <= n / 8] or [max(1, round(share * n))]
    return min(window, key=lambda k: (depth // math.gcd(depth, k), abs(k - share * n)))


TECHNIQUE = register(
    Technique("swap_blocks", (Key("swap_blocks", 0, "Keep the frozen weights of the last N repeated blocks in host "
                                  "memory, each copied to the device before its forward and backward (with an "
                                  "adapter or fp8 base weights).",
                                  annotation="int", from_text=whole_number("--swap-blocks"), metavar="N"),),
              parse, search=search, depends_on_model=True),
    SwapBlocks)
