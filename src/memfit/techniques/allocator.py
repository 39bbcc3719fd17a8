"""The CUDA caching allocator's segments: PyTorch's default, or expandable segments.

What runs out on a GPU is reserved memory (the segments the caching allocator holds) plus the
CUDA context, not the bytes tensors use. By default each cudaMalloc is a segment of its own, and a
block freed in it serves only requests that fit in that segment. A step whose tensors change size
from phase to phase (per-parameter gradients stepped in backward, offloaded optimizer states
coming back, activations of every size) leaves segments it can no longer fill: Llama-2-7B in
bf16 with AdamW stepped in backward and its states offloaded allocates 13.9 GiB and reserves
25.6 GiB by default (``memfit estimate llama -b 1 --seq-len 2048 --device rtx4090 ...``).

``allocator: expandable`` turns on ``expandable_segments`` (what
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` does, set here through
``torch.cuda.memory._set_allocator_settings`` when the step is built): one virtual segment per
stream grows by mapping 20 MiB pages as needed, so a request that no free block fits extends the
segment by its shortfall instead of opening a new segment. memfit.memory.expandable models it.

Memory/compute trade-off: less fragmentation (reserved close to allocated) for a driver call per
page mapped, paid while the segment grows during the first steps; no cost per step after that.
It does not change what is computed. It acts on CUDA only; a plan that sets it on the CPU is the
same step. The planner does not search it as a value of its own: once bf16-pure builds the model
in bf16, it saves 0.25 GiB on that 7B plan (14.16 -> 13.91 GiB reserved). Every GPU prediction
gives the reserved bytes under both (NOTE [ Reserved bytes with expandable segments, from the same
trace ]), and the planner takes expandable segments where they decide the fit.

NOTE [ Reserved bytes with expandable segments, from the same trace ]
The allocator setting changes no tensor: the trace's allocations are the same under both, and
only the allocator model replaying them differs (memfit.memory.allocator.replay, 0.01-0.05 s
against seconds of tracing). So every predicted GPU report replays its step twice, and says what
expandable segments would hold (``MemoryReport.expandable_reserved_bytes``; ``estimate`` shows it
where it is 2% or more under the default's). It matters most for QLoRA: bitsandbytes dequantizes
each frozen weight to a bf16 temporary in forward and backward, a different size per projection,
between the activations. The default segments cannot reuse those holes: Qwen2.5-7B QLoRA (r=16,
bf16-pure, blocks, 8 loss chunks, batch 2 x 2048, rtx4090) allocates 7.36 GiB and reserves 8.04
GiB by default, 7.57 GiB with expandable segments.

Plan key ``allocator``: ``default`` (:class:`DefaultSegments`: PyTorch's, or what the process's
``PYTORCH_CUDA_ALLOC_CONF`` sets) or ``expandable`` (:class:`ExpandableSegments`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from memfit.techniques.base import Config, Export, Key, Technique, choice, register

VALUES = ("default", "expandable")


def environment_expands() -> bool:
    """Whether the process's ``PYTORCH_CUDA_ALLOC_CONF`` turns expandable segments on."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    options = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",") if ":" in part)
    return options.get("expandable_segments", "").lower() == "true"


class Segments(Config):
    value: str
    expands: bool

    def values(self) -> dict:
        return {"allocator": self.value}


@dataclass(frozen=True)
class DefaultSegments(Segments):
    """The allocator as the process has it: PyTorch's default segments, unless
    ``PYTORCH_CUDA_ALLOC_CONF`` turns expandable segments on (then they are predicted)."""

    value = "default"

    @property
    def expands(self) -> bool:
        return environment_expands()


@dataclass(frozen=True)
class ExpandableSegments(Segments):
    """Expandable segments, turned on before the step's first CUDA allocation."""

    value = "expandable"
    expands = True

    def apply(self, parts) -> None:
        if parts.device_type == "cuda":
            import torch
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")

    def label(self, batch_size):
        return "expandable"

    def export(self, into: Export) -> None:
        note = ("allocator: expandable: run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the "
                "environment (or call torch.cuda.memory._set_allocator_settings('expandable_segments:True') "
                "before the model is moved to the GPU)")
        into.hf_notes.append(note)
        into.lightning_notes.append(note)
        into.kohya_notes.append(note)
        into.axolotl_notes.append(note)

    def notes(self) -> list[str]:
        return ["CUDA allocator with expandable segments (memfit.memory.expandable): 20 MiB pages mapped as "
                "the segment grows"]


def parse(values: dict) -> Segments:
    value = choice("allocator", values["allocator"], VALUES)
    return ExpandableSegments() if value == "expandable" else DefaultSegments()


TECHNIQUE = register(
    Technique("allocator", (Key("allocator", "default", "CUDA caching allocator: default (PyTorch's, or what "
                                "PYTORCH_CUDA_ALLOC_CONF sets) | expandable (expandable_segments: less "
                                "fragmentation).", metavar="ALLOCATOR"),),
              parse),
    Segments, DefaultSegments, ExpandableSegments)
