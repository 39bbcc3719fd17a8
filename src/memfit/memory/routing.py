"""Mixture-of-experts routing on fake tensors: how many tokens each expert gets.

NOTE [ Routing on fake tensors ]
A mixture-of-experts layer sends each of its T tokens to k of its E experts, and which ones
depends on the router's values: a fake tensor has none. How the experts run decides whether that
matters to memory:

- ``grouped_mm`` (transformers' default) and ``batched_mm`` give every expert's tokens to one
  kernel call over all T*k (token, expert) pairs: every tensor has T*k rows whatever the routing,
  so the trace holds for any routing (NOTE [ Grouped GEMM on fake tensors ]; on a CPU, a bf16
  grouped GEMM's per-expert packing scratch, a few KiB to MiB, grows with the largest group: it is
  probed at the balanced split).
- the per-expert loop (``experts_implementation="eager"``, transformers' ``@use_experts_implementation``
  classes' own forward) asks which experts were hit (``nonzero`` over the E (+1) slots of a
  one-hot routing mask) and, for each, which (slot, token) pairs it got (``torch.where`` over its
  [k, T] mask): output sizes a fake tensor cannot know. The tensors kept for backward sum to T*k
  rows over the experts whatever the routing; the largest expert's transients are what routing
  moves.

While a fake trace runs, :class:`RoutingMode` answers those ``nonzero`` calls, inside a module
with an integer ``num_experts`` called as ``experts(hidden_states [T, H], top_k_index [T, k],
...)``, by a routing assumption:

- ``balanced`` (the prediction): min(E, T*k) experts hit, the T*k pairs split evenly among them
  (the first T*k mod E get one more): what a trained router's load-balancing aims at;
- ``worst`` (the bound): every expert the pairs can reach is hit, and the first one the loop runs
  gets every token (T pairs, the most one expert can get: a token picks k distinct experts); the
  other pairs spread over the rest. What routing moves is then at its largest: the per-expert
  costs of the loop (each hit expert's backward builds a gradient the size of all experts'
  weights, ``select_backward``, summed into the one gradient) and the largest expert's
  activations, which backward (running the loop in reverse) reaches last, when the most of those
  gradients are held. Measured on this CPU (tests/unit/test_moe_routing.py): a real run routed
  this way peaks at the bound exactly, random routings between the balanced prediction and it.
  A router with a capacity (``expert_capacity`` on the module or its config: tokens over it are
  dropped) caps each expert at that capacity.

- a router that reads its experts' token counts (JetMoE's gating, a module with integer ``num_experts``
  and ``top_k`` called with hidden states [T, H], reads ``expert_size.tolist()`` and splits the
  tokens by it) gets each expert's count under the routing (:meth:`_Layer.counts`: the split
  ``ForcedRouting`` makes). Its reads were each assumed 0, a split the sizes refused, and the trace
  failed. On a tiny JetMoE (tests/unit/test_moe_routing.py) real runs routed both ways measure the
  prediction to the byte; there ``worst`` is no bound (its peak 0.2% under balanced's with blocks
  checkpointed, the model's own routing 0.007% over balanced's): routing moves little when the
  experts run as one split and concatenation.

- a DeepSeek-style gate (a module with integer ``n_routed_experts`` and ``top_k``, as HiDream-I1's ``MoEGate``,
  copied from DeepSeek-V3's reference code): its ``topk`` over the [T, E] scores gets a real twin of its
  indices, routed as ``ForcedRouting`` routes (NOTE [ Real values of small integer tensors ] in
  memfit.real_values). Whatever the experts then do with them is answered from the twin: HiDream's training
  loop indexes by ``flat_topk_idx == i`` (a boolean mask, in forward and again in backward), its inference
  path (``force_inference_output``, what diffusers' LoRA script loads) sorts, counts with ``bincount`` and
  reads the counts on the host with ``.numpy()``. A real run routed so measures the prediction.

The loop's scalar reads of a hit expert's index are answered 0 (every expert has the same
shapes) and its check for the padding slot False (never hit under either routing). Each routed
call is listed as an approximation, and ``estimate`` traces the step a second time under
``worst`` when the first trace needed an answer, to report the bound beside the prediction.
Any other data-dependent ``nonzero`` still fails the trace, naming the op. The mode is on the
dispatch stack only while an experts module runs (global forward hooks push and pop it), so the
rest of a trace pays nothing for it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from memfit import rng_ops
from memfit.device_queries import PRIM_DEVICE, FakeTensor

aten = torch.ops.aten

BALANCED = "balanced"
WORST = "worst"


@dataclass
class _Layer:
    """The routing of one experts call: T tokens, k experts each, E experts, capacity per expert."""

    tokens: int
    top_k: int
    experts: int
    capacity: int | None
    hit: int = 0
    seen: int = 0
    gate: bool = False
    """A router that reads its experts' token counts (JetMoE's ``expert_size.tolist()``), not an experts loop."""
    twinned: bool = False
    """A DeepSeek-style gate whose ``topk`` indices get a twin (the module's NOTE)."""
    answered: list[int] = field(default_factory=list)
    """A router's counts, as answered to its reads."""

    def counts(self, routing: str) -> list[int]:
        """Each expert's (slot, token) pairs, in expert order, as :class:`ForcedRouting` routes them."""
        self.hit = self.hit_count(routing)
        return [self.pairs_of(routing, e) if e < self.hit else 0 for e in range(self.experts)]

    def hit_count(self, routing: str) -> int:
        pairs = self.tokens * self.top_k
        if routing == WORST:  # the last expert takes every token; the other pairs hit one expert each at most
            return min(self.experts, pairs - self.tokens + 1)
        return min(self.experts, pairs)

    def pairs_of(self, routing: str, index: int) -> int:
        """The (slot, token) pairs of the ``index``-th hit expert, in the order the loop runs them."""
        pairs, hit = self.tokens * self.top_k, max(self.hit, 1)
        if routing == WORST:
            big = self.tokens
            if index == 0:
                n = big
            else:
                base, extra = divmod(pairs - big, hit - 1)
                n = base + (1 if index - 1 < extra else 0)
        else:
            base, extra = divmod(pairs, hit)
            n = base + (1 if index < extra else 0)
        return min(n, self.capacity) if self.capacity else n


@dataclass
class ExpertsLayer:
    """An experts module the trace called: its class, E, k, T and its experts' parameter count."""

    name: str
    experts: int
    top_k: int
    tokens: int
    expert_params: int | None
    """Parameters of its experts (None: a router, whose experts are other modules)."""
    implementation: str | None


@dataclass
class RoutingAnswers:
    """What the routing mode saw and answered in one trace (shown in the report)."""

    routing: str
    calls: int = 0
    """Data-dependent routing answers (0: the routing did not change any tensor's size)."""
    layers: dict[int, ExpertsLayer] = field(default_factory=dict)
    """id(module) -> the experts module, for each one called."""


class RoutingMode(TorchDispatchMode):
    """Answers the data-dependent ``nonzero`` of experts loops: see NOTE [ Routing on fake tensors ]."""

    def __init__(self, routing: str = BALANCED, tracker=None):
        super().__init__()
        assert routing in (BALANCED, WORST), routing
        self.routing = routing
        self.tracker = tracker
        self.answers = RoutingAnswers(routing)
        self._layers: list[tuple[torch.nn.Module, _Layer]] = []
        self._handles: list = []

    # -- which experts call is running -------------------------------------------------------------
    def _enter(self, module, args) -> None:
        layer = _routing_of(module, args)
        if layer is not None:
            if not self._layers:
                super().__enter__()  # the mode is on the stack during experts calls only
            self._layers.append((module, layer))
            if id(module) not in self.answers.layers and layer.twinned:  # (a gate: its experts are other modules)
                self._seen(module, layer, None)
            elif id(module) not in self.answers.layers and not layer.gate:  # (a router: once it reads its counts)
                shapes = stored_shapes(module)
                self._seen(module, layer, sum(_numel(p, shapes) for p in module.parameters()
                                              if p.dim() and _shape(p, shapes)[0] == layer.experts))

    def _seen(self, module, layer: _Layer, expert_params: int | None) -> None:
        self.answers.layers[id(module)] = ExpertsLayer(
            type(module).__name__, layer.experts, layer.top_k, layer.tokens, expert_params,
            getattr(getattr(module, "config", None), "_experts_implementation", None))

    def _leave(self, module, args, out) -> None:
        if self._layers and self._layers[-1][0] is module:
            self._layers.pop()
            if not self._layers:
                super().__exit__(None, None, None)

    @contextlib.contextmanager
    def watching(self):
        """Watch module calls for the duration; the dispatch mode itself is pushed only while an
        experts module runs (every other op of the trace pays nothing for it)."""
        self._handles = [register_module_forward_pre_hook(self._enter),  # (always: also when checkpoint stops
                         register_module_forward_hook(self._leave, always_call=True)]  # a recomputation early)
        try:
            yield self
        finally:
            for h in self._handles:
                h.remove()
            if self._layers:
                self._layers.clear()
                super().__exit__(None, None, None)

    # -- answers --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE and type(args[0]) is FakeTensor:  # (NOTE [ Device queries ] in memfit.device_queries)
            return args[0].device
        kwargs = kwargs or {}
        if self._layers and self._layers[-1][1].twinned:
            out = func(*args, **kwargs)
            if func is aten.topk.default and args[0].dim() == 2 and args[0].shape[-1] == self._layers[-1][1].experts:
                self._twin(out[1])
            return out
        if self._layers and args and _is_fake(args[0]):
            if func is aten.nonzero.default:
                rows = self._rows(args[0])
                if rows is not None:
                    return torch.empty((rows, args[0].dim()), dtype=torch.long, device=args[0].device)
            elif func in _SCALAR_READS and args[0].constant is None and self._layers[-1][1].gate:
                if args[0].dim() == 0 and not args[0].is_floating_point() and args[0].dtype != torch.bool:
                    return self._count(args[0])
            elif func in _SCALAR_READS and args[0].constant is None:  # (fake mode knows constants)
                # the loop's reads of an expert's index (every expert has the same shapes) and of
                # ``expert_idx == num_experts`` (the padding slot: never hit under either routing)
                return False if args[0].dtype == torch.bool else 0
        return func(*args, **kwargs)

    def _rows(self, mask: torch.Tensor) -> int | None:
        module, layer = self._layers[-1]
        if mask.dim() == 1 and mask.numel() in (layer.experts, layer.experts + 1):  # the experts hit
            layer.hit, layer.seen = layer.hit_count(self.routing), 0
            self._note(module, f"{layer.hit} of {layer.experts} experts hit")
            return layer.hit
        if mask.numel() == layer.tokens * layer.top_k and mask.dim() == 2:  # one expert's (slot, token) pairs
            rows = layer.pairs_of(self.routing, layer.seen)
            layer.seen += 1
            return rows
        return None

    def _count(self, element: torch.Tensor) -> int:
        """One expert's token count, read from a router's [E] counts (``tolist`` reads element i at offset i)."""
        module, layer = self._layers[-1]
        if layer.seen == 0:
            layer.answered = layer.counts(self.routing)
            if id(module) not in self.answers.layers:
                self._seen(module, layer, None)
            self._note(module, f"{sum(c > 0 for c in layer.answered)} of {layer.experts} experts' token counts")
        layer.seen += 1
        i = element.storage_offset()
        return layer.answered[i] if 0 <= i < layer.experts else 0

    def _twin(self, index: torch.Tensor) -> None:
        """A gate's chosen experts ``[T, k]``, routed by assumption: a twin the trace reads (the module's NOTE)."""
        module, layer = self._layers[-1]
        if self.tracker is None or not _is_fake(index):
            return
        tokens, k = index.shape
        with _disable_current_modes():  # (real values, made outside the trace's modes)
            real = routed_indices(self.routing, tokens, k, layer.experts, index.dtype)
        self.tracker.give_values(index, real)
        layer.hit = layer.hit_count(self.routing)
        self._note(module, f"{layer.hit} of {layer.experts} experts hit, the top-{k} of {tokens} tokens' scores")

    def _note(self, module, what: str) -> None:
        self.answers.calls += 1
        name = type(module).__name__
        if self.tracker is not None:
            self.tracker.approximate(f"data-dependent routing of a mixture-of-experts loop assumed {self.routing} "
                                     f"({what}; NOTE [ Routing on fake tensors ])", name)


_SCALAR_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default}


def _routing_of(module, args) -> _Layer | None:
    if isinstance(getattr(module, "base_layer", None), torch.nn.Module):  # a PEFT wrapper: its base layer is seen
        return None
    routed, top_k = getattr(module, "n_routed_experts", None), getattr(module, "top_k", None)
    if _whole(routed) and _whole(top_k) and 0 < top_k <= routed and args and isinstance(args[0], torch.Tensor) \
            and args[0].dim() >= 2:  # a DeepSeek-style gate (HiDream's MoEGate): its topk gets a twin
        return _Layer(tokens=args[0].numel() // max(args[0].shape[-1], 1), top_k=top_k, experts=routed, capacity=None,
                      twinned=True)
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int) or isinstance(experts, bool) or not args:
        return None
    if len(args) == 1 and isinstance(top_k, int) and not isinstance(top_k, bool) and 0 < top_k <= experts \
            and isinstance(args[0], torch.Tensor) and args[0].dim() == 2:  # a router over T tokens (JetMoE's gating)
        return _Layer(tokens=int(args[0].shape[0]), top_k=top_k, experts=experts, capacity=None, gate=True)
    if len(args) < 2:
        return None
    hidden, index = args[0], args[1]
    if not (isinstance(hidden, torch.Tensor) and isinstance(index, torch.Tensor) and index.dim() == 2
            and not index.is_floating_point() and hidden.dim() == 2 and hidden.shape[0] == index.shape[0]):
        return None
    capacity = getattr(module, "expert_capacity", None) or getattr(getattr(module, "config", None),
                                                                   "expert_capacity", None)
    return _Layer(tokens=int(index.shape[0]), top_k=int(index.shape[1]), experts=experts,
                  capacity=capacity if isinstance(capacity, int) and capacity > 0 else None)


def _whole(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)


def routed_indices(routing: str, tokens: int, k: int, experts: int, dtype=torch.long, device=None) -> torch.Tensor:
    """The experts ``[tokens, k]`` a router picks under ``routing``: ``balanced``, pair i of the T*k to expert
    i mod E; ``worst``, every token's first pick expert 0, its other k-1 picks spread over experts 1..E-1."""
    if routing == BALANCED:
        out = torch.arange(tokens * k, device=device).view(tokens, k) % experts
    else:
        rest = 1 + torch.arange(tokens * (k - 1), device=device).view(tokens, k - 1) % max(experts - 1, 1)
        out = torch.cat([torch.zeros(tokens, 1, dtype=torch.long, device=device), rest], 1)
    return out.to(dtype)


def _numel(p: torch.Tensor, shapes: dict | None = None) -> int:
    """Elements of a parameter (a 4-bit one's before packing; ``shapes``: :func:`stored_shapes`)."""
    return int(_shape(p, shapes).numel())


def _shape(p: torch.Tensor, shapes: dict | None = None) -> torch.Size:
    """A parameter's shape as the model reads it: a 4-bit layer's or parametrization's before packing."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None) or (shapes or {}).get(id(p))
    return torch.Size(shape) if shape is not None else p.shape


def stored_shapes(module: torch.nn.Module) -> dict[int, torch.Size]:
    """``id`` of each weight stored as bitsandbytes' 4-bit codes under a parametrization (experts' weights: NOTE
    [ Experts quantized as parametrizations ] in memfit.techniques.base_weights) -> the shape the module reads."""
    out = {}
    for m in module.modules():
        for stack in getattr(m, "parametrizations", {}).values():
            state = next((x.quant_state for x in stack if getattr(x, "quant_state", None) is not None), None)
            if state is not None:
                out[id(stack.original)] = torch.Size(state.shape)
    return out


def _is_adapters(name: str) -> bool:
    """A PEFT adapter's parameter (``lora_A``, ``lora_B``, ``lora_magnitude_vector``, ...): not the model's, so
    not in the total a model card gives."""
    return any(part.startswith("lora_") for part in name.split("."))


def experts_facts(answers: RoutingAnswers | None, model, worst_peak: int | None, peak: int) -> list[str]:
    """Lines for the report of a trace that called experts modules: total and active parameters,
    and what routing does to the peak (``worst_peak``: the peak of the trace under ``worst``)."""
    from memfit.units import fmt_bytes
    if answers is None or not answers.layers:
        return []
    layers = list(answers.layers.values())
    shapes = stored_shapes(model)
    routed = model.denoiser if hasattr(model, "text_encoders") else model  # (a denoiser's own, not its text encoders')
    total = sum(_numel(p, shapes) for name, p in routed.named_parameters() if not _is_adapters(name))
    first = layers[0]
    shape = (f"top-{first.top_k} of {first.experts} experts" if all((x.experts, x.top_k) == (first.experts, first.top_k)
                                                                   for x in layers) else "top-k experts")
    if any(x.expert_params is None for x in layers):  # (routers seen, not their experts: no active count)
        facts = [f"mixture of experts: {_count(total)} parameters ({shape} in {len(layers)} routed layers)"]
    else:
        idle = sum(x.expert_params * (x.experts - x.top_k) / x.experts for x in layers)
        facts = [f"mixture of experts: {_count(total)} parameters, {_count(total - idle)} active per token "
                 f"({shape} in {len(layers)} layers)"]
    facts += _experts_left_unquantized(model)
    pairs = first.tokens * first.top_k
    if answers.calls == 0 or worst_peak is None:
        how = first.implementation or "one kernel"
        facts.append(f"routing: the experts run over all {pairs} (token, expert) pairs at once "
                     f"(experts_implementation={how}), so the router's choices do not change this step's memory")
    else:
        share = 100 * (worst_peak - peak) / max(peak, 1)
        facts.append(f"routing: predicted for balanced routing (about {pairs // max(first.experts, 1)} of {pairs} "
                     f"(token, expert) pairs per expert); the worst routing (every expert hit, one of them by every "
                     f"token) peaks at {fmt_bytes(worst_peak)} ({share:+.1f}%)")
    return facts


QUANTIZED_LAYERS = ("Linear4bit", "Linear8bitLt", "Float8Linear")
"""The layers of quantized base weights (memfit.techniques.base_weights)."""


def experts_3d_weights(model) -> list[torch.nn.Parameter]:
    """The experts' weights held as 3-D parameters (one matrix per expert), which quantizing leaves as they are
    (but for ``nf4:experts=true``: memfit.techniques.base_weights)."""
    from memfit.techniques.quantized_experts import experts_3d_parameters
    return [m.get_parameter(name) for m, name in experts_3d_parameters(model)]


def _experts_left_unquantized(model) -> list[str]:
    """A line for a model whose linears are quantized but whose experts hold 3-D weights: quantizing
    replaces ``nn.Linear`` layers (bitsandbytes, and transformers' ``BitsAndBytesConfig`` as it loads a
    checkpoint), so those stay as they are."""
    from memfit.units import fmt_bytes
    if not any(type(m).__name__ in QUANTIZED_LAYERS for m in model.modules()):
        return []
    kept = experts_3d_weights(model)
    if not kept:
        return []
    size = sum(p.numel() * p.element_size() for p in kept)
    return [f"base weights: the experts' 3-D weights ({fmt_bytes(size)} in {str(kept[0].dtype).removeprefix('torch.')}) "
            "are not nn.Linear layers, so they are not quantized: bitsandbytes and transformers' BitsAndBytesConfig "
            "quantize nn.Linear layers only, and leave them so when loading this model in 4 or 8 bits; "
            "nf4:experts=true quantizes them too (bitsandbytes' parametrization, as axolotl's quantize_moe_experts)"]


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)}"


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def routing_mode(routing: str, tracker):
    """A :class:`RoutingMode` for one fake trace (enter it inside the tracker)."""
    with RoutingMode(routing, tracker).watching() as mode:
        yield mode


class ForcedRouting(TorchDispatchMode):
    """A real run routed as :class:`RoutingMode` assumes, to measure a routing's prediction: every
    ``topk`` over E experts' scores (a router's choice, [T, E] -> [T, k]) returns the indices of
    ``balanced`` (pair i of the T*k to expert i mod E) or ``worst`` (every token to expert 0, its
    other k-1 pairs spread over experts 1..E-1) routing. For tests and the accuracy table only:
    the model trains on its router's real choice."""

    def __init__(self, routing: str = BALANCED):
        super().__init__()
        assert routing in (BALANCED, WORST), routing
        self.routing = routing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE and type(args[0]) is FakeTensor:  # (NOTE [ Device queries ] in memfit.device_queries)
            return args[0].device
        out = func(*args, **(kwargs or {}))
        if func is aten.topk.default and args[0].dim() == 2:
            _, idx = out
            idx.copy_(routed_indices(self.routing, *idx.shape, args[0].shape[-1], idx.dtype, idx.device))
        return out


rng_ops.register(RoutingMode)  # (memfit.rng_ops)


rng_ops.register(ForcedRouting)  # (memfit.rng_ops)
