"""Users' QLoRA loops on this CPU, measured against memfit's prediction (docs/limits.md, LLaMA-Factory's item).

Usage: ``python -m bench.qlora_loops_cpu``. A 4-layer Llama (512 wide, vocabulary 2,000) saved in bf16 and loaded
with ``from_pretrained`` and a ``BitsAndBytesConfig`` (NF4, double quantization, bf16 compute), peft's LoRA (rank 8
on q and v, then on every linear layer), AdamW, bf16 autocast, 2 x 128 tokens, no checkpointing, no key/value cache
(``use_cache=False``, as the Trainer and LLaMA-Factory set it: a loop of one's own that leaves a checkpoint's
``use_cache: true`` builds one in training, each layer's keys and values copied into it, which memfit does not predict):

- LLaMA-Factory's loop (no ``prepare_model_for_kbit_training``: the embeddings' output needs no grad), against
  ``precision: bf16-base``;
- peft's guide's loop (``prepare_model_for_kbit_training``: the weights that are not 4-bit in fp32), against
  ``precision: bf16``.

Measured: the built model's tensors (:func:`model_bytes`, which tests/unit/techniques/test_llamafactory_loop.py
counts too) and the third step's peak over them (the profiler, started after the build). Prints each pair and the error.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import torch

CONFIG = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 4, "vocab_size": 2000, "max_position_embeddings": 256, "tie_word_embeddings": False}
BATCH, SEQ = 2, 128
TARGETS = {"q+v": ["q_proj", "v_proj"],
           "every linear": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def measured(folder: Path, targets: list[str], prepare: bool) -> int:
    import transformers
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16,
                                            bnb_4bit_use_double_quant=True, bnb_4bit_quant_type="nf4")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                              quantization_config=quant, device_map={"": "cpu"})
    if prepare:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM"))
    model.config.use_cache = False  # (as the Trainer sets it: TrainingArguments.use_cache, False by default; LLaMA-Factory too)
    return third_step_peak(model, CONFIG["vocab_size"], BATCH, SEQ)


def third_step_peak(model, vocab: int, batch: int, seq: int, max_grad_norm: float | None = None) -> int:
    """The bytes of ``model`` (built, in train mode) and the peak of the third of three steps over them: AdamW over
    what trains, bf16 autocast, the loss of random tokens as their own labels, clipped at ``max_grad_norm``."""
    from memfit.memory.profiler_events import mark, memory_profiler, peak_after_mark
    from memfit.quiet import QuietProfiler
    model.train()
    built = model_bytes(model)
    gc.collect()
    with QuietProfiler(memory_profiler()) as prof:
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-4)
        tokens = torch.randint(0, vocab, (batch, seq))
        for i in range(3):
            if i == 2:
                mark()  # (where the third step starts in the profile)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(trained, max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return built + peak_after_mark(prof)


def model_bytes(model) -> int:
    """The bytes of ``model``'s tensors: parameters', buffers' and the 4-bit weights' quantization states'."""
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for state in (getattr(getattr(m, "weight", None), "quant_state", None) for m in model.modules()):
        for t in [] if state is None else [state.absmax, state.code, *((state.state2.absmax, state.state2.code)
                                                                      if state.nested else ())]:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def main() -> None:
    import transformers

    import memfit
    folder = Path(tempfile.mkdtemp(prefix="memfit-qlora-")) / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16).save_pretrained(folder)
    for name, targets in TARGETS.items():
        for loop, prepare, precision in (("LLaMA-Factory's (no prepare)", False, "bf16-base"),
                                         ("prepare_model_for_kbit_training", True, "bf16")):
            real = measured(folder, targets, prepare)
            plan = memfit.Plan(base_weights="nf4:double_quant=true", precision=precision,
                               adapter=f"lora:r=8,alpha=16,targets={'+'.join(targets)}")
            predicted = memfit.estimate(str(folder), plan, batch_size=BATCH, seq_len=SEQ, device="cpu").peak_bytes
            print(f"LoRA on {name}, {loop}, precision {precision}: measured {real:,} B, predicted {predicted:,} B, "
                  f"{predicted / real - 1:+.1%}")


if __name__ == "__main__":
    main()
