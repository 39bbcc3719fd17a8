"""Built-in workloads, named ``ARCH`` or ``ARCH:key=value,key=value``.

Hugging Face architectures (``gpt2``, ``llama``, ``bert``, ``t5``, ``vit``) are built from their
config class only: no weights, no tokenizer, no network. Overrides set config attributes
(``gpt2:n_layer=4,n_embd=256``). The plain-torch zoo (``cnn``, ``lstm``, ``transformer``, ``mha``,
``dit``) covers kernels with hidden workspaces and data-dependent code paths; overrides set the
fields of each model's config. The diffusers denoisers (``dit-lumina2``, ``dit-sd3``, ``unet-sdxl``,
``unet-sd15``) are built from their classes' constructors at released sizes and take ``resolution``
(:mod:`memfit.workloads.diffusion`). A local Hugging Face model folder (``./dir``, ``hf:./dir``) is built
the same way from its config.json alone (NOTE [ Model folders ] in :mod:`memfit.workloads.hf`).
"""

from __future__ import annotations

from memfit.workloads.builtin import builtin_names, builtin_workload
from memfit.workloads.loading import load_workload

__all__ = ["builtin_names", "builtin_workload", "load_workload"]
