"""torch.compile: fused kernels and fewer saved activations.

Compiling a region of the step (its forward, and through AOTAutograd its backward) lets Inductor
fuse chains of pointwise ops into single kernels, so their intermediate results are never
materialised, and lets AOTAutograd's min-cut partitioner choose what forward saves for backward
(recomputing cheap pointwise results instead of saving them). On a GPT-2 measured on an H100 that
halved both memory and step time. The cost: compile time (tens of seconds per distinct region,
once per process: compiled regions are cached) and, on a CPU, a C++ compiler.

- :class:`CompileBlocks` (``blocks``) compiles each repeated block's forward (the blocks
  ``checkpointing: blocks`` finds): one graph serves every block, so compile time stays short, and
  checkpointing wraps the compiled block (block checkpointing keeps only each block's input; a
  compiled block recomputes with fused kernels).
- :class:`CompileFull` (``full``) compiles the whole loss: the model's forward and the loss (the
  chunked loss too), with checkpointed blocks inside the graph (as torchtitan compiles).
- :class:`NoCompile` (``none``): eager PyTorch.

``checkpointing: budget:F`` sets the partitioner's activation memory budget for the compiled
regions (it needs compile). ``estimate`` predicts a compiled step on fake tensors by running the
same capture and partitioner and modelling Inductor's fusions (memfit.techniques.compiled).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import UserError
from memfit.techniques.base import Config, Export, Key, Technique, choice, register
from memfit.techniques.checkpointing import find_blocks
from memfit.techniques.compiled import compiled

MODES = ("none", "blocks", "full")
FUSION_NOTE = ("compiled regions: AOTAutograd's partition (what forward saves) traced exactly on fake tensors; "
               "Inductor's fusions modelled (pointwise results read only by pointwise ops or reductions take no "
               "memory; NOTE [ Inductor fusions ])")


class Compile(Config):
    mode = "none"
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

    def export(self, into: Export) -> None:
        into.hf["torch_compile"] = True
        if self.mode == "blocks":
            into.hf_unmapped.append("compile: blocks (TrainingArguments compiles the whole model)")
        into.in_lightning_module(f"compile: {self.mode} (torch.compile in configure_model)")


def _budget(parts) -> float | None:
    """The activation memory budget of ``checkpointing: budget:F``, if the plan has one."""
    return getattr(parts.plan.config("checkpointing"), "fraction", None) if parts.plan is not None else None


@dataclass(frozen=True)
class NoCompile(Compile):
    """Eager PyTorch."""

    rank = 0
    compiles = False

    def check(self, plan) -> None:
        pass

    def label(self, batch_size):
        return None

    def ablations(self):
        return []

    def notes(self) -> list[str]:
        return []

    def export(self, into: Export) -> None:
        pass


@dataclass(frozen=True)
class CompileBlocks(Compile):
    """torch.compile each repeated block's forward; checkpointing wraps the compiled block."""

    mode = "blocks"
    rank = None

    def apply(self, parts) -> None:
        blocks = find_blocks(parts.model)
        if not blocks:
            raise UserError("compile: blocks found no repeated blocks (a ModuleList or Sequential of modules of one "
                            "class) in the model; use compile: full or compile: none")
        budget = _budget(parts)
        for _, children in blocks:
            for block in children:
                block.forward = compiled(block.forward, budget=budget, name=f"block {type(block).__name__}")


@dataclass(frozen=True)
class CompileFull(Compile):
    """torch.compile the whole loss: the model's forward and the loss function, as one graph."""

    mode = "full"
    rank = None

    def apply(self, parts) -> None:
        parts.finalizers.append(self._finalize)

    def _finalize(self, parts) -> None:  # after chunked loss and checkpointing wrapped what they wrap
        # not one graph: models log or branch in Python here and there (Dynamo splits the graph there)
        parts.loss_fn = compiled(parts.loss_fn, budget=_budget(parts), name="model and loss", fullgraph=False)


def parse(values: dict) -> Compile:
    return {"none": NoCompile(), "blocks": CompileBlocks(), "full": CompileFull()}[
        choice("compile", values["compile"], MODES)]


TECHNIQUE = register(
    Technique("compile", (Key("compile", "none", "torch.compile: none | blocks (each repeated block) | full "
                              "(the model and the loss).", metavar="COMPILE"),), parse, order=25,
              depends_on_model=True),
    Compile, NoCompile, CompileBlocks, CompileFull)
