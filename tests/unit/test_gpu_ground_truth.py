"""GPU predictions against a real H100 and H200 (tests/data/h100.jsonl, h200.jsonl), on this CPU.

Every recorded case is predicted for its card's preset (``h100-80gb``, ``h200-141gb``) and compared
with what the real steady-state step gave: ``max_memory_allocated`` within 3%, ``max_memory_reserved`` within 5%
(see the data's README for how they were measured). A representative subset (one case per CUDA
kernel rule and technique) runs in the default suite; the rest are marked slow. The same table,
with timings, is ``.venv/bin/python -m bench.gpu_accuracy``.

Rows record the library versions they ran with; where a library changed which kernels a model
reaches since then, the prediction emulates the recorded behaviour (``tools/gpu/rows.py``,
``recorded_environment``: T5's SDPA mask layout in transformers 5.17, which sends CUDA's SDPA to the
math path; torch 2.11's memory-efficient kernel without grouped-query heads, which sent qwen2-4l-fp32's
attention to the math path too). Cases that still miss are listed in ``KNOWN_MISSES`` with the reason; they are
expected to fail (strict: a case that starts passing must be taken off the list). Cases recorded
with a technique implementation memfit has since replaced are listed in ``REPLACED``: what they
measured no longer runs, so they are not compared until re-measured. Cases in ``BUILT_IN_FP32``
were recorded when the build held more of the model in full precision than it does now (bf16-pure
built it in fp32 and cast it; QLoRA kept every full-precision linear until the last was quantized):
their allocated bytes are compared, and their reserved bytes must come out below the recorded ones.
Rows without ``"load": "checkpoint"`` ran before built-in models were loaded as checkpoints; they are
predicted with the model built on the device, as they ran (``tools/gpu/rows.py``, ``workload_of``).
"""

import pytest

from tools.gpu import rows as ROWS

ALLOCATED_TOLERANCE = 0.03
RESERVED_TOLERANCE = 0.05


CASES = ROWS.recorded_cases()

# One per rule or technique (~45 s here): memory-efficient attention in fp32 (gpt2-fp32), cuDNN
# attention with CUDA autocast (gpt2-bf16, vit-bf16, dit-bf16), selective checkpointing, offloaded
# states on a prefetch stream, foreach AdamW at the peak (llama4), cuDNN convolution (cnn) and RNN
# (lstm), nn.MultiheadAttention (mha, chunked), masks and dropout (transformer), SDPA's math path
# with CUDA autocast inside a loss (t5), bitsandbytes' CUDA 8-bit update with pure bf16 and
# checkpointing; cases nobody had measured when the rules were written: grouped-query attention in
# fp32 (qwen2, SDPA's math path), a plain-torch LSTM LM (cuDNN RNN reserve, weights used in place,
# Linear's in-place bias after a transposed output), a timm ConvNeXt, a
# residual MLP with block checkpointing; and the H200. Adapters measured blind (no rule was changed
# after their measurement): PEFT LoRA on a Llama at 1B width and QLoRA (bitsandbytes nf4) at 3B; torchao's
# 4-bit AdamW stepped in backward (its compiled update lowered by Inductor's CUDA path,
# memfit.techniques.cuda_lowering); GPT-2 124M's rows 101-105 of the H100 (issue 52): eager, compile:
# blocks, full and full with an activation budget of 0.5 (the compiled ones 15-55 s each here with
# Inductor's cache cold; -full-chunks, a known miss, is in the slow set).
DEFAULT = {
    "gpt2-fp32", "gpt2-bf16", "gpt2-bf16-selective", "gpt2-bf16-offopt", "vit-bf16", "cnn-fp32", "lstm-fp32",
    "mha-bf16", "mha-chunked", "dit-bf16", "transformer-fp32", "t5-bf16", "llama4-bf16", "t-llama4-offopt-b2",
    "t-llama4-pure-8bit-blocks-b2", "qwen2-4l-fp32", "lstm_lm-fp32", "timm-convnext_tiny-bf16",
    "resmlp-bf16-blocks", "h200:gpt2-bf16", "h200:unet-bf16", "h200:t5-bf16-tf523", "h200:b2-swin_tiny-bf16",
    "llama1b-lora-bf16", "llama3b-qlora-nf4-bf16-blocks", "llama1b-full-purebf16-blocks-4bit-ao-inbw",
    "c-gpt2-bf16-eager", "c-gpt2-bf16-blocks", "c-gpt2-bf16-full", "c-gpt2-bf16-full-budget0.5",
}

REPLACED = {
    "h200:b-gpt2-bf16-full": "compile: full with pad_mm's own timing, which on that H200 padded all three vocabulary "
                             "matmuls (-12.1% against the rule's one); memfit's compiled regions now pad by the "
                             "prediction's rule on every card (NOTE [ Padded matmuls without timing ]). Re-measured: "
                             "h200:b-gpt2-bf16-full-rule, -1.02%",
    "gpt2-bf16-offact": "offload: [activations] copied each saved tensor out on the compute stream then; it now "
                        "copies on a side stream and keeps up to STASH tensors on the device while their copies "
                        "are in flight (predicted +1.4% allocated). Re-measure: bench/offload_gpu.py",
    "unet-sdxl-lora-purebf16-blocks": "checkpointing: blocks checkpointed each Transformer2DModel whole then; it now "
                                      "checkpoints each BasicTransformerBlock, as diffusers and kohya do (NOTE [ A "
                                      "model within the model ]: predicted 5.98 GB allocated, -3.9%). Re-measure: "
                                      "tools/gpu/finetune_session.sh",
}

BUILT_IN_FP32 = {
    "gpt2-best": "recorded reserved 1.71 GiB held the fp32 model built before the cast",
    "llama7b-purebf16-adafactor-blocks-inbw-b4": "recorded reserved 25.6 GiB held the fp32 model (25.1 GiB)",
    "llama3b-qlora-nf4-bf16-blocks": "recorded reserved 28.9 GiB held every full-precision linear until the last "
                                     "was quantized; each is now freed once quantized (-5.6%)",
    "h200:p-llama3b-qlora-nf4-bf16-blocks": "as llama3b-qlora-nf4-bf16-blocks",
}

KNOWN_MISSES = {
    "choice4-chosen-purebf16-blocks-8bit-ao-chunks8": "reserved only (+9.6%; allocated +0.1%), on the safe side: "
                                                      "1.609 GiB measured, 1.764 predicted (blocks + 8 loss chunks "
                                                      "at 1.4 GiB allocated; not yet looked into)",
    "c-gpt2-bf16-full-chunks": "allocated -8.2% (reserved -5.9%): two causes, each shown on this CPU with torch 2.11 "
                               "(the run's) in a second environment: Inductor's choices for the compiled chunked loss "
                               "differ between torch 2.11 and 2.14 (the same padding gives -1.05% against -16.1%), and "
                               "the H100's pad_mm timing padded all three chunk matmuls, where the rule pads one "
                               "(torch 2.11: 6,711,764,480 B, -1.05%, reserved equal to the H100's own prediction; by "
                               "the rule +8.1%). Runs now pad by the rule (NOTE [ Padded matmuls without timing ]); the "
                               "torch version stays: re-measure with the torch that predicts",
    "h200:b-gpt2-purebf16-full-chunks8": "allocated -27.4% with torch 2.14 (this machine's), -1.11% with torch 2.11 (the "
                                         "H200's, compile_t211_predicted.jsonl): Inductor compiles the chunked loss "
                                         "otherwise in the two versions, as c-gpt2-bf16-full-chunks; re-measure with the "
                                         "torch that predicts",
    "t-llama4-selective-b2": "reserved only (-5.5%; allocated -1.5%): the real run (torch 2.11) kept ~350 MiB "
                             "more than selective checkpointing does in torch 2.14's trace",
    "timm-vit_small-bf16-blocks": "reserved only (+8.7%; allocated -0.04%): autograd accumulates a second "
                                  "gradient in place on real tensors but not on fake ones (a tensor subclass), "
                                  "so the trace allocates 24 extra 37 MiB buffers; snapshot rsv-vit_small-bf16-blocks",
    "h200:timm-vit_small-bf16-blocks": "as on the H100",
    "timm-convnext_tiny-fp32": "reserved only (-7.3%): cuDNN's fp32 convolution workspaces of the stem, "
                               "downsampling and stride-2 1x1 layers are 0-30% above the modelled size",
    "h200:timm-convnext_tiny-fp32": "as on the H100",
    "timm-resnet50-bf16-blocks": "reserved only (-11.8%; allocated +0.1%): ResNet's 7x7 stride-2 stem has a "
                                 "154 MB cuDNN forward workspace that memfit's 'fewer than 8 input channels: no "
                                 "workspace' rule leaves out; snapshot rsv-resnet50-bf16-blocks",
    "h200:timm-resnet50-bf16-blocks": "as on the H100",
    "llama3-8b-24gib-chosen": "reserved only (-9.9%; allocated +0.05%): recorded when offloaded gradients were "
                              "freed with their copies to the host in flight (record_stream), which the caching "
                              "allocator holds until done while the replay reuses the blocks at once (the 7B "
                              "row: -4.4%). The step now frees each one after its copy, at most IN_FLIGHT "
                              "pending (NOTE [ Gradients in flight ]): re-measure (tools/gpu/finetune_session.sh)",
}


def _params(names):
    return [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_MISSES[n], strict=True)) if n in KNOWN_MISSES
            else n for n in sorted(names)]


def _check(name: str) -> None:
    r = ROWS.predict(CASES[name])
    alloc_err, res_err = r["error"] / 100, r["reserved_error"] / 100
    if name in BUILT_IN_FP32:  # see the module's docstring
        res_err = max(res_err, 0.0)
    assert abs(alloc_err) <= ALLOCATED_TOLERANCE and abs(res_err) <= RESERVED_TOLERANCE, (
        f"{name}: allocated {r['predicted']:,} vs measured {r['measured']:,} ({alloc_err:+.2%}), "
        f"reserved {r['reserved_predicted']:,} vs {r['reserved_measured']:,} ({res_err:+.2%})")


def test_the_recorded_cases_are_there():
    assert len(CASES) >= 87 + 59 and DEFAULT <= set(CASES)
    assert set(KNOWN_MISSES) | set(REPLACED) | set(BUILT_IN_FP32) <= set(CASES)
    assert not DEFAULT & set(REPLACED)


@pytest.mark.parametrize("name", _params(DEFAULT))
def test_gpu_prediction_matches_measurement(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(set(CASES) - DEFAULT - set(REPLACED)))
def test_gpu_prediction_matches_measurement_all_cases(name):
    _check(name)
