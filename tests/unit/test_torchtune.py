"""torchtune recipe configs read as memfit's workload and plan (memfit.integrations.torchtune): torchtune's own
configs (tests/data/torchtune, copied from pytorch/torchtune), each field, the model it loads, and what is refused."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from memfit.cli.main import main
from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.from_file import read_training_config
from memfit.integrations.torchtune import map_config
from memfit.plans import Plan

DATA = Path(__file__).parents[1] / "data" / "torchtune"
CARD = get_device("rtx4090")
ALL = "targets=q_proj+v_proj+o_proj+gate_proj+up_proj+down_proj"
NULL_LENGTH = "tokenizer.max_seq_len is null (each batch as long as its longest sample): give the length with --seq-len"


@pytest.mark.parametrize("name, workload, batch, micro, plan", [
    ("llama3_1_8B_full_single_device", "meta-llama/Meta-Llama-3.1-8B-Instruct", 2, 2,
     Plan(precision="bf16-pure", checkpointing="blocks", optimizer="adamw8bit-paged", optimizer_in_backward=True,
          loss_chunks=8)),
    ("llama3_1_8B_qlora_single_device", "meta-llama/Meta-Llama-3.1-8B-Instruct", 16, 2,
     Plan(adapter=f"lora:r=8,alpha=16,{ALL}", base_weights="nf4:double_quant=true", precision="bf16-pure",
          checkpointing="blocks", loss_chunks=8, micro_batch_size=2)),
    ("qwen2_5_7B_lora_single_device", "Qwen/Qwen2.5-7B-Instruct", 16, 2,
     Plan(adapter=f"lora:r=8,alpha=16,{ALL}", precision="bf16-pure", checkpointing="blocks", loss_chunks=8,
          micro_batch_size=2)),
    ("llama3_2_1B_lora_single_device", "meta-llama/Llama-3.2-1B-Instruct", 32, 4,
     Plan(adapter=f"lora:r=64,alpha=128,{ALL}", precision="bf16-pure", loss_chunks=8, micro_batch_size=4)),
])
def test_torchtunes_own_configs(name, workload, batch, micro, plan):
    """The model is the one the config's ``tune download`` comment names (its checkpoint_dir is not on this
    machine); its null max_seq_len is said, and torchao's NF4 as bitsandbytes'."""
    c = read_training_config(DATA / f"{name}.yaml", CARD)
    assert (c.workload, c.batch_size, c.micro_batch_size, c.seq_len) == (workload, batch, micro, None)
    assert c.plan == plan
    said = [w.split(": ", 1)[1] for w in c.warnings]
    assert said[0] == NULL_LENGTH and len(said) == 1 + ("qlora" in name)


def _config(**fields) -> dict:
    base = yaml.safe_load((DATA / "llama3_1_8B_qlora_single_device.yaml").read_text())
    for key, value in fields.items():
        section, _, sub = key.partition("__")
        if sub:
            base[section] = {**base.get(section, {}), sub: value}
        else:
            base[section] = value
    return base


@pytest.mark.parametrize("fields, expected", [
    ({"dtype": "fp32"}, {"precision": "fp32"}),
    ({"enable_activation_checkpointing": False}, {"checkpointing": "none"}),
    ({"ac_mode": "selective", "ac_option": 2}, {"checkpointing": "blocks:every=2"}),
    ({"enable_activation_offloading": True}, {"offload": ("activations",)}),
    ({"compile": True}, {"compile": "blocks"}),
    ({"clip_grad_norm": 1.0}, {"max_grad_norm": 1.0}),
    ({"optimizer": {"_component_": "torchao.optim.AdamW8bit", "lr": 1e-4}}, {"optimizer": "adamw8bit-ao"}),
    ({"loss": {"_component_": "torch.nn.CrossEntropyLoss"}}, {"loss_chunks": 0}),
    ({"loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss", "num_output_chunks": 16}},
     {"loss_chunks": 16}),
    ({"model__apply_lora_to_output": True, "model__lora_attn_modules": ["q_proj", "k_proj"], "model__apply_lora_to_mlp":
      False, "model__lora_dropout": 0.05}, {"adapter": "lora:r=8,alpha=16,targets=q_proj+k_proj+lm_head,dropout=0.05"}),
    ({"model": {"_component_": "torchtune.models.llama3_1.llama3_1_8b"}}, {"adapter": "none", "base_weights": "as-is"}),
    ({"tokenizer__max_seq_len": 4096}, {}),
])
def test_each_field(fields, expected):
    c = map_config(_config(**fields), "c.yaml", CARD, "# tune download org/model")
    canonical = Plan(**expected)
    for key in expected:
        assert getattr(c.plan, key) == getattr(canonical, key), key
    assert c.seq_len == fields.get("tokenizer__max_seq_len")


def test_the_checkpoint_folder_with_its_config_is_the_model_and_a_named_one_wins(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    data = _config(checkpointer={"checkpoint_dir": str(tmp_path)})
    assert map_config(data, "c.yaml", CARD, "# tune download org/model").workload == str(tmp_path)
    assert map_config(_config(), "c.yaml", CARD, "", workload="acme/other").workload == "acme/other"
    with pytest.raises(UserError, match=r"holds no config.json and the config names no `tune download` id; name the "
                                        r"model beside it \(memfit estimate <hub id or folder> --from c.yaml\)"):
        map_config(_config(), "c.yaml", CARD, "")


@pytest.mark.parametrize("fields, message", [
    ({"fsdp_cpu_offload": True}, "fsdp_cpu_offload: a distributed recipe's FSDP; memfit reads torchtune's single-device"),
    ({"tensor_parallel_dim": 2}, "tensor_parallel_dim: tensor parallelism is not modelled"),
    ({"quantizer": {"_component_": "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer"}},
     "quantizer: quantization-aware training is not modelled"),
    ({"model": {"_component_": "torchtune.models.llama3_2_vision.llama3_2_vision_11b", "decoder_trainable": True}},
     "torchtune's multimodal builders are not read"),
    ({"dtype": "fp16"}, "dtype 'fp16': torchtune trains in bf16 or fp32"),
    ({"optimizer": {"_component_": "torch.optim.Adagrad"}}, "optimizer torch.optim.Adagrad: not one memfit runs"),
    ({"ac_mode": "selective", "ac_option": "op"}, "ac_mode 'selective' with ac_option 'op' is not mapped"),
    ({"model__lora_attn_modules": ["qkv_proj"]}, r"lora_attn_modules \['qkv_proj'\]: torchtune's are q_proj"),
    ({"batch_size": 0}, "batch_size must be a whole number >= 1"),
])
def test_what_it_cannot_carry_is_one_line(fields, message):
    with pytest.raises(UserError, match=message) as e:
        map_config(_config(**fields), "c.yaml", CARD, "# tune download org/model")
    assert "\n" not in str(e.value)


def test_an_unknown_field_is_named():
    c = map_config(_config(new_knob=3), "c.yaml", CARD, "# tune download org/model")
    assert "torchtune config c.yaml: new_knob is not mapped; the estimate ignores it" in c.warnings


def test_estimate_from_a_torchtune_config(tmp_path, capsys):
    """The CLI end to end: a torchtune LoRA config whose checkpoint_dir holds a small Llama's config.json."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "torch_dtype": "bfloat16"}))
    shutil.copy(DATA / "llama3_2_1B_lora_single_device.yaml", tmp_path / "lora.yaml")
    data = yaml.safe_load((tmp_path / "lora.yaml").read_text())
    data["checkpointer"]["checkpoint_dir"] = str(tmp_path)
    data["tokenizer"]["max_seq_len"] = 32
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(data))
    assert main(["estimate", "--from", str(tmp_path / "lora.yaml"), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert (f"from {tmp_path / 'lora.yaml'}: {tmp_path} · batch 32 (4 a micro-batch x 8 accumulated) · seq 32 · "
            f"adapter=lora:r=64,alpha=128,{ALL}, precision=bf16-pure, micro_batch_size=4, loss_chunks=8") in out


def test_phi3s_fused_projections_take_torchtunes_lora(tmp_path):
    """transformers' Phi-3 fuses q/k/v (qkv_proj) and the MLP's gate and up projections (gate_up_proj), which
    torchtune's modules keep apart: its LoRA on them is predicted on the fused layers, said; before, those targets
    matched no layer and only o_proj and down_proj were adapted."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3"}))
    c = map_config(_config(checkpointer={"checkpoint_dir": str(tmp_path)}), "c.yaml", CARD, "")
    assert c.plan.adapter == "lora:r=8,alpha=16,targets=qkv_proj+o_proj+gate_up_proj+down_proj"
    assert any("phi3's projections are fused in transformers' model" in w for w in c.warnings)

