"""A LLaMA-Factory config read as a workload and a plan (memfit.integrations.llamafactory): LLaMA-Factory's own
examples (tests/data/llamafactory/), each mapped field and default, the fields refused in one line, and the ones
named in a warning."""

import json
import re
from pathlib import Path

import pytest

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.from_file import read_training_config
from memfit.integrations.llamafactory import MAPPED, NO_MEMORY_EFFECT, REFUSED, map_config
from memfit.plans import Plan

DATA = Path(__file__).resolve().parents[1] / "data" / "llamafactory"
CARD = get_device("rtx4090")
LORA_ALL = "lora:r=8,alpha=16,targets=linear-modules"


def test_the_lora_example():
    """LLaMA-Factory's own LoRA recipe: rank 8 on every linear layer but the head (``lora_target: all``), alpha twice
    the rank (its default), blocks checkpointed (its default), the adapter in fp32 over the bf16 checkpoint under
    autocast, clipped at 1.0 (TrainingArguments' default); 1 x 8 accumulated at 2,048 tokens, and nothing unmapped."""
    c = read_training_config(DATA / "qwen3-lora-sft.yaml", CARD)
    assert c.workload == "Qwen/Qwen3-4B-Instruct-2507"
    assert (c.batch_size, c.micro_batch_size, c.seq_len, c.batch_per_rank) == (8, 1, 2048, True)
    assert c.plan == Plan(adapter=LORA_ALL, precision="bf16-base", checkpointing="blocks:reentrant=true",
                          micro_batch_size=1, max_grad_norm=1.0)
    assert c.warnings == ()


def test_the_qlora_example_quantizes_while_loading():
    c = read_training_config(DATA / "qwen3-qlora-sft.yaml", CARD)
    assert c.plan == Plan(adapter=LORA_ALL, base_weights="nf4:double_quant=true", precision="bf16-base",
                          checkpointing="blocks:reentrant=true", micro_batch_size=1, max_grad_norm=1.0)
    assert c.warnings == ()


def test_the_galore_and_apollo_examples_are_their_optimizers_stepped_per_layer():
    """Per-layer GaLore (APOLLO): an optimizer per parameter, stepped by its gradient's hook; the Trainer's clipping
    then finds no gradient (LLaMA-Factory: "the displayed gradient norm will be all zeros")."""
    galore = read_training_config(DATA / "llama3-galore-full-sft.yaml", CARD)
    assert galore.plan == Plan(optimizer="galore:rank=128,update_proj_gap=200,scale=2", optimizer_in_backward=True,
                               precision="bf16-pure", checkpointing="blocks:reentrant=true")
    assert (galore.batch_size, galore.warnings) == (1, ())
    apollo = read_training_config(DATA / "llama3-apollo-full-sft.yaml", CARD)
    assert apollo.plan.optimizer == Plan(optimizer="apollo:rank=128,update_proj_gap=200,scale=32").optimizer
    assert apollo.plan.optimizer_in_backward


@pytest.mark.parametrize("name, message", [
    ("qwen3-full-sft-ds3.yaml", "deepspeed: memfit does not model DeepSpeed's ZeRO stages"),
    ("qwen3-lora-dpo.yaml", "stage: dpo: memfit traces supervised fine-tuning and pre-training"),
])
def test_the_examples_memfit_cannot_carry_are_one_line(name, message):
    with pytest.raises(UserError) as e:
        read_training_config(DATA / name, CARD)
    assert str(e.value).startswith(f"--from {DATA / name}: {message}") and "\n" not in str(e.value)


def test_defaults_are_llamafactorys():
    """A config of its model alone: a LoRA (LLaMA-Factory's default fine-tuning), 8 a device at 2,048 tokens
    (TrainingArguments' and LLaMA-Factory's defaults), blocks checkpointed; no precision flag over a checkpoint
    whose dtype is unknown: the adapter in fp32 over a 16-bit base, no autocast; do_train unset is said."""
    c = map_config({"model_name_or_path": "org/model"}, "c.yaml", CARD)
    assert (c.batch_size, c.micro_batch_size, c.seq_len) == (8, 8, 2048)
    assert c.plan == Plan(adapter=LORA_ALL, precision="bf16-base-noautocast", checkpointing="blocks:reentrant=true",
                          max_grad_norm=1.0)
    assert c.warnings == ("LLaMA-Factory config c.yaml: do_train is not true, so LLaMA-Factory would not train; the "
                          "estimate is of the step it trains with do_train: true",)


def _plan(**fields) -> Plan:
    return map_config({"model_name_or_path": "org/model", "do_train": True, **fields}, "c.yaml", CARD).plan


@pytest.mark.parametrize("fields, precision", [
    ({"finetuning_type": "full", "bf16": True}, "bf16"),  # (trainables upcast to fp32: the whole model)
    ({"finetuning_type": "full", "fp16": True}, "fp16"),
    ({"finetuning_type": "full", "pure_bf16": True}, "bf16-pure"),
    ({"finetuning_type": "full"}, "fp32"),
    ({"bf16": True}, "bf16-base"),
    ({"fp16": True}, "fp16-base"),
    ({"pure_bf16": True, "bf16": True}, "bf16-pure"),  # (pure_bf16: nothing upcast, the adapter in bf16 too)
])
def test_precision_follows_what_llamafactory_upcasts(fields, precision):
    assert _plan(**fields).precision == precision


@pytest.mark.parametrize("dtype, expected", [("bfloat16", "bf16-base-noautocast"), ("float16", "fp16-base-noautocast"),
                                             ("float32", "fp32")])
def test_an_adapter_without_a_precision_flag_follows_the_checkpoints_dtype(tmp_path, dtype, expected):
    """``from_pretrained(torch_dtype="auto")`` loads the checkpoint in its own dtype; with bf16 a float32 checkpoint
    trains under autocast over fp32 weights."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": dtype}))
    data = {"model_name_or_path": str(tmp_path), "do_train": True}
    assert map_config(data, "c.yaml", CARD).plan.precision == expected
    assert map_config({**data, "bf16": True}, "c.yaml", CARD).plan.precision == \
        ("bf16" if dtype == "float32" else "bf16-base")


@pytest.mark.parametrize("fields, expected", [
    ({"lora_rank": 16, "lora_alpha": 64, "lora_dropout": 0.05, "lora_target": "q_proj, v_proj"},
     {"adapter": "lora:r=16,alpha=64,targets=q_proj+v_proj,dropout=0.05"}),
    ({"lora_target": ["q_proj", "o_proj"], "additional_target": "embed_tokens,lm_head", "use_dora": True},
     {"adapter": "dora:r=8,alpha=16,targets=q_proj+o_proj,save=embed_tokens+lm_head"}),
    ({"quantization_bit": 8}, {"base_weights": "int8"}),
    ({"quantization_bit": 4, "quantization_type": "fp4", "double_quantization": False},
     {"base_weights": "fp4:double_quant=false"}),
    ({"disable_gradient_checkpointing": True}, {"checkpointing": "none"}),
    ({"use_unsloth_gc": True}, {"checkpointing": "blocks", "offload": ("activations",)}),
    ({"use_reentrant_gc": False}, {"checkpointing": "blocks"}),
    ({"optim": "paged_adamw_8bit", "max_grad_norm": 0.3}, {"optimizer": "adamw8bit-paged", "max_grad_norm": 0.3}),
    ({"max_grad_norm": 0}, {"max_grad_norm": None}),
    ({"torch_compile": True}, {"compile": "full", "checkpointing": "blocks"}),
    ({"finetuning_type": "full", "use_galore": True, "optim": "adamw_bnb_8bit", "galore_rank": 64},
     {"optimizer": "galore8bit:rank=64,update_proj_gap=200,scale=2", "optimizer_in_backward": False}),
    ({"finetuning_type": "full", "use_apollo": True, "apollo_rank": 1, "apollo_scale": 128,
      "apollo_scale_type": "tensor"}, {"optimizer": "apollo-mini:rank=1,update_proj_gap=200,scale=128"}),
])
def test_each_field(fields, expected):
    plan, canonical = _plan(**fields), Plan(**expected)  # (a value as the plan writes it: defaults left out)
    for key in expected:
        assert getattr(plan, key) == getattr(canonical, key), key


def test_liger_is_a_chunked_loss_in_ligers_slices(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 2560, "vocab_size": 151936,
                                                      "torch_dtype": "bfloat16"}))
    c = map_config({"model_name_or_path": str(tmp_path), "do_train": True, "enable_liger_kernel": True, "bf16": True,
                    "per_device_train_batch_size": 2, "cutoff_len": 4096}, "c.yaml", CARD)
    assert c.plan.loss_chunks == 32  # (8,192 tokens in slices of 256, the power of two over 8,192 / (151,936 / 2,560))
    assert "chunked loss in 32 slices" in c.warnings[0] and "RMSNorm, SwiGLU and RoPE" in c.warnings[0]


def test_unmapped_fields_are_named_one_a_line():
    c = map_config({"model_name_or_path": "org/model", "do_train": True, "upcast_layernorm": True, "neftune_noise_alpha":
                    5, "flash_attn": "disabled", "report_to": "wandb", "use_rslora": True}, "c.yaml", CARD)
    assert [w.split(": ", 1)[1] for w in c.warnings] == [
        "upcast_layernorm is not mapped; the estimate ignores it", "neftune_noise_alpha is not mapped; the estimate "
        "ignores it", "flash_attn: disabled is not mapped; the estimate predicts the model's attention with SDPA's "
        "fused kernels"]


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_every_refused_field_names_itself(key):
    with pytest.raises(UserError, match=f"c.yaml: {key}: "):
        map_config({"model_name_or_path": "org/model", key: True}, "c.yaml", CARD)


@pytest.mark.parametrize("fields, message", [
    ({"finetuning_type": "freeze"}, "finetuning_type: freeze: memfit trains the whole model or a LoRA"),
    ({"finetuning_type": "oft"}, "finetuning_type: oft"),
    ({"stage": "rm"}, "stage: rm"),
    ({"quantization_bit": 4, "quantization_method": "hqq"}, "quantization_method: hqq"),
    ({"quantization_bit": 3}, "quantization_bit: 3"),
    ({"quantization_bit": 4, "finetuning_type": "full"}, "use finetuning_type: lora"),
    ({"bf16": True, "fp16": True}, "keep one"),
    ({"optim": "lion_8bit"}, "optim 'lion_8bit' is not one memfit runs"),
    ({"use_galore": True}, "use_galore trains the whole model"),
    ({"use_apollo": True, "finetuning_type": "full", "optim": "adafactor"}, "apollo with optim 'adafactor'"),
    ({"use_galore": True, "finetuning_type": "full", "galore_layerwise": True, "gradient_accumulation_steps": 2},
     "galore_layerwise steps each parameter in backward, without accumulation"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be a whole number >= 1"),
    ({"lora_target": [1]}, "lora_target must be module names"),
    ({"max_grad_norm": "one"}, "max_grad_norm must be a number"),
    ({"model_name_or_path": 7}, "model_name_or_path must name the model"),
    ({"pipeline_model_parallel_size": 4}, "pipeline_model_parallel_size: a Megatron-Core config (USE_MCA=1)"),
])
def test_bad_values_are_one_line_errors(fields, message):
    with pytest.raises(UserError, match=re.escape(message)):
        map_config({"model_name_or_path": "org/model", **fields}, "c.yaml", CARD)


def test_the_field_lists_do_not_overlap():
    assert not (MAPPED & NO_MEMORY_EFFECT) and not (set(REFUSED) & (MAPPED | NO_MEMORY_EFFECT))


def test_a_v1_config_is_one_line(tmp_path):
    """LLaMA-Factory's v1 trainer's configs (``model:``, ``model_class:``) are not read: one line, not axolotl's
    "no base_model"."""
    (tmp_path / "v1.yaml").write_text("model: Qwen/Qwen3-0.6B\nmodel_class: llm\nmicro_batch_size: 2\n")
    with pytest.raises(UserError, match="a config of LLaMA-Factory's v1 trainer"):
        read_training_config(tmp_path / "v1.yaml", CARD)


def test_flash_attention_kernels_are_silent():
    for value in ("auto", "sdpa", "fa2", "flash_attention_2"):
        assert map_config({"model_name_or_path": "org/model", "do_train": True, "flash_attn": value}, "c.yaml",
                          CARD).warnings == ()


def test_a_workload_beside_the_config_is_refused_naming_its_field():
    with pytest.raises(UserError, match="the config's model_name_or_path is the workload"):
        read_training_config(DATA / "qwen3-lora-sft.yaml", CARD, "gpt2")
