"""torch.compile: fused kernels and fewer saved activations.

Compiling a region of the step (its forward, and through AOTAutograd its backward) lets Inductor
fuse chains of pointwise ops into single kernels, so their intermediate results are never
materialised, and lets AOTAutograd's min-cut partitioner choose what forward saves for backward
(recomputing cheap pointwise results instead of saving them). On a GPT-2 measured on an H100 that
halved both memory and step time. The cost: compile time (tens of seconds per distinct region,
once per process: compiled regions are cached) and a code generator's toolchain: a C++ compiler on a CPU,
Triton on a GPU (and to predict a GPU preset's step, memfit.techniques.cuda_lowering).

- :class:`CompileBlocks` (``blocks``) compiles each repeated block's forward (the blocks
  ``checkpointing: blocks`` finds): one graph serves every block, so compile time stays short, and
  checkpointing wraps the compiled block (block checkpointing keeps only each block's input; a
  compiled block recomputes with fused kernels).
- :class:`CompileFull` (``full``) compiles the whole loss: the model's forward and the loss (the
  chunked loss too), with checkpointed blocks inside the graph (as torchtitan compiles).
- :class:`NoCompile` (``none``): eager PyTorch.

``checkpointing: budget:F`` sets the partitioner's activation memory budget for the compiled
regions (it needs compile). ``estimate`` predicts a compiled step on fake tensors by running the
same capture and Inductor pipeline down to its generated wrapper, run with no-op kernels
(memfit.techniques.compiled).

Planning (:func:`search`, ``DEFAULT_SEARCH``): compile modes are searched when asked (``memfit plan
--compile-modes none,blocks,full``), and by default on a GPU preset when the run's length is given
(``--steps``) and is at least ``PAYS_AFTER_STEPS``: compile time then counts per step (compile seconds /
steps), so the search weighs it, and a run too short to pay for it is not slowed by tracing its
graphs. Without ``--steps`` the run's length is unknown and the default search stays eager (planning
stays within a minute for the README's examples). On the CPU the calibrated time model
compiles each mode for real (10-30 s for a 2-layer GPT-2 on 2 cores, minutes for GPT-2 124M). On GPU
presets plans are only traced: each distinct compiled graph (precision, micro-batch, depth, budget) is
a capture through Inductor's passes (seconds for a small block, 15-25 s for GPT-2 124M's shallow whole
graph), once per worker process, and plans that differ only outside it (the optimizer, in-backward
stepping, offloaded states) reuse it (NOTE [ Wrapped forwards that torch.compile does not tie to one
model ] in memfit.techniques.forwards): Llama-2-7B with ``--steps 1000`` plans in about 2 minutes on 2
cores. Dynamo's recompile limit is ``compiled.RECOMPILE_LIMIT`` per region and process, with one line
past it. In the planner's memory order a compiled plan saves at least what the same plan saves eager
(so predicted for GPT-2 with each eager checkpointing mode, on the CPU and a GPU preset); ``blocks``
and ``full`` are not ordered (with a budget, whole-model graphs can hold more than blocks). On GPU
presets the compiled step's time (memfit.planner.timing) and compile time (``COMPILE_SECONDS_PER_OP``)
come from one H100 recording.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import CompileFailed, UserError
from memfit.techniques.base import Config, Export, GraphSize, Key, SearchContext, Technique, choice, register
from memfit.techniques.checkpointing import BUDGET_RECORDING, find_blocks
from memfit.techniques.compiled import compiled, has_cpu_compiler, has_triton

MODES = ("none", "blocks", "full")
DEFAULT_SEARCH = {"gpu": ("none",), "cpu": ("none",)}
"""The modes the planner searches when not told and the run's length is unknown (see the module's
docstring): eager, as the user's step is written."""
LONG_RUN_SEARCH = ("none", "blocks", "full")
"""A GPU preset's compile modes searched by default for a run of ``PAYS_AFTER_STEPS`` steps or more."""
PAYS_AFTER_STEPS = 100
"""Under this many steps, a compile of tens of seconds (GPT-2 124M's whole graph: about a minute on a
GPU) costs more than its fused kernels save (30-40 ms a step on GPT-2 at batch 8 x 1024 on an H100)."""
FUSION_NOTE = ("compiled regions: Inductor's own generated code (partition, fusions, schedule, buffer reuse) run on "
               "fake tensors with no-op kernels (NOTE [ Inductor's own wrapper on fake tensors ]); a GPU preset's "
               "through Inductor's CUDA path for its card, without a GPU (NOTE [ Inductor's CUDA path without a GPU ]; "
               "matmul padding chosen without timing)")

# Compile time on GPU presets, from one recording (gpu-ground-truth/h100-handwritten-gpt2-compile.jsonl:
# a hand-written GPT-2 124M, batch 8 x 1024, bf16 autocast, AdamW, torch.compile(model), no memfit).
# The compiled step's time is memfit.planner.timing's (``Constants.compile_fusion``).
GPT2_FORWARD_OPS = 651
"""ATen ops of memfit's GPT-2 124M forward in bf16 (the ``gpt2`` workload at batch 8 x 1024, as the
op recorder of memfit.planner.opcost counts them: ``GraphSize.forward_ops``)."""
COMPILE_SECONDS_PER_OP = BUDGET_RECORDING[-1][2] / GPT2_FORWARD_OPS
"""Compile time per op of the compiled graph: that recording's 45.6 s over GPT-2's forward ops.
Compile time is taken to grow with the graph; the host CPU's speed and Inductor's caches, which
change it several-fold, are not modelled."""


class Compile(Config):
    mode = "none"
    warms_up = True
    compiles = True
    """Whether the step runs compiled regions (checkpointing: budget:F needs one)."""

    def values(self) -> dict:
        return {"compile": self.mode}

    def check(self, plan) -> None:
        if plan.attention == "chunked":
            raise UserError(f"plan: compile: {self.mode} cannot capture chunked attention (a function mode that "
                            "recomputes each query chunk); use attention: auto with compile")

    def label(self, batch_size):
        return f"compile={self.mode}"

    def ablations(self):
        return [(f"compile {self.mode}", NoCompile())]

    def notes(self) -> list[str]:
        return [FUSION_NOTE]

    def warmup_seconds(self, graph: GraphSize, plan) -> float:
        return COMPILE_SECONDS_PER_OP * self._graph_ops(graph)

    def _graph_ops(self, graph: GraphSize) -> int:
        return graph.forward_ops

    @classmethod
    def from_arguments(cls, given: Export) -> Compile | None:
        """``TrainingArguments(torch_compile=True)`` compiles the whole model."""
        return CompileFull() if given.hf.get("torch_compile") else None

    def export(self, into: Export) -> None:
        if self.mode == "full":  # TrainingArguments compiles the whole model, never block by block
            into.hf["torch_compile"] = into.axolotl["torch_compile"] = True
        into.not_carried(self, hf=self.mode != "full", axolotl=self.mode != "full")


def _budget(parts) -> float | None:
    """The activation memory budget of ``checkpointing: budget:F``, if the plan has one."""
    return getattr(parts.plan.config("checkpointing"), "fraction", None) if parts.plan is not None else None


@dataclass(frozen=True)
class NoCompile(Compile):
    """Eager PyTorch."""

    rank = 0
    warms_up = False
    compiles = False

    def check(self, plan) -> None:
        pass

    def saves_at_most(self, other, batch_size: int) -> bool:
        return isinstance(other, Compile)

    def label(self, batch_size):
        return None

    def ablations(self):
        return []

    def notes(self) -> list[str]:
        return []

    def export(self, into: Export) -> None:
        pass

    def warmup_seconds(self, graph: GraphSize, plan) -> float:
        return 0.0


@dataclass(frozen=True)
class CompileBlocks(Compile):
    """torch.compile each repeated block's forward; checkpointing wraps the compiled block."""

    mode = "blocks"
    rank = None

    def apply(self, parts) -> None:
        blocks = find_blocks(parts.model)
        if not blocks:
            raise UserError("compile: blocks found no repeated blocks (a ModuleList of modules of one class, each "
                            "more than one layer, or a Sequential of one class) in the model; use compile: full or "
                            "compile: none")
        budget = _budget(parts)
        for _, children in blocks:
            for block in children:
                block.forward = compiled(block.forward, budget=budget, name=f"{BLOCK_REGION}{type(block).__name__}")

    def _graph_ops(self, graph: GraphSize) -> int:
        return graph.block_ops  # one graph serves every block


@dataclass(frozen=True)
class CompileFull(Compile):
    """torch.compile the whole loss: the model's forward and the loss function, as one graph."""

    mode = "full"
    rank = None

    def apply(self, parts) -> None:
        parts.finalizers.append(self._finalize)

    def _finalize(self, parts) -> None:  # after chunked loss and checkpointing wrapped what they wrap
        # not one graph: models log or branch in Python here and there (Dynamo splits the graph there)
        parts.loss_fn = compiled(parts.loss_fn, budget=_budget(parts), name=FULL_REGION, fullgraph=False)


BLOCK_REGION, FULL_REGION = "block ", "model and loss"
"""The names of the regions the compile modes compile (a block's: this, then its class's name)."""


def mode_failed(e: CompileFailed) -> bool:
    """``e`` is a failure of a region a compile mode compiles (not of another technique's: torchao's update)."""
    return e.region.startswith(BLOCK_REGION) or e.region == FULL_REGION


def search(ctx: SearchContext) -> list[str]:
    """``ctx.options["compile_modes"]`` if given, else ``LONG_RUN_SEARCH`` on a GPU preset for a run
    of ``PAYS_AFTER_STEPS`` or more (``ctx.options["run_steps"]``), else ``DEFAULT_SEARCH`` for the
    device (see the module's docstring); modes that cannot run here are left out with a note."""
    modes = ctx.options.get("compile_modes")
    steps = ctx.options.get("run_steps")
    if modes is None and ctx.device.is_gpu and steps is not None and steps >= PAYS_AFTER_STEPS:
        modes = LONG_RUN_SEARCH  # (the plan's table says its times count compile time over the run)
    elif modes is None:
        modes = DEFAULT_SEARCH["gpu" if ctx.device.is_gpu else "cpu"]
    modes = [choice("compile", m, MODES) for m in modes]
    if "blocks" in modes and not find_blocks(ctx.model):
        modes.remove("blocks")
        ctx.notes.append("compile: blocks left out: the model has no repeated blocks")
    missing = _missing_toolchain(ctx.device.is_gpu)
    if missing and any(m != "none" for m in modes):
        modes = [m for m in modes if m == "none"]
        ctx.notes.append(f"compile left out: {missing}")
    if not modes:
        raise UserError(f"plan: no compile mode asked for can run here ({ctx.notes[-1]}); add none to "
                        "--compile-modes")
    return modes


def _missing_toolchain(gpu: bool) -> str | None:
    """What Inductor lacks here to predict (and run) compiled regions on this device, with the fix: a GPU
    preset's regions take Inductor's CUDA path (Triton's code generator), the CPU's its C++ one."""
    if gpu:
        return None if has_triton() else "Inductor's CUDA path needs Triton (pip install triton)"
    return None if has_cpu_compiler() else "Inductor needs a C++ compiler (g++ or c++ on PATH)"


def parse(values: dict) -> Compile:
    return {"none": NoCompile(), "blocks": CompileBlocks(), "full": CompileFull()}[
        choice("compile", values["compile"], MODES)]


TECHNIQUE = register(
    Technique("compile", (Key("compile", "none", "torch.compile: none | blocks (each repeated block) | full "
                              "(the model and the loss).", metavar="COMPILE"),), parse,
              search=search, depends_on_model=True),
    Compile, NoCompile, CompileBlocks, CompileFull)
