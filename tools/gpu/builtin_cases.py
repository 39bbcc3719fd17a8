"""The built-in cases of tools/gpu/ground_truth.py (``--cases`` left out): the architectures and techniques
nobody had measured on a GPU when they were written (issue 10: rows 40-75 of tests/data/h100.jsonl)."""

from __future__ import annotations

GW = "memfit.workloads.gpu_cases"


def _case(case: str, workload: str, batch_size: int, seq_len: int | None = None, **plan) -> dict:
    return {"case": case, "workload": workload, "batch_size": batch_size, "seq_len": seq_len, "plan": plan}


L4 = "llama:num_hidden_layers=4"
BUILTIN: list[dict] = [
    # user-style workloads (memfit.workloads.gpu_cases)
    _case("timm-resnet50-fp32", f"{GW}:resnet50", 64),
    _case("timm-resnet50-bf16", f"{GW}:resnet50", 64, precision="bf16"),
    _case("timm-resnet50-bf16-blocks", f"{GW}:resnet50", 64, precision="bf16", checkpointing="blocks"),
    _case("timm-vit_small-bf16", f"{GW}:vit_small", 128, precision="bf16"),
    _case("timm-vit_small-bf16-blocks", f"{GW}:vit_small", 128, precision="bf16", checkpointing="blocks"),
    _case("timm-convnext_tiny-bf16", f"{GW}:convnext_tiny", 64, precision="bf16"),
    _case("timm-convnext_tiny-fp32", f"{GW}:convnext_tiny", 64),
    _case("lstm_lm-fp32", f"{GW}:lstm_lm", 32),
    _case("lstm_lm-bf16", f"{GW}:lstm_lm", 32, precision="bf16"),
    _case("gru_lm-fp32", f"{GW}:gru_lm", 32),
    _case("gru_lm-bf16", f"{GW}:gru_lm", 32, precision="bf16"),
    _case("resmlp-fp32", f"{GW}:mlp", 4096),
    _case("resmlp-bf16", f"{GW}:mlp", 4096, precision="bf16"),
    _case("resmlp-bf16-blocks", f"{GW}:mlp", 4096, precision="bf16", checkpointing="blocks"),
    _case("unet-fp32", f"{GW}:unet", 16),
    _case("unet-bf16", f"{GW}:unet", 16, precision="bf16"),
    _case("unet-bf16-blocks", f"{GW}:unet", 16, precision="bf16", checkpointing="blocks"),
    _case("qwen2-4l-bf16", f"{GW}:qwen2_4l", 4, precision="bf16"),
    _case("qwen2-4l-bf16-blocks", f"{GW}:qwen2_4l", 4, precision="bf16", checkpointing="blocks"),
    _case("qwen2-4l-fp32", f"{GW}:qwen2_4l", 4),
    _case("mistral-4l-bf16", f"{GW}:mistral_4l", 2, precision="bf16"),
    _case("mistral-4l-bf16-blocks", f"{GW}:mistral_4l", 2, precision="bf16", checkpointing="blocks"),
    _case("bert-large-8l-fp32", f"{GW}:bert_large_8l", 8),
    _case("bert-large-8l-bf16", f"{GW}:bert_large_8l", 8, precision="bf16"),
    _case("bert-large-8l-bf16-blocks", f"{GW}:bert_large_8l", 8, precision="bf16", checkpointing="blocks"),
    # fp16 (GradScaler) variants of recorded bf16 cases
    _case("gpt2-fp16-blocks", "gpt2", 8, 1024, precision="fp16", checkpointing="blocks"),
    _case("t-llama4-fp16-b2", L4, 2, 2048, precision="fp16"),
    _case("bert-fp16", "bert", 32, 512, precision="fp16"),
    _case("vit-fp16", "vit", 64, None, precision="fp16"),
    # 8-bit AdamW (bitsandbytes present)
    _case("gpt2-fp32-8bit", "gpt2", 8, 1024, optimizer="adamw8bit"),
    _case("gpt2-purebf16-8bit", "gpt2", 8, 1024, precision="bf16-pure", optimizer="adamw8bit"),
    _case("bert-bf16-8bit", "bert", 32, 512, precision="bf16", optimizer="adamw8bit"),
    # larger GPT-2 batches
    _case("gpt2-b16-fp32-blocks", "gpt2", 16, 1024, checkpointing="blocks"),
    _case("gpt2-b32-bf16-blocks", "gpt2", 32, 1024, precision="bf16", checkpointing="blocks"),
    _case("gpt2-b32-bf16-blocks-chunks", "gpt2", 32, 1024, precision="bf16", checkpointing="blocks", loss_chunks=16),
    _case("gpt2-b16-bf16", "gpt2", 16, 1024, precision="bf16"),
]
