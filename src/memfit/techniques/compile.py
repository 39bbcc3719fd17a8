"""torch.compile: fused kernels and fewer saved activations (not implemented yet).

Compiling the step's forward (and backward, through AOTAutograd) lets Inductor fuse pointwise
chains into single kernels, so their intermediate results are never materialised, and lets the
min-cut partitioner choose which activations to save for backward: on a GPT-2 measured on an H100
that halved both memory and step time. ``blocks`` compiles each repeated block (short compile
times; composes with block checkpointing, which wraps the compiled block); ``full`` compiles the
model's forward.

Plan key ``compile``: ``none`` (:class:`NoCompile`), ``blocks`` (:class:`CompileBlocks`), ``full``
(:class:`CompileFull`). This version refuses the last two with a plan error.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.techniques.base import Config, Key, Technique, choice, register

MODES = ("none", "blocks", "full")


class Compile(Config):
    mode = "none"
    rank = None

    def values(self) -> dict:
        return {"compile": self.mode}

    def unimplemented(self) -> str | None:
        if self.mode == "none":
            return None
        return (f"plan: compile={self.mode} is not implemented in this memfit version yet; remove it from the plan "
                "(or set compile: none)")


@dataclass(frozen=True)
class NoCompile(Compile):
    """Eager PyTorch."""

    rank = 0


@dataclass(frozen=True)
class CompileBlocks(Compile):
    """torch.compile each repeated block."""

    mode = "blocks"


@dataclass(frozen=True)
class CompileFull(Compile):
    """torch.compile the model's forward."""

    mode = "full"


def parse(values: dict) -> Compile:
    return {"none": NoCompile(), "blocks": CompileBlocks(), "full": CompileFull()}[
        choice("compile", values["compile"], MODES)]


TECHNIQUE = register(
    Technique("compile", (Key("compile", "none", "none | blocks | full.", metavar="COMPILE"),), parse, order=100),
    Compile, NoCompile, CompileBlocks, CompileFull)
