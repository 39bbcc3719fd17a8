"""How shallow traces cut a model's stacks of repeated blocks (:class:`Stacks`): how many blocks of each
stack a trace at depth ``t`` keeps, so that every figure that grows with the blocks grows on a line in
``t`` (the NOTEs below).

Blocks of several kinds: where one class of block is built in several shapes, which blocks a shallow
trace may stand for the others. A shallow pair (memfit.planner.shallow) extrapolates the blocks it adds between its two depths to the
blocks it leaves out. That holds where the blocks left out are the added ones again. Many models build
their one block class in kinds by index: Gemma 3 a global-attention layer every sixth, Qwen3-Next and
Granite 4 a full-attention layer every fourth among linear-attention ones, Llama 4 Maverick a mixture
of experts every other layer, DeepSeek-V3 three dense layers before its experts, a vision transformer
a drop-path module in all blocks but the first. Their first blocks stand for none of the others (the
pair extrapolated Llama 4's dense layers over its experts: peak 34-41% low).

A block's kind is what builds it: its modules' classes, its parameters' and buffers' shapes and dtypes,
and the plain values its modules hold (``sliding_window``, ``is_moe_layer``, ``attention_type``). A
value that differs in every block that holds it is an index (``layer_idx``, a drop-path rate growing
with depth; Qwen3-Next's linear-attention layers hold their index where its others do not) and is left
out. Two blocks of one kind may still run differently (a forward that reads the config's
list of layer kinds by position); memfit.planner.search confirms the plan it chooses with a full trace.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from memfit.techniques.checkpointing import find_blocks, repeated

MIN_DEPTH_FOR_SHALLOW = 6
"""Models with fewer repeated blocks are traced at full depth (little to gain)."""


def depth_of(model: torch.nn.Module) -> int | None:
    """The depth shallow traces cut (:attr:`Stacks.full`); None where the model has no repeated blocks."""
    stacks = stacks_of(model)
    return stacks.full if stacks else None


@dataclasses.dataclass(frozen=True)
class Stacks:
    """How shallow traces cut a model's repeated-block containers: at depth ``t`` container ``i`` keeps
    ``offsets[i] + unit[i] * t`` of its blocks, so every figure that grows with the blocks grows on a
    line in ``t``, and at ``full`` it keeps all ``lengths[i]`` (NOTE [ Stacks of two depths ])."""

    lengths: tuple[int, ...]
    unit: tuple[int, ...]
    full: int
    least: int = 2
    """The shallower depth of a pair (1 where the blocks are cut by kind, in units of a few blocks)."""
    kinds: int = 0
    """Where a stack holds blocks of several kinds (:func:`block_kinds`), how many kinds all the
    stacks hold (else 0): the cut keeps each added unit's kinds, or (``full`` 1) the model is traced whole."""

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(n - u * self.full for n, u in zip(self.lengths, self.unit))

    def describe(self) -> str:
        """``28 blocks (stacks of 32 and 28 cut to 4 + t and t)``, ``19 units of 1 + 2 blocks``, ``32 blocks``,
        ``48 blocks of 3 kinds (cut to 4t)``, ``12 blocks of 2 kinds (traced whole)``."""
        cut = " and ".join(" + ".join([str(o)] * bool(o) + [f"{u if u > 1 else ''}t"] * bool(u))
                           for o, u in zip(self.offsets, self.unit))
        if self.kinds:
            return f"{sum(self.lengths)} blocks of {self.kinds} kinds ({'traced whole' if self.full == 1 else 'cut to ' + cut})"
        if any(self.offsets):
            return f"{self.full} blocks (stacks of {' and '.join(map(str, self.lengths))} cut to {cut})"
        return f"{self.full} units of {' + '.join(map(str, self.unit))} blocks" if len(set(self.unit)) > 1 else f"{self.full} blocks"

    @property
    def tail(self) -> tuple[int, ...]:
        """The lengths of the last stacks the cut grows from no offset: a share of their blocks (the last ones)
        swapped is on the pair's line (all of them where no stack has an offset; NOTE [ Stacks of unequal
        blocks ]: FLUX.1's 19 and 38 behind its text encoders)."""
        n = len(self.lengths)
        while n and self.unit[n - 1] and not self.offsets[n - 1]:
            n -= 1
        return self.lengths[n:]

    def at(self, depth: int) -> tuple[int, ...]:
        """Each container's blocks at ``depth``."""
        return tuple(o + u * depth for o, u in zip(self.offsets, self.unit))


def tail_blocks(model: torch.nn.Module) -> int | None:
    """The blocks a swapped share is of: those of :attr:`Stacks.tail` (a denoiser's, behind its text encoders'
    stacks; every block where no stack has an offset); None where the model has no repeated blocks."""
    stacks = stacks_of(model)
    return sum(stacks.tail) if stacks else None


def stacks_of(model: torch.nn.Module) -> Stacks | None:
    """How shallow traces cut ``model`` (:class:`Stacks`; None: no repeated blocks). One stack, or stacks
    whose lengths have a common divisor of at least MIN_DEPTH_FOR_SHALLOW, are cut in units of it; others
    keep a few blocks of the longer stacks in every trace (NOTE [ Stacks of unrelated depths ]). Where
    the blocks that cut adds are not of the kinds of those it stands for, the stacks are cut by kind
    (NOTE [ Blocks of several kinds ])."""
    found = find_blocks(model)
    lengths = tuple(len(children) for _, children in found)
    if not lengths:
        return None
    plain = _by_length(lengths, tuple(_trace_cost(children[0]) for _, children in found))
    kinds = [block_kinds(children) for _, children in found]
    if all(repeats(k, o, u, plain.least, plain.full) for k, o, u in zip(kinds, plain.offsets, plain.unit)):
        return plain
    def holds(i: int, n: int) -> bool:  # (the first n blocks of stack i are still repeated blocks)
        return repeated(found[i][1][:n], isinstance(model.get_submodule(found[i][0]), torch.nn.ModuleList))
    cut = cut_by_kinds(lengths, kinds, holds)
    last_alone = [k[:-1] + k[-2:-1] if len(k) > 2 and k[-1] not in k[:-1] else k for k in kinds]
    if cut is None and all(repeats(k, o, u, plain.least, plain.full) for k, o, u in zip(last_alone, plain.offsets, plain.unit)):
        return plain  # (a last block of its own kind only: NOTE [ Blocks of several kinds ])
    unit, full, least = cut or cut_by_kinds(lengths, last_alone, holds) or ((0,) * len(lengths), 1, 2)
    return Stacks(lengths, unit, full, least, sum(len(set(ks)) for ks in kinds))


def _by_length(lengths: tuple[int, ...], costs: tuple[int, ...] | None = None) -> Stacks:
    """``costs``: each stack's block's trace cost (:func:`_trace_cost`; NOTE [ Stacks of unequal blocks ])."""
    g = math.gcd(*lengths)
    if g >= MIN_DEPTH_FOR_SHALLOW or len(lengths) == 1 or max(lengths) < MIN_DEPTH_FOR_SHALLOW:
        return Stacks(lengths, tuple(n // g for n in lengths), g)
    costs = costs or (1,) * len(lengths)

    def cost_traced(full: int) -> int:  # in the pair at 2 and 3: 2 * offsets + 5 * unit blocks, by their costs
        unit = [n // full for n in lengths]
        return sum(c * (2 * (n - u * full) + 5 * u) for n, u, c in zip(lengths, unit, costs))
    full = min(range(MIN_DEPTH_FOR_SHALLOW, max(lengths) + 1), key=lambda t: (cost_traced(t), -t))
    return Stacks(lengths, tuple(n // full for n in lengths), full)


def _trace_cost(block: torch.nn.Module) -> int:
    """What tracing one block costs, in ops: its leaf modules, three times over where it trains (forward,
    and backward's two), once where it is frozen (a frozen encoder runs forward only, under no_grad)."""
    leaves = sum(1 for m in block.modules() if next(m.children(), None) is None)
    return max(1, leaves) * (3 if any(p.requires_grad for p in block.parameters()) else 1)


# NOTE [ Stacks of unequal blocks ]
# A diffusion model with its text encoders in the step (memfit.workloads.text_encoders) holds four stacks:
# FLUX.1 CLIP-L's 12 layers, T5-XXL's 24, then 19 double-stream and 38 single-stream blocks. Counted as
# equal blocks, the cheapest cut was t = 12: 9 double blocks in the shallower trace of every pair (7 + t),
# each a fifth of the trace, where CLIP-L's layers, frozen and run forward only, cost a tenth of one. Weighed
# by what a block costs to trace (its leaf modules, three times where it trains), the cut is t = 19: CLIP-L
# whole in every trace, T5 at 5 + t, the denoiser's stacks at t and 2t as without encoders. SD3's (12, 32,
# 24 and 24: t = 24, its MMDiT at t rather than 2t) halves the same way. Stacks of like blocks (a
# vision-language model's) cut as before. The stacks kept whole grow by no block between the depths, and a
# copy of the pair's stretches does not move their events (memfit.memory.stretches.blocks_a_copy). A plan
# swapping the denoiser's last blocks keeps its pair where they lie in the stacks the cut grows from no
# offset (:attr:`Stacks.tail`), and the planner's swap grid takes its shares of those blocks.


# NOTE [ Blocks of several kinds ]
# One block class is often built in several kinds by index (block_kinds, below): Gemma 2 and 3
# alternate sliding-window and global attention (one in two, one in six), Qwen3-Next and Granite 4
# put a full-attention layer after three linear-attention ones, Llama 4 Maverick a mixture of experts
# every other layer, DeepSeek-V3 three dense layers before its experts. A pair that adds the first
# blocks' kind stands for none of the others: on tiny models of each (bench/shallow_kinds.py) the
# pair at 2 and 3 blocks was 41% low on Llama 4's peak, 21% low on DeepSeek-V3's, 9% and 11% high on
# Qwen3-Next's and Granite 4's, its step time 5-25% off. So where a cut's added blocks are not each of the kinds of the
# blocks they stand for, the stacks are cut in units of the kinds' period: the depth counts units, an
# offset keeps the blocks ahead of the first whole one (DeepSeek-V3's dense layers, Gemma-3-4B's 34 =
# 4 + 6 * 5), and the pair is at 1 and 2 units (at least two blocks a stack, as find_blocks needs). The
# pair's figures then extrapolate as for blocks of one kind: each of those tiny models' peak, step time
# and allocations at full depth are its full trace's. (One unit may peak in another phase than deeper
# ones: its peak is taken from the allocations replayed at full depth, memfit.planner.traces.) The cut chosen traces the fewest blocks; where
# none traces fewer than the model has (12 layers in periods of 4), the model is traced whole. Plans
# that offload or swap a share of the blocks go to full depth when the units are more than a block (a
# share's blocks mix kinds unevenly between depths); every block swapped keeps its pair, and so does a
# share swapped in whole units at both depths and in the full model (NOTE [ Blocks of several kinds,
# some swapped ] in memfit.planner.shallow: Gemma-2-9B's 14 or 28 of 42). One exception:
# a stack's last block of its own kind (SD3's, which outputs no text stream) is extrapolated from the
# block before it, as the plain cut did (other kinds still cut as above): no prefix holds it, and every
# plan traced whole would cost 2.5-3.6x the pair's time. It stays off (dit-sd3 at 512 px: the pair's
# peak 0.6% and 1.6% high, its time 0.4%, in bf16 and as a LoRA with blocks checkpointed); a full trace
# confirms the plan chosen.


# NOTE [ Stacks of two depths ]
# FLUX.1 runs 19 double-stream blocks, then 38 single-stream ones. Cut to the same number of blocks a
# stack, the shallow models would hold another share of the two kinds than the full model, and the
# line through two of them would not reach it. So the depth is counted in units of the stacks' common
# divisor: at depth d each stack keeps ``d * its length / g`` blocks (g = gcd of the lengths: FLUX.1 at 2
# and 3 is 2 + 4 and 3 + 6 blocks; full depth, 19, is the model). Everything that grows with the blocks
# grows on the line in d, as with one stack. The deeper trace has blocks inserted at two places, not
# one; extrapolate_ops may still line the runs up with one stretch (a double block and two single ones
# side by side, where the stacks meet: the same ops, in another order), else the step time is the line
# through the pair's times, as for two kinds of block. On FLUX.1-dev either gave the full trace's time
# (none, 19, 38 or all 57 blocks swapped). Before, such a model was traced at full depth for every
# plan (FLUX.1-dev's LoRA planned for a 12 GB card in 600 s). The pair's allocations at full depth
# (memfit.memory.deep_stream) count each stack's blocks in a unit, and are the full trace's to the byte.


# NOTE [ Stacks of unrelated depths ]
# A vision-language model runs a vision tower, then a language model: Qwen2.5-VL-7B 32 vision blocks and
# 28 text ones, Gemma-3-4B 27 and 34. Their common divisor (4, 1) leaves no pair of shallow depths in
# units of it, and every plan was traced at full depth (Qwen2.5-VL's plan: 959 s). So the depth is
# counted in blocks of the shorter stack, and each longer one keeps its extra blocks in every trace:
# at depth t, 4 + t vision blocks and t text ones (Gemma 3: t and 7 + t; a stack shorter than the
# depth chosen is kept whole). Each container's blocks are still on a line in t, and at t = 28 the
# model is whole, so the pair's figures extrapolate as for one stack; the depth chosen is the one whose
# pair traces the fewest blocks. Two things stay out: the pairs that keep the full model's share of
# offloaded or swapped blocks (a count of all the stacks' blocks, whose share is not on such a line):
# those plans are traced at full depth (memfit.planner.traces), and the extra stretch where the two
# stacks meet, which is not one stretch of ops: the step time is the line through the pair's times.


# -- kinds of block ----------------------------------------------------------------------------------
_PLAIN = (bool, int, float, str, type(None))


def block_kinds(blocks: list[torch.nn.Module]) -> tuple[int, ...]:
    """Each block's kind, numbered in order of first appearance (``(0, 0, 0, 0, 0, 1, 0, ...)``: Gemma 3)."""
    signatures = [_signature(b) for b in blocks]
    values: dict[tuple, list] = {}
    for sig in signatures:
        for key, value in sig[1].items():
            values.setdefault(key, []).append(value)
    index_like = {k for k, v in values.items() if len(blocks) >= 3 and len(v) >= 2 and len(set(map(repr, v))) == len(v)}
    ids: dict[tuple, int] = {}
    return tuple(ids.setdefault((sig[0], tuple((k, repr(v)) for k, v in sig[1].items() if k not in index_like)), len(ids))
                 for sig in signatures)


def _signature(block: torch.nn.Module) -> tuple[tuple, dict]:
    """(what builds the block: modules, parameters, buffers; its modules' plain values by name)."""
    structure, plain = [], {}
    for name, m in block.named_modules():
        structure.append((name, type(m).__qualname__))
        for kind, tensors in (("p", m.named_parameters(recurse=False)), ("b", m.named_buffers(recurse=False))):
            structure += [(name, kind, n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors]
        for key, value in vars(m).items():
            if key.startswith("_") or key == "training":
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                plain[(name, key)] = value
    return tuple(structure), plain


def cut_by_kinds(lengths: tuple[int, ...], kinds: list[tuple[int, ...]],
                 holds=lambda i, n: n >= 2) -> tuple[tuple[int, ...], int, int] | None:
    """``(unit, full, least)`` of the cheapest cut of stacks of ``lengths`` blocks whose added blocks are
    the blocks they stand for: at depth ``t`` stack ``i`` keeps its first ``o_i + unit_i * t`` blocks
    (``o_i = lengths_i - unit_i * full``), and from the pair's shallower depth ``least`` on, every unit
    added holds the kinds of the one before it. ``holds(i, n)``: the first ``n`` blocks of stack ``i`` are
    still a stack (two blocks; of a list of several classes, two of each). None: no cut traces fewer blocks
    than the model has."""
    best = None
    for full in range(3, max(lengths) + 1):
        unit = tuple(n // full for n in lengths)
        offsets = tuple(n - u * full for n, u in zip(lengths, unit))
        least = 1 if all(holds(i, o + u) for i, (o, u) in enumerate(zip(offsets, unit))) else 2
        if least == 2 and not all(holds(i, o + 2 * u) for i, (o, u) in enumerate(zip(offsets, unit))):
            continue
        if full < least + 2 or not all(repeats(k, o, u, least, full) for k, o, u in zip(kinds, offsets, unit)):
            continue
        traced = sum(2 * o + (2 * least + 1) * u for o, u in zip(offsets, unit))  # (the pair at least, least + 1)
        if traced < sum(lengths) and (best is None or traced <= best[0]):
            best = (traced, unit, full, least)
    return best and best[1:]


def repeats(kinds: tuple[int, ...], offset: int, unit: int, least: int, full: int) -> bool:
    """Every unit added from depth ``least`` to ``full`` holds the same kinds in the same order."""
    if unit == 0:
        return True
    window = kinds[offset + unit * least: offset + unit * (least + 1)]
    return all(kinds[offset + unit * t: offset + unit * (t + 1)] == window for t in range(least, full))
