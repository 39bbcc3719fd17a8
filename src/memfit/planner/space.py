"""The search space: every valid combination of techniques for a workload, device and batch.

Each technique says which values of its plan key the planner tries (``Technique.search``), given
the model's structure (built on the meta device), the device and the planner's options: e.g.
checkpointing only where the model has repeated blocks, offload on GPU presets only (on the CPU
the host *is* the device), loss chunks for Hugging Face causal LMs, compile modes when asked (``compile_modes``). Micro-batch size x
accumulation keeps the global batch fixed. Invalid combinations are dropped by the Plan's own
validation.

Pruning uses each technique's memory order (``Config.saves_at_most``): a plan that saves no more
memory than one that already did not fit, in every technique, cannot fit either.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from memfit.devices import Device
from memfit.errors import UserError
from memfit.planner.stacks import stacks_of
from memfit.plans import TECHNIQUES, Plan
from memfit.techniques.base import SearchContext
from memfit.workload import Workload, call_workload


@dataclass(frozen=True)
class ModelFacts:
    model: torch.nn.Module
    """The workload's model on the meta device: its structure, no memory."""
    n_params: int


@dataclass
class SearchSpace:
    values: dict[str, list] = field(default_factory=dict)
    """Plan key -> the values tried."""
    micro_batches: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Values left out because they cannot run here, and why."""
    narrowed: list[str] = field(default_factory=list)
    """Keys a heuristic narrowed (memfit.techniques.base.SearchContext.narrowed)."""

    def size(self) -> int:
        n = len(self.micro_batches)
        for v in self.values.values():
            n *= len(v)
        return n


def model_facts(workload: Workload) -> ModelFacts:
    """Look at the model's structure on the meta device (no memory, no fake tensors needed)."""
    with torch.device("meta"):
        model = call_workload("model()", workload.model)
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"workload model() must return an nn.Module, got {type(model).__name__}")
    return ModelFacts(model=model, n_params=sum(p.numel() for p in model.parameters()))


# NOTE [ What the repeated blocks take in ]
# Whether swapping blocks can matter depends on what is left of the budget beside the weights, and
# block checkpointing leaves there what enters each block, a tensor of the batch's tokens by the
# block's width: small for a language model's 2,048 tokens (0.8 GiB over Qwen2.5-7B's 28 blocks at 2 x
# 2048), not for a video model's (Wan 14B's 81 frames at 480 px: 18,900 tokens by 5120, 7.2 GiB over its
# 40 blocks). The step is run once on the meta device (no memory, no compute; a model that asks a meta
# tensor for a value, as a causal LM's loss does, tells nothing: None), a hook on each repeated block
# counting the first floating-point tensor it takes, at 2 bytes an element (a checkpointed block
# input in 16 bits).
def block_input_bytes(workload: Workload, model: torch.nn.Module, batch_size: int) -> int | None:
    """Bytes of what enters the repeated blocks of one step at ``batch_size``, summed over the blocks
    (NOTE [ What the repeated blocks take in ]); None where the meta step cannot tell."""
    from memfit.techniques.checkpointing import find_blocks

    counted: list[int] = []

    def count(module, args, kwargs):
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        counted.append(0 if x is None else x.numel())

    hooks = [b.register_forward_pre_hook(count, with_kwargs=True) for _, blocks in find_blocks(model) for b in blocks]
    try:
        with torch.device("meta"), torch.no_grad():
            workload.loss(model, workload.batch(batch_size))
    except Exception:  # (a value asked of a meta tensor, a data-dependent shape: unknown)
        return None
    finally:
        for h in hooks:
            h.remove()
    return 2 * sum(counted) if counted else None


def default_space(facts: ModelFacts, device: Device, batch_size: int,
                  optimizers: tuple[str, ...] | None = None,
                  compile_modes: tuple[str, ...] | None = None, *, budget_bytes: int | None = None,
                  base_weights: str | None = None, run_steps: int | None = None,
                  coupled_samples: str | None = None, block_inputs=None, swap_everywhere: bool = False,
                  search_values: dict | None = None) -> SearchSpace:
    """``compile_modes``: the compile modes to try; None: the device's default (memfit.techniques.compile).
    ``budget_bytes`` and ``base_weights`` (the plan's, as the user gave it): what a technique whose
    values matter only when the weights fill the budget looks at (``swap_blocks``); None: unknown.
    ``run_steps``: the run's length, if given (compile is searched by default on GPU presets for a run
    long enough to pay for its compiles: memfit.techniques.compile). ``coupled_samples``: why the
    workload's samples depend on each other (memfit.workload.WorkloadInfo): no micro-batch is searched.
    ``block_inputs``: a call giving :func:`block_input_bytes` at the batch (asked only where it decides).
    ``swap_everywhere``: ``swap_blocks`` searched whatever the weights' share of the budget. ``search_values``: a
    trainer's values in place of a technique's own, by plan key (where the technique searches that key at all)."""
    ctx = SearchContext(model=facts.model, device=device, batch_size=batch_size,
                        options={"optimizers": optimizers, "compile_modes": compile_modes,
                                 "budget_bytes": budget_bytes, "base_weights": base_weights,
                                 "run_steps": run_steps, "block_inputs": block_inputs,
                                 "swap_everywhere": swap_everywhere,
                                 "swap_tail": stacks.tail if (stacks := stacks_of(facts.model)) else None})
    values = {t.keys[0].name: list(t.search(ctx)) for t in TECHNIQUES if t.search is not None}
    values.update({k: list(v) for k, v in (search_values or {}).items() if len(values.get(k, ())) > 1})
    micro = [m for m in (batch_size, batch_size // 2, batch_size // 4, batch_size // 8)
             if m >= 1 and batch_size % m == 0 and (m == batch_size or not coupled_samples)]
    if coupled_samples:
        ctx.notes.append(f"micro-batches not searched: {coupled_samples}, so a micro-batch trains on another objective")
    return SearchSpace(values=values, micro_batches=sorted(set(micro), reverse=True), notes=list(ctx.notes),
                       narrowed=list(ctx.narrowed))


def drop_unused(space: SearchSpace, plans: list[Plan]) -> None:
    """Leave out the values no plan takes (``budget:F`` when no compile mode is searched), so the
    time model does not time them."""
    for name, values in space.values.items():
        taken = {getattr(p, name) for p in plans}
        values[:] = [v for v in values if v in taken]


# NOTE [ Optimizer choices that cannot matter ]
# With an adapter few parameters train: their gradients and AdamW's states are at most
# ``STATE_BYTES_AT_MOST`` bytes each. Low-bit states, the step in backward and state offload can then
# save no more than that, and change numerics or add work for it. Where that bound is under
# ``SMALL_STATES`` of the budget and the user named none of them, the optimizer is the workload's own,
# stepped after backward, its states on the device; the search notes it. When no plan fits that way,
# memfit.planner.search plans again with them, on the same traces, so no answer is lost. Measured (and
# why the bound is not larger): docs/planner-notes.md.
SMALL_STATES = 0.01
STATE_BYTES_AT_MOST = 16
"""Per trained parameter: an fp32 gradient (4), AdamW's two fp32 moments (8), and 4 to spare."""


def leave_out_optimizer_choices(space: SearchSpace, trainable: int, budget_bytes: int, keep: set[str]) -> bool:
    """Fix the optimizer's plan keys to the workload's own where they cannot matter (NOTE [ Optimizer
    choices that cannot matter ]); ``keep``: the keys the user set. Returns whether any was fixed."""
    from memfit.units import fmt_bytes
    most = trainable * STATE_BYTES_AT_MOST
    if most > SMALL_STATES * budget_bytes:
        return False
    left_out = []
    for name in ("optimizer", "optimizer_in_backward"):
        values = space.values.get(name, [])
        if name not in keep and len(values) > 1:
            space.values[name] = [getattr(Plan(), name)]
            left_out.append(name)
    values = space.values.get("offload", [])
    kept = [v for v in values if not any(str(item).startswith("optimizer_states") for item in v)]
    if "offload" not in keep and kept and len(kept) < len(values):
        space.values["offload"] = kept
        left_out.append("offload: [optimizer_states]")
    if left_out:
        space.notes.append(f"{', '.join(left_out)} not searched: the {trainable:,} trained parameters' gradients and "
                           f"optimizer states need at most {fmt_bytes(most)}, {most / budget_bytes:.1%} of the budget "
                           "(the workload's own optimizer, stepped after backward)")
    return bool(left_out)


# NOTE [ States that cannot fit ]
# A torchao low-bit AdamW keeps its states on the device in every plan the search tries (its host
# update is left out: NOTE [ Low-bit states on the host ]; its device-step offload and FSDP2 are
# refused). So where the weights at 16 bits, its states at their least (``state_bytes_at_least``
# per trained parameter) and the largest trained parameter's gradient at 16 bits (made in backward
# while all of them are there, whenever the update runs) exceed the budget, no plan with it can fit,
# and timing it would only cost its compiles (tens of seconds on a cold cache: 34 s of CPU for
# Qwen2.5-7B, whose weights and 4-bit states alone are 868 KB under a 24 GB card's budget and whose
# embedding's gradient is 1.09 GB). Such a variant is left out, with a note. Measured: docs/planner-notes.md.
def leave_out_states_that_cannot_fit(space: SearchSpace, facts: ModelFacts, budget_bytes: int,
                                     device: Device) -> None:
    """NOTE [ States that cannot fit ] (one rank: unsharded states)."""
    from memfit.units import fmt_bytes
    values = space.values.get("optimizer", [])
    sizes = [p.numel() for p in facts.model.parameters() if p.requires_grad]
    trained, gradient = sum(sizes), 2 * max(sizes, default=0)
    weights = facts.n_params * (2 if device.bf16 or device.fp16 else 4)
    for name in list(values):
        variant = Plan(optimizer=name).config("optimizer")
        least = variant.state_bytes_at_least
        if len(values) > 1 and least and variant.slow_host_update and weights + trained * least + gradient > budget_bytes:
            values.remove(name)
            space.notes.append(f"{name} left out: the weights in 16 bits ({fmt_bytes(weights)}), its states on the "
                               f"device ({fmt_bytes(int(trained * least))} at least) and the largest gradient "
                               f"({fmt_bytes(gradient)}) exceed the budget")


def weight_bytes(model: torch.nn.Module, precision: str) -> int:
    """The bytes of ``model``'s parameters (meta) held at ``precision``: floating-point ones in 16 bits
    where its weights are 16-bit, else as the model builds them (autocast keeps them)."""
    half = Plan(precision=precision).config("precision").weights != "fp32"
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * (2 if half and p.is_floating_point() else p.element_size())
    return total


# NOTE [ Weights that cannot fit ]
# On one rank every plan the search tries holds the whole model's weights on the device: no technique
# in the space offloads or shards parameters. A precision whose weights alone exceed the budget can
# then fit in no plan, and left in it would be the default plan every other value's saving is
# measured against, where its own peak hides what the others save, and the estimates of the plans
# that matter err by gigabytes. Such a precision is left out with a note, as with every base weight
# kept as-is (an adapter's base is the model's weights at the plan's precision); quantized base
# weights are not counted here. Measured: docs/planner-notes.md.
def leave_out_weights_that_cannot_fit(space: SearchSpace, facts: ModelFacts, budget_bytes: int) -> None:
    """NOTE [ Weights that cannot fit ] (one rank, base weights as the model holds them)."""
    from memfit.units import fmt_bytes
    values = space.values.get("precision", [])
    sizes = {v: weight_bytes(facts.model, v) for v in values}
    fitting = [v for v in values if sizes[v] <= budget_bytes]
    if not fitting or len(fitting) == len(values):  # (none fits: the search says so, with the smallest plan)
        return
    for v in [v for v in values if v not in fitting]:
        values.remove(v)
        space.notes.append(f"precision {v} left out: its weights alone ({fmt_bytes(sizes[v])}) exceed the budget")


# NOTE [ Low-bit states on the host ]
# With ``offload: [optimizer_states]`` the states live in host memory and the update runs on the
# host CPU: a low-bit variant's smaller states then save host memory only, not device memory, and
# its update is a compiled, compute-bound CPU kernel (``OptimizerVariant.slow_host_update``), far
# slower than torch's fused host AdamW. The op-level time model sees neither (a predicted compiled
# region runs no kernel op), so the search leaves the combination out: the same plan with the
# workload's own AdamW on the host needs no more device memory. Low-bit states on the device are
# still searched, and a plan (or plan flags) that names the combination runs it. Measured:
# docs/planner-notes.md.
def candidates(space: SearchSpace, batch_size: int) -> list[Plan]:
    names = list(space.values)
    out, slow_on_host = [], []
    for combo in itertools.product(*(space.values[n] for n in names), space.micro_batches):
        fields = dict(zip(names, combo[:-1]))
        micro = combo[-1]
        if micro != batch_size:
            fields["micro_batch_size"] = micro
        try:
            plan = Plan(**fields)
        except UserError:
            continue  # an invalid combination, refused by the Plan itself
        optimizer = plan.config("optimizer")
        if optimizer.slow_host_update and plan.config("offload").states == "optimizer_states":
            slow_on_host.append(plan)
            continue  # NOTE [ Low-bit states on the host ]
        out.append(plan)
    if slow_on_host and not out:  # the user's flags fixed that combination: it is theirs
        return slow_on_host
    if slow_on_host:
        space.notes.append(f"{', '.join(sorted({p.optimizer for p in slow_on_host}))} with offload: [optimizer_states] left out: on the "
                           "host their states save no device memory and their update is a slow compiled CPU "
                           "kernel (the same plans with the workload's own AdamW are searched)")
    return out


def saves_no_more_than(a: Plan, b: Plan, batch_size: int, states_aside: bool = False) -> bool:
    """True if plan ``a`` saves no more memory than ``b`` in every technique (so if ``b`` does not
    fit, neither does ``a``). Values of equal rank but different kind are not comparable, nor are
    values whose order does not hold in their plan (``Config.ordered_in``). ``states_aside``: compare
    them but for what they do to the trained parameters' gradients and optimizer states
    (``Config.states_aside``: NOTE [ Failures too big for any optimizer choice ] in memfit.planner.failures)."""
    xs, ys = (_aside(a), _aside(b)) if states_aside else (a.techniques, b.techniques)
    return all(x.saves_at_most(y, batch_size) if x.ordered_in(a) and y.ordered_in(b) else x == y
               for x, y in zip(xs, ys))


@functools.lru_cache(maxsize=65536)
def _aside(plan: Plan) -> tuple:
    """``plan``'s techniques with what they do to the trained parameters' gradients and optimizer states
    left out (``Config.states_aside``): the plans equal under it differ in their optimizer keys only."""
    return tuple(x.states_aside() for x in plan.techniques)
