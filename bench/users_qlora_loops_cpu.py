"""The QLoRA and LoRA loops as users write them (tests/unit/techniques/test_users_qlora_loop.py), measured on this CPU
and predicted by the plans that name them.

Usage: ``python -m bench.users_qlora_loops_cpu [--hub]``. A 2-layer Llama (256 wide, vocabulary 1,000, tied embeddings)
saved in the loop's dtype and loaded with ``from_pretrained`` and a ``BitsAndBytesConfig`` (NF4, double quantization,
computing in the training dtype), peft's ``prepare_model_for_kbit_training`` (its checkpointing: none, the Trainer's
non-reentrant one, or its default reentrant one), peft's LoRA r=16 on q and v, ``use_cache=False`` as the Trainer sets
it, AdamW, autocast (fp16: the loss scaled, as on a T4), 2 x 64 tokens. Measured: the profiler's peak of the third
step, the load's allocations included. Predicted: ``base_weights nf4:double_quant=true``, ``precision bf16`` (``fp16``),
the same checkpointing. ``--hub``: also Qwen2.5-7B-Instruct's sizes from its hub config (the Hugging Face cache,
offline), the same plan with blocks at 2 x 2,048 on the ``rtx4090`` preset: peak and reserved bytes.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch

from memfit.memory.profiler_events import mark, memory_profiler, peak_after_mark
from memfit.quiet import QuietProfiler

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
          "max_position_embeddings": 128, "tie_word_embeddings": True}
BATCH, SEQ = 2, 64


def save_checkpoint(folder, dtype=torch.bfloat16) -> None:
    """A checkpoint in ``dtype``: the loop loads it in the same dtype (NOTE [ A cast while loading, off the
    profiler's thread ])."""
    import transformers
    config = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(folder)


# NOTE [ A cast while loading, off the profiler's thread ]
# transformers 5 casts a checkpoint's tensors to the load dtype on worker threads, whose CPU allocations
# the profiler does not record while it records their frees on the main thread: a bf16 checkpoint loaded
# in fp16 reads 3.4 MB *below* zero here after from_pretrained. A GPU's allocator sees every thread; on
# this CPU each loop loads a checkpoint saved in its own dtype (QLoRA's 4-bit quantization runs on the main
# thread).


def users_loop(folder, checkpointing: bool | str, quantized: bool = True, half=torch.bfloat16) -> int:
    """The third step's peak of the user's loop (bytes live on the CPU allocator, the load's included):
    QLoRA (``quantized``) or LoRA over a model loaded in ``half`` (fp16: its loss scaled, as
    Trainer(fp16=True) scales it); ``checkpointing``: False, True (non-reentrant, as the Trainer enables
    it) or ``"reentrant"`` (``gradient_checkpointing_kwargs={"use_reentrant": True}``)."""
    kwargs = {"use_reentrant": checkpointing == "reentrant"}
    import transformers
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=half) if quantized else None
    gc.collect()
    with QuietProfiler(memory_profiler()) as prof:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), quantization_config=quant,
                                                                  dtype=half, device_map={"": "cpu"})
        if quantized:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=bool(checkpointing),
                                                    gradient_checkpointing_kwargs=kwargs)
        elif checkpointing:  # (what Trainer(gradient_checkpointing=True) does)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
        model.config.use_cache = False  # (the Trainer's: its TrainingArguments.use_cache, False by default)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        scaler = torch.amp.GradScaler("cpu", enabled=half == torch.float16)
        tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
        for i in range(3):
            if i == 2:
                mark()
            with torch.autocast("cpu", dtype=half):
                loss = model(input_ids=tokens, labels=tokens).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return peak_after_mark(prof)


CASES = [("none", torch.bfloat16), ("blocks", torch.bfloat16), ("blocks:reentrant=true", torch.bfloat16),
         ("none", torch.float16), ("blocks", torch.float16)]
PLAN = {"base_weights": "nf4:double_quant=true", "adapter": "lora:r=16,alpha=16,targets=q_proj+v_proj"}


def main() -> None:
    import memfit
    from bench.planning_time import _cpu_model
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hub", action="store_true", help="also Qwen2.5-7B-Instruct's sizes from its hub config")
    args = parser.parse_args()
    print(f"machine: {_cpu_model()}, {torch.get_num_threads()} threads")
    for checkpointing, half in CASES:
        folder = Path(tempfile.mkdtemp(prefix="memfit-users-qlora-"))
        save_checkpoint(folder, half)
        measured = users_loop(folder, {"none": False, "blocks": True}.get(checkpointing, "reentrant"), half=half)
        precision = "bf16" if half == torch.bfloat16 else "fp16"
        plan = memfit.Plan(**PLAN, precision=precision, checkpointing=checkpointing)
        predicted = memfit.estimate(str(folder), plan, batch_size=BATCH, seq_len=SEQ, device="cpu").peak_bytes
        print(f"QLoRA, {precision}, checkpointing {checkpointing}: measured {measured:,} B, predicted {predicted:,} B "
              f"({predicted / measured - 1:+.3%})", flush=True)
    if args.hub:
        plan = memfit.Plan(**PLAN, precision="bf16", checkpointing="blocks")
        r = memfit.estimate("Qwen/Qwen2.5-7B-Instruct", plan, batch_size=2, seq_len=2048, device="rtx4090")
        print(f"Qwen2.5-7B, bf16, blocks, rtx4090, 2 x 2048: peak {r.peak_bytes:,} B, reserved {r.reserved_bytes:,} B")


if __name__ == "__main__":
    main()
