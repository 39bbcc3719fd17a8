"""torchtune's own LoRA step (its modules, activation checkpointing, chunked cross-entropy, AdamW, bf16) on this CPU,
measured against memfit's prediction of the same torchtune config read with ``--from``.

Usage: ``pip install --no-deps torchtune==0.6.1`` (its last release; torchtune is wound down), then ``python -m
bench.torchtune_loop_cpu``. torchtune 0.6.1 imports data-loading libraries and torchao names that torchao 0.18 moved;
only its model, PEFT, checkpointing and loss modules run here, so those imports are stubbed (:func:`_stubbed`). The
model: torchtune's ``lora_llama3_2`` builder at a small size (2 layers, 256 wide, vocabulary 1,000), LoRA as
``llama3_2/1B_lora_single_device.yaml`` sets it (rank 64 on q, v, output_proj and the MLP), built in bf16 as its
recipe builds it, adapter parameters alone trainable, ``CEWithChunkedOutputLoss`` (8 chunks), 2 x 64 tokens; with and
without ``set_activation_checkpointing``. Measured: the model's bytes and the third step's peak over them (the
profiler). memfit reads that config (tests/data/torchtune) with its checkpoint_dir pointing at a folder with the same
sizes' config.json.
"""

from __future__ import annotations

import gc
import importlib
import json
import sys
import tempfile
import types
from pathlib import Path

import torch
import yaml

from bench.planning_time import _cpu_model
from bench.qlora_loops_cpu import model_bytes

ROOT = Path(__file__).resolve().parent.parent
L, D, H, KV, FF, V, B, S = 2, 256, 4, 2, 688, 1000, 2, 64
STUBBED = ("datasets", "torchdata", "kagglehub", "tiktoken", "blobfile", "sentencepiece", "omegaconf",
           "torchtune.training.quantization")


def _stubbed() -> None:
    """Modules torchtune 0.6.1 imports that its model, PEFT, checkpointing and loss do not use: each an empty module
    whose names are classes; torchao's NF4 tensor under its old name."""
    sys.modules["torchao.dtypes.nf4tensor"] = importlib.import_module(
        "torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {"__class_getitem__": classmethod(lambda cls, item: cls)})

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in STUBBED or name in STUBBED:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = Stub(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            pass
    sys.meta_path.insert(0, Finder())


def torchtune_step(checkpointed: bool) -> int:
    from torchtune import modules, training
    from torchtune.models.llama3_2._component_builders import lora_llama3_2
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from memfit.memory.profiler_events import mark, memory_profiler, peak_after_mark
    from memfit.quiet import QuietProfiler
    torch.manual_seed(0)
    with training.set_default_dtype(torch.bfloat16):
        model = lora_llama3_2(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                              vocab_size=V, num_layers=L, num_heads=H, num_kv_heads=KV, embed_dim=D, max_seq_len=128,
                              intermediate_dim=FF, rope_base=500000, scale_factor=32, lora_rank=64, lora_alpha=128)
    set_trainable_params(model, get_adapter_params(model))
    if checkpointed:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    model.train()
    built = model_bytes(model)
    gc.collect()
    with QuietProfiler(memory_profiler()) as prof:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, V, (B, S))
        for i in range(3):
            if i == 2:
                mark()
            logits = model(tokens)
            loss = loss_fn(logits, tokens)
            del logits  # (the recipe's own "free outputs otherwise it peaks backward memory")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return built + peak_after_mark(prof)


def memfit_prediction(folder: Path, checkpointed: bool) -> tuple[str, int]:
    import memfit
    from memfit.devices import get_device
    from memfit.integrations.torchtune import map_config
    data = yaml.safe_load((ROOT / "tests" / "data" / "torchtune" / "llama3_2_1B_lora_single_device.yaml").read_text())
    data.update(batch_size=B, gradient_accumulation_steps=1, enable_activation_checkpointing=checkpointed,
                loss={"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"})
    data["checkpointer"]["checkpoint_dir"] = str(folder)
    data["tokenizer"]["max_seq_len"] = S
    c = map_config(data, "llama3_2_1B_lora_single_device.yaml", get_device("cpu"))
    return c.plan.describe(), memfit.estimate(c.workload, c.plan, batch_size=c.batch_size, seq_len=c.seq_len,
                                              device="cpu").peak_bytes


def main() -> None:
    _stubbed()
    print(f"machine: {_cpu_model()}")
    folder = Path(tempfile.mkdtemp(prefix="memfit-torchtune-"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D, "intermediate_size": FF,
        "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV, "vocab_size": V,
        "max_position_embeddings": 128, "tie_word_embeddings": True, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}))
    for checkpointed in (True, False):
        measured = torchtune_step(checkpointed)
        plan, predicted = memfit_prediction(folder, checkpointed)
        print(f"activation checkpointing {checkpointed}: torchtune's step measured {measured:,} B; memfit --from "
              f"({plan}) {predicted:,} B, {predicted / measured - 1:+.2%}", flush=True)


if __name__ == "__main__":
    main()
