"""Compiled regions: torch.compile on real tensors, its partition and fusions predicted on fake ones.

A region (a repeated block's forward, or the whole loss) is compiled once per process and
configuration (``backend``: one backend object per activation memory budget, so torch.compile's
cache, which matches the backend, serves the planner's, the estimate's and the trainer's models
alike). Calling it:

- with real tensors runs ``torch.compile(fn, backend=inductor, fullgraph=True)``: Inductor's
  kernels; AOTAutograd's min-cut partitioner decides what forward saves for backward under
  ``torch._functorch.config.activation_memory_budget``;
- with fake tensors (``estimate``) runs the same capture, decompositions (Inductor's table) and
  partitioner, with the same budget, but executes the partitioned forward and backward graphs
  node by node on fake tensors under memfit's tracker (NOTE [ Compiled regions on fake tensors ]),
  so the activations saved are the partitioner's own, exactly; what Inductor's fusions never
  materialise is modelled (:func:`materialized`).

NOTE [ Compiled regions on fake tensors ]
torch.compile refuses to run under a user's dispatch mode (the tracker, the CUDA kernel model),
so the call steps out of every active mode while Dynamo captures and AOTAutograd traces and
partitions (the inputs are fake tensors: tracing needs no memory), and the graphs it produces
re-enter those modes when they run: forward in the call, backward from autograd's engine.

NOTE [ Real compiled regions run outside memfit's modes ]
On real tensors too, torch.compile cannot run under a user's dispatch mode; a compiled region
then runs outside memfit's (a profile's tracker, the CPU budget guard). The independent
measurements still see it (the profiler's allocator events, the CUDA allocator's statistics);
the tracker's breakdown of a measured step and the CPU budget guard do not see inside it.

NOTE [ Inductor fusions ]
Inductor fuses chains of pointwise ops into one kernel that reads the chain's inputs and writes its
last result: the intermediate results never exist. The partitioned graphs are decomposed to
Inductor's ops; a pointwise node whose result only pointwise ops or reductions read is computed
inside its readers' kernel and takes no memory; every other result (graph outputs: saved
activations and gradients; inputs of matmuls, convolutions, attention and other library kernels;
reductions' results) is materialised as in eager mode. Inductor's buffer reuse gives memory back
as eager frees do. Not modelled: Inductor's choice to materialise a pointwise result read by
several kernels when recomputing it would be costly (it is assumed recomputed), and scheduler
reordering; the report says the fusion model is one.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import Callable

import torch
import torch.nn.modules.module as _module
from torch.utils._python_dispatch import _disable_current_modes

from memfit.errors import UserError

_REAL: dict[float | None, Callable] = {}
_PREDICTED: dict[float | None, Callable] = {}


def compiled(fn: Callable, *, budget: float | None = None, name: str = "region", fullgraph: bool = True) -> Callable:
    """``fn`` compiled; ``budget``: the activation memory budget (None: torch's default);
    ``fullgraph``: as one graph, or a failure naming why not (else split at graph breaks)."""
    _quiet_logging()
    real = torch.compile(fn, backend=_real_backend(budget), fullgraph=fullgraph)
    predicted = torch.compile(fn, backend=_predicting_backend(budget), fullgraph=fullgraph)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _fake(args, kwargs):
            with _outside_modes() as modes, contextlib.ExitStack() as paused:
                for pause in list(CAPTURE_PAUSES):
                    paused.enter_context(pause())
                _RUNTIME_MODES.append(modes)
                try:
                    return _explained(predicted, name, *args, **kwargs)
                finally:
                    _RUNTIME_MODES.pop()
        _check_toolchain(args, kwargs)
        with _outside_modes():  # NOTE [ Real compiled regions run outside memfit's modes ]
            return _explained(real, name, *args, **kwargs)
    return call


def _quiet_logging() -> None:
    """Hugging Face models log once from inside forward (``logger.warning_once``); a log call splits
    Dynamo's graph, so a compiled region skips it (as Dynamo's own hint advises)."""
    import logging
    once = getattr(logging.Logger, "warning_once", None)
    ignored = getattr(torch._dynamo.config, "ignore_logging_functions", None)  # (torch >= 2.9)
    if once is not None and ignored is not None:
        ignored.add(once)


def _explained(fn, name, *args, **kwargs):
    """Compile-time failures as one line naming the cause and the fix."""
    try:
        return fn(*args, **kwargs)
    except torch._dynamo.exc.Unsupported as e:
        reason = " ".join(str(e).split())[:300]
        raise UserError(f"compile: torch.compile cannot capture the {name} as one graph ({reason}); use "
                        "compile: none, or compile: blocks if only the whole model breaks") from None
    except torch._dynamo.exc.BackendCompilerFailed as e:
        cause = " ".join(str(getattr(e, "inner_exception", e)).split())[:300]
        raise UserError(f"compile: Inductor failed to compile the {name} ({cause}); use compile: none") from None


def _fake(args, kwargs) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves
    return any(isinstance(x, FakeTensor) for x in tree_leaves((args, kwargs)))


def _check_toolchain(args, kwargs) -> None:
    """Inductor writes C++ (CPU) or Triton (CUDA) kernels: say what is missing before it fails."""
    from torch.utils._pytree import tree_leaves
    cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in tree_leaves((args, kwargs)))
    if cuda:
        try:
            import triton  # noqa: F401
        except ImportError:
            raise UserError("compile on a GPU needs Triton (pip install triton, which PyTorch's CUDA wheels "
                            "bring); install it or use compile: none") from None
    elif shutil.which("g++") is None and shutil.which("c++") is None:
        raise UserError("compile on a CPU needs a C++ compiler (g++ or c++ on PATH) for Inductor's kernels; "
                        "install one (e.g. apt install g++) or use compile: none")


# -- backends, one per budget ------------------------------------------------------------------

def _budget(budget: float | None):
    if budget is None:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(activation_memory_budget=budget)


def _real_backend(budget: float | None) -> Callable:
    if budget not in _REAL:
        def inductor(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx
            with _budget(budget):
                return compile_fx(gm, example_inputs, inner_compile=_inductor_inner)
        _REAL[budget] = inductor
    return _REAL[budget]


def _inductor_inner(gm, example_inputs, **kwargs):
    """Inductor's lowering, outside memfit's modes: the backward graph is compiled lazily, during
    the first backward, where the tracker or the budget guard would count the compiler's tensors."""
    from torch._inductor.compile_fx import compile_fx_inner
    with _outside_modes():
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _predicting_backend(budget: float | None) -> Callable:
    """Inductor's own pipeline (its decompositions, joint-graph passes, partitioner and post-grad
    passes), with the lowering to kernels replaced by :func:`_runner`."""
    if budget not in _PREDICTED:
        def inductor_until_lowering(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx
            with _budget(budget):
                return compile_fx(gm, example_inputs, inner_compile=_post_grad_then_run)
        _PREDICTED[budget] = inductor_until_lowering
    return _PREDICTED[budget]


def _post_grad_then_run(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.virtualized import V
    with _outside_modes():  # (the backward graph compiles lazily, inside the traced backward)
        try:
            with V.set_fake_mode(detect_fake_mode(example_inputs)):
                _recursive_post_grad_passes(gm, kwargs.get("is_inference", False))
        except NotImplementedError:  # a pass that cannot rerun this graph on fake tensors: lower it as captured
            pass
    return _runner(gm, example_inputs)


# -- running a partitioned graph on fake tensors ------------------------------------------------

CAPTURE_PAUSES: list = []
"""Context factories entered while a region is captured and compiled on fake tensors: what a fake
trace installs that torch.compile cannot capture through (the CUDA kernel model's autocast lists)."""

_RUNTIME_MODES: list = []
"""The dispatch modes active where the region was called (the tracker, fake mode, the kernel
model): its graphs run under them (see NOTE [ Compiled regions on fake tensors ])."""


@contextlib.contextmanager
def _outside_modes():
    """No dispatch mode and no global module hook: torch.compile refuses the former, and Dynamo
    would guard on the latter (the tracker's module hooks), recompiling for every new tracker."""
    pre, post = dict(_module._global_forward_pre_hooks), dict(_module._global_forward_hooks)
    _module._global_forward_pre_hooks.clear()
    _module._global_forward_hooks.clear()
    try:
        with _disable_current_modes() as modes:
            yield list(modes)
    finally:
        _module._global_forward_pre_hooks.update(pre)
        _module._global_forward_hooks.update(post)


def _runner(gm: torch.fx.GraphModule, example_inputs):
    """A 'compiler' for Inductor's pipeline that runs the graph on fake tensors under the modes of
    the call, allocating what Inductor's generated code allocates (NOTE [ Inductor fusions ])."""
    fused = fused_nodes(gm.graph)
    last_use = _last_uses(gm.graph)

    def run(args):
        # forward runs inside the call, which stepped out of the modes: enter them again; backward
        # runs from autograd's engine, inside the step, where they are active already
        modes = _RUNTIME_MODES[-1] if _RUNTIME_MODES else []
        env: dict = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        env.update(zip(placeholders, args))
        args.clear()  # boxed convention: the inputs are freed as soon as their last reader ran
        result = None
        with contextlib.ExitStack() as stack:
            for m in modes:
                stack.enter_context(m)
            for node in gm.graph.nodes:
                if node.op == "placeholder":
                    continue
                if node.op == "output":
                    result = torch.fx.node.map_arg(node.args[0], lambda a: env[a])
                    break
                a = torch.fx.node.map_arg(node.args, lambda a: env[a])
                k = torch.fx.node.map_arg(node.kwargs, lambda a: env[a])
                dying = [d for d in last_use.get(node, ()) if d.op != "get_attr"]
                if node in fused:
                    with _outside_modes():  # computed inside its readers' kernel: nothing allocated
                        env[node] = _call(gm, node, a, k)
                elif _writes_in_place(node, dying, env):
                    with _outside_modes():
                        out = _call(gm, node, a, k)
                    del a, k
                    for d in dying:  # the input whose buffer the kernel writes is given up first
                        env.pop(d, None)
                    env[node] = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)
                else:
                    env[node] = _call(gm, node, a, k)
                for done in dying:
                    env.pop(done, None)
        return result
    run._boxed_call = True
    return run


def _writes_in_place(node: torch.fx.Node, dying: list, env: dict) -> bool:
    """Inductor writes a fused kernel's result into an input buffer that dies at that kernel when
    the sizes match (its in-place buffer reuse), so the result takes no new memory."""
    if not (_fusible(node) or (node.op == "call_function" and _reduction(node.target))):
        return False
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return False
    nbytes = out.untyped_storage().nbytes() if out.numel() else 0
    return any(isinstance(env.get(d), torch.Tensor) and env[d].untyped_storage().nbytes() == nbytes
               and env[d]._base is None for d in dying)


def _call(gm, node, args, kwargs):
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "get_attr":
        return getattr(gm, node.target)
    raise AssertionError(node.op)


def _last_uses(graph) -> dict:
    """node -> the nodes whose last reader it is (their values are dropped after it runs)."""
    seen, out = set(), {}
    for node in reversed(graph.nodes):
        for used in node.all_input_nodes:
            if used not in seen:
                seen.add(used)
                out.setdefault(node, []).append(used)
    return out


_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "std", "any", "all",
               "argmax", "argmin", "logsumexp"}
# Lowered by Inductor as (indirect) loads inside a fused kernel, like pointwise ops
_LOADS = {"gather", "index", "embedding", "constant_pad_nd", "clone", "iota", "full", "arange", "scalar_tensor",
          "where", "masked_fill", "slice_scatter", "select_scatter", "_to_copy", "convert_element_type",
          "full_like", "zeros_like", "ones_like", "empty_like", "fill"}
# Readers that write their fused inputs' values straight into their own output
_GATHERING = {"cat"}


def _name(target) -> str:
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def _pointwise(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _reduction(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and _name(target) in _REDUCTIONS


def _view(node: torch.fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and any(
        r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


def _fusible(node: torch.fx.Node) -> bool:
    """Computed inside whichever kernel reads it (a pointwise op, or a load)."""
    return node.op == "call_function" and (_pointwise(node.target) or _name(node.target) in _LOADS)


def _readers(node: torch.fx.Node):
    """The nodes that read ``node``'s values, looking through views of it."""
    for user in node.users:
        if _view(user):
            yield from _readers(user)
        else:
            yield user


def fused_nodes(graph: torch.fx.Graph) -> set:
    """The nodes Inductor computes inside their readers' kernels (NOTE [ Inductor fusions ])."""
    return {n for n in graph.nodes if not materialized(n)}


def materialized(node: torch.fx.Node) -> bool:
    """Does Inductor write this node's result to memory? (NOTE [ Inductor fusions ])."""
    if not _fusible(node):
        return True
    readers = list(_readers(node))
    return not readers or any(
        r.op != "call_function" or not (_fusible(r) or _reduction(r.target) or _name(r.target) in _GATHERING)
        for r in readers)
