"""Compiled regions: torch.compile on real tensors, its partition and fusions predicted on fake ones.

A region (a repeated block's forward, or the whole loss) is compiled once per process and
configuration (``backend``: one backend object per activation memory budget, so torch.compile's
cache, which matches the backend, serves the planner's, the estimate's and the trainer's models
alike). Calling it:

- with real tensors runs ``torch.compile(fn, backend=inductor, fullgraph=True)``: Inductor's
  kernels; AOTAutograd's min-cut partitioner decides what forward saves for backward under
  ``torch._functorch.config.activation_memory_budget``;
- with fake tensors (``estimate``) runs the same capture and the same Inductor pipeline, with the
  same budget: decompositions, the partitioner, post-grad passes, lowering, the scheduler's
  fusions and order, buffer reuse, down to the generated Python wrapper, which then runs on fake
  tensors with kernels that do nothing (NOTE [ Inductor's own wrapper on fake tensors ]). The
  activations saved are the partitioner's and every buffer is Inductor's, exactly.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import unittest.mock
from collections.abc import Callable

import torch
import torch.nn.modules.module as _module
from torch.utils._python_dispatch import _disable_current_modes

from memfit.errors import CompileFailed, UserError
from memfit.techniques import cuda_lowering, fake_wrapper

RECOMPILE_LIMIT = 64
"""Compilations of one region's code in a process. One process (the planner, a test session) compiles a
block for many budgets, shapes, and fake and real tensors; Dynamo's default (8) would then fall back
to eager silently, and the prediction would no longer be of the step that runs."""

_REAL: dict[float | None, Callable] = {}
_PREDICTED: dict[float | None, Callable] = {}
_BROKEN: dict = {}
"""Code of a region's function -> how Dynamo broke its graph, once seen in this process (Dynamo's own
cache of compiled code is per process and code object too: a second trace compiles nothing anew)."""


class GraphBreaks(CompileFailed):
    """A predicted region did not compile as one graph (NOTE [ A broken graph is not predicted as compiled ])."""

    def __init__(self, name: str, breaks: int, first: str):
        what = f"torch.compile broke the {name} into pieces at {breaks} graph break(s) (first: {first})"
        super().__init__(f"compile: {what}; memfit predicts a compiled region only when Dynamo captures it whole",
                         what, name)
        self.breaks, self.first = breaks, first

    def __reduce__(self):  # (a trace worker sends it back: its own arguments, not CompileFailed's)
        return GraphBreaks, (self.region, self.breaks, self.first)


# NOTE [ Compiled regions on fake tensors ]
# torch.compile refuses to run under a user's dispatch mode (the tracker, the CUDA kernel model),
# so the call steps out of every active mode while Dynamo captures and AOTAutograd traces and
# partitions (the inputs are fake tensors: tracing needs no memory), and the graphs it produces
# re-enter those modes when they run: forward in the call, backward from autograd's engine.
def compiled(fn: Callable, *, budget: float | None = None, name: str = "region", fullgraph: bool = True,
             dynamic: bool | None = None, recompile_limit: int = RECOMPILE_LIMIT) -> Callable:
    """``fn`` compiled; ``budget``: the activation memory budget (None: torch's default);
    ``fullgraph``: as one graph, or a failure naming why not (else split at graph breaks);
    ``dynamic``: torch.compile's (False: one graph per shape, as a library that compiles per
    parameter asks); ``recompile_limit``: compilations of ``fn`` allowed in this process."""
    _quiet_logging()
    real = torch.compile(fn, backend=_real_backend(budget), fullgraph=fullgraph, dynamic=dynamic)
    # NOTE [ A predicted region is compiled for its shapes ]
    # A run compiles its step once, for the one shape it trains at. One process that predicts several
    # shapes of a region (the planner's micro-batch sizes, ``--batch-size max``) would otherwise have
    # Dynamo's automatic dynamic shapes recompile it with a symbolic batch after the first change, and
    # predict other buffers than the run's static graph (GPT-2 at batch 8 after batch 4: 10 MB more
    # reserved). So a prediction compiles each shape apart, unless ``dynamic`` is asked for.
    predicted = torch.compile(fn, backend=_predicting_backend(budget), fullgraph=fullgraph,
                              dynamic=False if dynamic is None else dynamic)

    # NOTE [ Real compiled regions run outside memfit's modes ]
    # On real tensors too, torch.compile cannot run under a user's dispatch mode; a compiled region
    # then runs outside memfit's (a profile's tracker, the CPU budget guard). The independent
    # measurements still see it (the profiler's allocator events, the CUDA allocator's statistics);
    # the tracker's breakdown of a measured step and the CPU budget guard do not see inside it.
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=recompile_limit, fail_on_recompile_limit_hit=True), \
                _log_calls_ignored():
            return _call(*args, **kwargs)

    def _call(*args, **kwargs):
        _check_toolchain(args, kwargs)
        if _fake(args, kwargs):
            with _outside_modes() as modes, contextlib.ExitStack() as paused, fake_wrapper.prediction_caches():
                for pause in list(CAPTURE_PAUSES):
                    paused.enter_context(pause())
                fake_wrapper.RUNTIME_MODES.append(modes)
                _tell_code_generator(modes, name)
                try:
                    return _whole(fn, name, lambda: _explained(predicted, name, *args, **kwargs))
                finally:
                    fake_wrapper.RUNTIME_MODES.pop()
        with _outside_modes():  # NOTE [ Real compiled regions run outside memfit's modes ]
            return _explained(real, name, *args, **kwargs)
    return call


# NOTE [ A broken graph is not predicted as compiled ]
# Where Dynamo breaks a region's graph (``compile: full`` allows it: models log or branch in Python),
# the pieces between the graphs run eagerly, outside memfit's modes (NOTE [ Compiled regions on fake
# tensors ]): the tracker would miss what they allocate, and the prediction would be of a step
# that does not run. So a predicted region that broke raises :class:`GraphBreaks` naming the first
# break; ``estimate`` then predicts the plan without that compile and says so in one line, and the
# planner leaves the compile mode out with that line (memfit.memory.estimate, memfit.planner).
def _whole(fn, name: str, call):
    """``call()`` (a predicted region's compiled call), refused if Dynamo broke the region's graph."""
    from torch._dynamo.utils import counters
    code = getattr(fn, "__code__", None) or id(fn)
    if code in _BROKEN:
        raise GraphBreaks(name, *_BROKEN[code])
    before = dict(counters["graph_break"])
    out = call()
    new = {k: v - before.get(k, 0) for k, v in counters["graph_break"].items() if v > before.get(k, 0)}
    if new:
        first = " ".join(str(next(iter(new))).split("\n")[0].split())[:200]
        _BROKEN[code] = (sum(new.values()), first)
        raise GraphBreaks(name, *_BROKEN[code])
    return out


def _tell_code_generator(modes, name: str) -> None:
    """The report says which of Inductor's code generators a predicted region followed: the modes
    of the call that keep a report's approximations (memfit's tracker) are told."""
    for mode in modes:
        if callable(getattr(mode, "approximate", None)):
            mode.approximate(f"compiled region predicted with {cuda_lowering.code_generator()}", name)


def _quiet_logging() -> None:
    """Inductor's C++ code generator imports cpp_extension, which warns on a machine without CUDA."""
    import logging
    logging.getLogger("torch.utils.cpp_extension").addFilter(_no_cuda_runtime_warning)


# NOTE [ A log call inside a compiled region ]
# Hugging Face models log once from inside forward (``logger.warning_once``, an ``lru_cache`` of
# transformers'); a log call splits Dynamo's graph, so a region memfit compiles skips it, as Dynamo's own
# hint advises: ``ignore_logging_functions`` holds it while memfit's regions are captured, and not in the
# user's own ``torch.compile`` calls (it used to be added to the process's set for good). torch 2.9-2.13
# write Dynamo's config as JSON into each compile's metrics, whatever ``log_compilation_metrics`` says,
# and cannot write a function in that set: Dynamo logged "Unexpected exception logging compilation
# metrics" with its traceback at every compile (torch 2.11, the GPU machine's), and a handler that keeps
# log records (pytest's) kept the traceback's frames, and the fake tensors they held, alive: the 1B
# Llama's GPU row came +5.6% after another test in its process. On those torches the metrics of memfit's
# compiles take Dynamo's config as torch writes it with the set as the user left it.
@contextlib.contextmanager
def _log_calls_ignored():
    """Dynamo's config while memfit captures a region (the note above)."""
    import logging
    once = getattr(logging.Logger, "warning_once", None)
    ignored = getattr(torch._dynamo.config, "ignore_logging_functions", None)  # (torch >= 2.9)
    if once is None or ignored is None or once in ignored:
        yield
        return
    with torch._dynamo.config.patch(ignore_logging_functions=ignored | {once}), _metrics_with_the_set(ignored):
        yield


def _metrics_with_the_set(ignored: set):
    """Where this torch cannot write a function of ``ignore_logging_functions`` in a compile's metrics, its
    writer called with ``ignored`` (the user's set) in place (NOTE [ A log call inside a compiled region ])."""
    if _metrics_write_the_set():
        return contextlib.nullcontext()
    writer = torch._dynamo.utils._get_dynamo_config_for_logging

    def written():
        with torch._dynamo.config.patch(ignore_logging_functions=ignored):
            return writer()
    return unittest.mock.patch.object(torch._dynamo.utils, "_get_dynamo_config_for_logging", written)


@functools.cache
def _metrics_write_the_set() -> bool:
    """Whether this torch writes Dynamo's config into a compile's metrics with a function in
    ``ignore_logging_functions`` (torch >= 2.14 leaves the set out; one without the writer logs no config)."""
    import json
    writer = getattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", None)
    if writer is None:
        return True
    with torch._dynamo.config.patch(ignore_logging_functions={_metrics_write_the_set}):
        try:
            json.loads(writer() or "{}")
        except TypeError:
            return False
    return True


def _no_cuda_runtime_warning(record) -> bool:
    return not str(record.msg).startswith("No CUDA runtime is found")


def _explained(fn, name, *args, **kwargs):
    """Compile-time failures as one line naming the cause and the fix."""
    try:
        return fn(*args, **kwargs)
    except torch._dynamo.exc.Unsupported as e:
        what = f"torch.compile cannot capture the {name} as one graph ({graph_break_reason(e)})"
        raise CompileFailed(f"compile: {what}; use compile: none, or compile: blocks if only the whole model breaks",
                            what, name) from None
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        raise UserError(f"compile: the {name} was compiled {RECOMPILE_LIMIT} times in this process (new shapes, "
                        "budgets or plans each compile anew); run fewer plans per process, or use compile: none") from None
    except torch._dynamo.exc.BackendCompilerFailed as e:
        cause = " ".join(str(getattr(e, "inner_exception", e)).split())[:300]
        what = f"Inductor failed to compile the {name} ({cause})"
        raise CompileFailed(f"compile: {what}; use compile: none", what, name) from None


def graph_break_reason(e: Exception, limit: int = 300) -> str:
    """What broke, from Dynamo's graph-break message: its kind (the first line) and its debug context
    (the op or call that failed), not the generic explanation and hints between them; at most ``limit``
    characters."""
    text = str(e)
    kind = " ".join(text.split("\n", 1)[0].split())
    context = text.partition("Developer debug context:")[2].partition("For more details about this graph break")[0]
    reason = f"{kind}: {' '.join(context.split())}" if context.strip() else " ".join(text.split())
    return reason if len(reason) <= limit else reason[:limit - 3].rstrip() + "..."


def _fake(args, kwargs) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves
    return any(isinstance(x, FakeTensor) for x in tree_leaves((args, kwargs)))


def _check_toolchain(args, kwargs) -> None:
    """Inductor writes C++ (CPU) or Triton (CUDA) kernels: say what is missing before it fails. A GPU
    preset's region is predicted with Inductor's CUDA path (memfit.techniques.cuda_lowering), which
    needs Triton and no C++ compiler."""
    from torch.utils._pytree import tree_leaves
    cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in tree_leaves((args, kwargs)))
    if cuda or (cuda_lowering.active() and _fake(args, kwargs)):
        if not has_triton():
            where = "on a GPU" if cuda else f"for {cuda_lowering.target().name}"
            raise UserError(f"compile {where} needs Triton (Inductor's CUDA code generator; PyTorch's CUDA wheels "
                            "bring it): pip install triton, or use compile: none")
    elif not has_cpu_compiler():
        raise UserError("compile on a CPU needs a C++ compiler (g++ or c++ on PATH) for Inductor's kernels; "
                        "install one (e.g. apt install g++) or use compile: none")


def has_triton() -> bool:
    """Inductor's CUDA path needs Triton: for real kernels, and for a GPU preset's predictions (its
    code generator writes Triton kernels, which a prediction never compiles)."""
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def has_cpu_compiler() -> bool:
    """Inductor's CPU code generator needs a C++ compiler: for real kernels, and for predictions too
    (it probes the compiler while generating the code that a prediction runs)."""
    return shutil.which("g++") is not None or shutil.which("c++") is not None


# -- backends, one per budget ------------------------------------------------------------------

def _budget(budget: float | None):
    if budget is None:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(activation_memory_budget=budget)


def _real_backend(budget: float | None) -> Callable:
    if budget not in _REAL:
        def inductor(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx
            with _budget(budget), cuda_lowering.padding_by_rule():  # NOTE [ Padded matmuls without timing ]
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
            on_cuda = cuda_lowering.partition_on_cuda() if cuda_lowering.emulates(example_inputs) else \
                contextlib.nullcontext()  # NOTE [ Inductor's CUDA path without a GPU ]
            with _budget(budget), on_cuda, cuda_lowering.padding_by_rule():
                return compile_fx(gm, example_inputs, inner_compile=_lower_then_run)
        _PREDICTED[budget] = inductor_until_lowering
    return _PREDICTED[budget]


# NOTE [ Inductor's own wrapper on fake tensors ]
# What a compiled region allocates is decided by Inductor after the partition: which pointwise results
# its fusions materialise (a result read by several kernels is recomputed or stored depending on its
# cost), the order its scheduler picks (e.g. all of a low budget's recomputation first), which dying
# buffer a kernel writes into. Modelling those rules drifted from Inductor by up to a third of the
# peak at low budgets, so memfit does not model them: ``compile_fx_inner`` runs in full, and only
# the last step, loading the generated wrapper module, is replaced (memfit.techniques.fake_wrapper):
# kernels are no-ops and Inductor's direct allocators are replaced by ``torch.empty_strided``/
# ``as_strided``, which fake mode and the tracker see; the wrapper is kept in Inductor's caches under
# keys of its own (NOTE [ Predicted wrappers in Inductor's caches ]). Library kernels the wrapper calls (matmuls with ``out=``,
# attention and other fallbacks) run on fake tensors as in eager mode. The kernels are generated
# but never compiled (Inductor's CPU code generator still probes the C++ compiler once, so a CPU
# prediction needs one too; a GPU preset's takes Inductor's CUDA path, NOTE [ Inductor's CUDA path
# without a GPU ], which needs Triton and no C++ compiler).
def _lower_then_run(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """Inductor's whole ``compile_fx_inner`` (post-grad passes, lowering, scheduling and fusion,
    buffer reuse, the generated Python wrapper) with the kernels' compilation left out: the wrapper
    runs on fake tensors, allocating and freeing exactly what the real one does, under the modes of
    the call (NOTE [ Inductor's own wrapper on fake tensors ]). Inductor's FX graph cache serves a
    graph predicted before, here or in another process (NOTE [ Predicted wrappers in Inductor's
    caches ])."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering
    # (a backward graph compiles lazily, in autograd's backward, outside the call's prediction_caches: it
    # is a predicting compile too, and is keyed as one, with the preset the trace lowers for)
    caches = fake_wrapper.prediction_caches()
    load, lowering = fake_wrapper.load_wrapper, contextlib.nullcontext()
    if cuda_lowering.emulates(example_inputs):  # NOTE [ Inductor's CUDA path without a GPU ]
        move = cuda_lowering.graph_on_cuda(gm)  # (an inference graph, or the backward: moved at its partition)
        example_inputs = [move(x) for x in example_inputs]
        load, lowering = fake_wrapper.load_emulated_wrapper, cuda_lowering.compiling_for_cuda()
    with _outside_modes(), caches, lowering, unittest.mock.patch.object(GraphLowering, "_compile_to_module_lines", load):
        return compile_fx_inner(gm, example_inputs, **kwargs)


# -- running Inductor's wrapper on fake tensors ------------------------------------------------

CAPTURE_PAUSES: list = []
"""Context factories entered around each predicted call of a compiled region: what a fake trace
installs that torch.compile cannot capture through (the CUDA kernel model's autocast lists) steps
aside there, while the region is captured (:func:`while_capturing`)."""


# NOTE [ Paused only while a region is captured ]
# A region already compiled runs its cached code (its wrapper) with no capture, and AOTAutograd runs
# that code with autocast off: what a fake trace installs only for the capture's sake need not step
# aside. torchao's update is a compiled call per parameter and step, 80 calls a trace for a 3-block
# GPT-2: stepping the CUDA autocast lists aside and back for each (two registrations of 170 kernels)
# took 14% of such a trace. Dynamo's compile callbacks (run once for the outermost frame compiled)
# enter it instead; where this torch has none, it is entered for the whole block.
@contextlib.contextmanager
def while_capturing(factory: Callable):
    """Enter ``factory()`` while Dynamo captures and compiles a frame inside this block, and only then."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is None or not hasattr(handler, "register_start_callback"):
        with factory():
            yield
        return
    stack = contextlib.ExitStack()

    def start(_args) -> None:
        stack.enter_context(factory())

    def end(_args) -> None:
        stack.close()

    handler.register_start_callback(start)
    handler.register_end_callback(end)
    try:
        yield
    finally:
        handler.remove_start_callback(start)
        handler.remove_end_callback(end)
        stack.close()


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
