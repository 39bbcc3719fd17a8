"""Inductor's CUDA path, without a GPU: a GPU preset's compiled regions lowered as Triton lowers them.

A GPU preset is traced on fake CPU tensors (NOTE [ GPU presets without a GPU ], memfit.devices).
Left alone, Inductor would compile its regions for the CPU: its C++ code generator fuses, saves for
backward and reuses buffers otherwise than its CUDA path (Triton's code generator), and a compiled
GPT-2 124M was then predicted 12-17% low for an H100 (rows c-gpt2-bf16-full* of
tests/data/h100.jsonl). While the CUDA kernel model is active (:func:`lowering_for_cuda`, entered
by ``memfit.memory.cuda.model`` with the preset), a predicting compile takes the CUDA path instead
(NOTE [ Inductor's CUDA path without a GPU ]); its wrappers are cached under keys of their own
(``fake_wrapper.PredictionPass``).
"""

from __future__ import annotations

import contextlib
import unittest.mock

import torch
from torch.utils._pytree import tree_map

from memfit.techniques import cuda_facts

_DEVICES: list = []
CUDA = torch.device("cuda", 0)


@contextlib.contextmanager
def lowering_for_cuda(device):
    """While this is active, predicting compiles on CPU tensors lower for ``device`` (a GPU preset)
    as Inductor's CUDA path does."""
    _DEVICES.append(device)
    try:
        yield
    finally:
        _DEVICES.pop()


def active() -> bool:
    return bool(_DEVICES)


def target():
    """The GPU preset the predicting compiles lower for (None: none)."""
    return _DEVICES[-1] if _DEVICES else None


def emulates(example_inputs) -> bool:
    """Whether a predicting compile of a graph with these inputs takes the emulated CUDA path: a GPU
    preset is traced here on CPU tensors (with fake CUDA tensors, on a machine with a GPU, Inductor
    takes its CUDA path by itself)."""
    if not active():
        return False
    devices = {x.device.type for x in example_inputs if isinstance(x, torch.Tensor)}
    return "cpu" in devices or ("cuda" in devices and not torch.cuda.is_available())


def code_generator() -> str:
    """Which code generator a predicting compile follows now, in words (for the report)."""
    device = target()
    if device is None:
        return "Inductor's C++ code generator (CPU)"
    cc = device.compute_capability
    return f"Inductor's CUDA path and Triton code generator for {device.name} (sm{cc[0]}{cc[1]}, {device.sm_count} SMs)"


# NOTE [ Inductor's CUDA path without a GPU ]
# Three ways were open: fake CUDA tensors throughout, modelling where the CPU lowering differs from
# Triton's, or Inductor's CUDA path on graphs moved to CUDA after autograd has run. The first fails:
# AOTAutograd traces the joint forward-backward graph by running autograd's engine, which needs a
# CUDA driver for CUDA tensors, fake ones too (pytorch#92627). The second drifted: the CPU lowering
# and Triton's differ in many small rules (pointwise cat, split reductions, padded matmuls, what a
# fused kernel materialises), and each one modelled was another rule to keep up with Inductor. So
# memfit takes the third:
#
# 1. Dynamo captures the region and AOTAutograd traces its joint graph on the CPU tensors of the
#    trace, with the CUDA kernel model's composites registered (memfit.memory.cuda): the joint graph
#    holds the ATen ops CUDA dispatches to (its attention backend, fused dropout).
# 2. Before Inductor's joint-graph passes and the min-cut partitioner run, the joint graph is moved
#    to CUDA (:func:`graph_on_cuda`): every fake tensor in its metadata and every device argument
#    becomes ``cuda:0``, in the subgraphs of a ``torch.compiler.nested_compile_region`` too (whose
#    lowering reads its inputs from ``eager_input_vals``). From there Inductor runs its CUDA path, unchanged: the joint passes (padded
#    matmuls), the partitioner's choice of what forward saves, the post-grad passes, lowering,
#    the scheduler's fusions and order, buffer reuse, and the Triton code generator, whose kernels
#    are generated and never compiled. Inductor asks the card a few facts while it compiles
#    (memfit.techniques.cuda_facts): the preset answers them.
# 3. The generated wrapper runs on the trace's CPU fake tensors (NOTE [ Inductor's own wrapper on
#    fake tensors ]): its ``empty_strided_cuda`` and ``device('cuda')`` allocate on the trace's
#    device, its device guards and streams do nothing.
#
# What is not Inductor's own: Inductor's pattern passes are traced once per device on example
# tensors with autograd, so their patterns are traced on the CPU (the same ATen patterns); and a
# padded matmul is chosen on a GPU by timing both (``pad_mm``), here by NOTE [ Padded matmuls
# without timing ].
@contextlib.contextmanager
def partition_on_cuda():
    """Inductor's partitioner (and its joint-graph passes before it) get the joint graph moved to
    CUDA (NOTE [ Inductor's CUDA path without a GPU ], step 2)."""
    from torch._inductor import compile_fx

    partition = compile_fx.partition_fn

    def on_cuda(gm, joint_inputs, **kwargs):
        move = graph_on_cuda(gm)
        with compiling_for_cuda():
            return partition(gm, tree_map(move, list(joint_inputs)), **kwargs)

    with unittest.mock.patch.object(compile_fx, "partition_fn", on_cuda):
        yield


# NOTE [ Padded matmuls without timing ]
# Inductor's joint-graph pass ``pad_mm`` pads a compute-bound matmul whose dimensions are not
# aligned (GPT-2's vocabulary, 50257, to 50264 in bf16) when a timing on the GPU shows the padded
# one (with the copies that pad its operands) 10% faster than the unpadded one. Its padded copies
# are memory: a logits-sized one (786 MiB for GPT-2 124M at batch 8 x 1024) each. Nothing can be
# timed here. The H100 rows c-gpt2-bf16-full* tell which way the timings went for GPT-2's three
# vocabulary matmuls: the prediction made on the H100 itself, whose pass timed them there, came to
# 6,369,784,832 bytes allocated (``predicted_cuda`` in the row); here, padding only the input
# gradient's matmul, whose padded operands Inductor writes padded in the first place (the pass then
# leaves their padding out of the timing: ``should_exclude_padding_time``), gives 6,369,860,608
# (padding none: 5,601,774,592; all three: 7,172,274,176; the weight gradient's alone: 5,546,468,864
# and +1.3% reserved). So a matmul the pass finds compute-bound on the preset is taken to be faster
# padded when none of the operands to pad needs a copy of its own, and slower otherwise.
#
# A timing is not a property of the card, though. On an H200 (row b-gpt2-bf16-full of h200.jsonl,
# 2026-12-04) the same step's timings padded all three: 7,240,092,160 bytes measured, 7,172,721,152
# predicted there, and 7,172,929,536 here with all three padded (6,366,885,888 by this rule: -12.1%).
# The H200's memory is 1.43x faster than the H100's at the same compute, so its copies cost less;
# and a 10% margin between two timed kernels also flips with noise. So no CPU can know what a GPU's
# timing will choose, and memfit does not let it choose: every compile of a region, the run's on the
# GPU too, takes this rule (:func:`padding_by_rule`, entered by memfit.techniques.compiled). The run
# pads what its prediction padded, on any card. The cost: where a timing would have padded a matmul
# whose operand needs a copy, that matmul runs unpadded, slower by what the timing found (10% or
# more of that matmul; for GPT-2 on the H200, two of the step's three vocabulary matmuls: not yet
# measured), and the copies' memory (0.8 GB there) is not spent.
class _PadTiming:
    """Stands in for ``pad_mm``'s timing (NOTE [ Padded matmuls without timing ]): the pass asks
    for its timing key with the match, then for the cached timing of that key."""

    def __init__(self, pad_mm) -> None:
        self.pad_mm, self.key_of, self.asked = pad_mm, pad_mm.should_pad_bench_key, None

    def key(self, match, mat1, mat2, op, input=None, is_base_time_key=False):
        self.asked = (match, mat1, mat2, op)
        return self.key_of(match, mat1, mat2, op, input, is_base_time_key)

    def padded_is_faster(self, _key) -> bool:
        pad_mm = self.pad_mm
        match, mat1, mat2, op = self.asked
        m, k = mat1.shape[-2:]
        n = mat2.shape[-1]

        def pads(t, *dims) -> bool:
            return any(pad_mm.get_padded_length(d, pad_mm.get_alignment_size(t)) for d in dims)

        to_pad = [name for name, t, dims in (("mat1", mat1, (m, k)), ("mat2", mat2, (k, n))) if pads(t, *dims)]
        return all(pad_mm.should_exclude_padding_time(match, name) for name in to_pad)


@contextlib.contextmanager
def padding_by_rule():
    """``pad_mm`` takes NOTE [ Padded matmuls without timing ]'s choice in place of a timing: entered by
    every compile of a region, real or predicting, so that a run pads what its prediction padded."""
    from torch._inductor.fx_passes import pad_mm

    timing = _PadTiming(pad_mm)
    with unittest.mock.patch.object(pad_mm, "should_pad_bench_key", timing.key), \
            unittest.mock.patch.object(pad_mm, "get_cached_should_pad", timing.padded_is_faster):
        yield


@contextlib.contextmanager
def compiling_for_cuda():
    """Inductor compiles for the preset of :func:`lowering_for_cuda`, on a machine without a GPU."""
    from torch._inductor.fx_passes import joint_graph

    init = joint_graph.lazy_init

    def patterns_traced_on_cpu(input_device=None, **kwargs):
        on_cpu = input_device is not None and torch.device(input_device).type == "cuda"
        return init(torch.device("cpu") if on_cpu else input_device, **kwargs)

    # (one thread: Inductor would otherwise start its pool of compile workers, ~0.5 GiB each, and hand
    # them each kernel to compile for real as it is generated; a prediction compiles none)
    with cuda_facts.card(target()), torch._inductor.config.patch(compile_threads=1), _rng_state_on_cpu(), \
            unittest.mock.patch.object(joint_graph, "lazy_init", patterns_traced_on_cpu), \
            unittest.mock.patch.object(joint_graph, "UniformValueConstantFolder",
                                       _folder_on_cpu(joint_graph.UniformValueConstantFolder)):
        yield


# NOTE [ Recomputed random ops without a GPU ]
# Where a compiled region recomputes a random op in backward (dropout inside a checkpointed block),
# AOTAutograd's partitioner makes forward and backward draw the same numbers: on CUDA by passing each
# graph a clone of the device generator's state ("graph-safe" functionalization), else by saving the
# generator's state in forward (``run_and_save_rng_state``). Both ask the CUDA generator, which a
# machine without a GPU does not have. While predicting, the second way is taken with the CPU
# generator's state standing in: a ``torch.get_rng_state()`` tensor (5,056 bytes) saved per recomputed
# random op where the GPU passes a generator object and saves nothing; a few hundred KiB for a model
# with a hundred dropouts, against the GiBs of a step.
@contextlib.contextmanager
def _rng_state_on_cpu():
    from torch._functorch import partitioners

    def cpu_state(device="cuda"):
        return torch.get_rng_state()

    def keep_state(new_state, device="cuda"):
        pass

    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._functorch.config.patch(graphsafe_rng_functionalization=False))
        if hasattr(partitioners, "get_device_rng_state"):  # (torch 2.14 has it; 2.11 asks torch.cuda)
            stack.enter_context(unittest.mock.patch.object(partitioners, "get_device_rng_state", cpu_state))
        stack.enter_context(unittest.mock.patch.object(torch.cuda, "get_rng_state", cpu_state))
        stack.enter_context(unittest.mock.patch.object(torch.cuda, "set_rng_state", keep_state))
        yield


def _folder_on_cpu(folder: type) -> type:
    """Inductor's constant folding evaluates a graph's constant nodes on real one-element tensors on
    the graph's device; without a GPU they are evaluated on the CPU (the same values)."""
    def on_cpu(x):
        return torch.device("cpu") if isinstance(x, torch.device) and x.type == "cuda" else x

    class FolderOnCpu(folder):
        def run_node(self, node):
            args, kwargs = node.args, node.kwargs
            node.args, node.kwargs = tree_map(on_cpu, args), tree_map(on_cpu, kwargs)
            try:
                return super().run_node(node)
            finally:
                node.args, node.kwargs = args, kwargs

    return FolderOnCpu


def graph_on_cuda(gm: torch.fx.GraphModule):
    """Move ``gm`` to CUDA in place: its nodes' fake values and device arguments, its subgraphs' too.
    Returns the mover, for the graph's example inputs (one moved tensor per tensor: aliases stay aliases)."""
    move = _mover()
    for graph in [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]:
        for node in graph.graph.nodes:
            node.args = tree_map(move, node.args)
            node.kwargs = tree_map(move, node.kwargs)
            for key in ("val", "eager_input_vals"):
                if key in node.meta:
                    node.meta[key] = tree_map(move, node.meta[key])
        graph.recompile()
    return move


def _mover():
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the CPU tensor, kept alive; its move)

    def move(x):
        if isinstance(x, torch.device) and x.type == "cpu":
            return CUDA
        if not isinstance(x, FakeTensor) or x.device.type != "cpu":
            return x
        if id(x) not in moved:
            with in_kernel_invocation_manager(x.fake_mode):
                meta = torch.ops.aten.alias.default(x)  # (a meta tensor on the fake tensor's storage)
            moved[id(x)] = (x, FakeTensor(x.fake_mode, meta, CUDA))
        return moved[id(x)][1]

    return move
