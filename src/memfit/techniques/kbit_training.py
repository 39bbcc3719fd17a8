"""peft's ``prepare_model_for_kbit_training`` as memfit's quantized base weights run it, and the compute dtype of
their 4-bit layers (memfit.techniques.base_weights quantizes; this prepares what it quantized for training).

Memory/compute: what was not quantized (norms, embeddings; the output layer keeps its own) goes to fp32 where the
plan keeps fp32 weights (twice its 16-bit bytes, held in both while it casts); a 4-bit layer dequantizes its
weight to its compute dtype per matmul (a weight-sized temporary in that dtype, in forward, backward and any
recomputation): the 16-bit training dtype halves it against fp32.
"""

from __future__ import annotations

import sys

import torch


# NOTE [ QLoRA computes in the training dtype ]
# bitsandbytes' Linear4bit dequantizes its weight to its ``compute_dtype`` and runs the matmul there; transformers
# builds it with ``BitsAndBytesConfig.bnb_4bit_compute_dtype``, fp32 when not given. Every QLoRA recipe gives it:
# the training's 16-bit dtype (peft's and transformers' guides, the QLoRA paper's script, axolotl's and
# LLaMA-Factory's ``compute_dtype``, Unsloth). Where the weights are 16-bit the layer's own dtype is that; under
# autocast over fp32 weights (precision ``bf16``/``fp16``, where peft's ``prepare_model_for_kbit_training`` upcast
# what was not quantized) it is autocast's dtype, not the fp32 the layer was built in, which dequantized each
# weight to fp32 and ran its matmul there: peft's guide's loop (tests/unit/techniques/test_users_qlora_loop.py, the
# Xeon kind) was predicted +1.6% with the Trainer's checkpointing and +3.5% with the reentrant one, and the H200's
# row of it (Llama-3.2-3B sizes) -0.97% reserved; +0.02%, +0.22% and 0.00% in bf16. peft then casts the adapter to
# that dtype, and get_peft_model back to fp32 (memfit.techniques.adapter does too).
def compute_in(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """The plan's 4-bit layers in ``model`` (``compute_follows_plan``) compute in ``dtype`` (None: their weights'
    dtype, as they were built)."""
    for module in model.modules() if dtype is not None else ():
        if getattr(module, "compute_follows_plan", False):
            module.compute_dtype = dtype


def output_layer(model: torch.nn.Module):
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        head = getattr(model, "lm_head", None)
    return head


def has_peft_adapter(model: torch.nn.Module) -> bool:
    """Does the workload's model already hold a peft adapter (a layer of one of peft's tuners)?"""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer
    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def prepare_for_kbit_training(model: torch.nn.Module, freeze: bool = True, upcast: bool = True) -> None:
    """peft's ``prepare_model_for_kbit_training`` without its gradient checkpointing: freeze the
    base (the output layer keeps its ``requires_grad``; ``freeze=False``, a model that already
    trains an adapter: what the workload trains keeps training), fp16/bf16 parameters that are not
    4-bit to fp32 (``upcast``: where the plan keeps fp32 weights; under ``bf16-pure`` they stay in
    bf16, as torchtune's and Unsloth's QLoRA keep them). Not the input embeddings' output requiring grad: peft
    does that only for its reentrant checkpointing (``memfit.techniques.reentrant_checkpoint`` does it there), and it
    costs the first layer's input gradient and what computing it keeps (LLaMA-Factory's QLoRA loops and peft's
    without checkpointing: +2.3% and -2.1% before, +0.00% now, bench/qlora_loops_cpu.py)."""
    head = output_layer(model)
    keep = {id(p): p.requires_grad for p in head.parameters()} if head is not None else {}
    for p in model.parameters() if freeze else ():
        p.requires_grad_(keep.get(id(p), False))
    for p in model.parameters() if upcast else ():
        if p.dtype in (torch.float16, torch.bfloat16) and p.__class__.__name__ != "Params4bit":
            p.data = p.data.to(torch.float32)
