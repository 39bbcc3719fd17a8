"""``memfit plan --format torchtune`` (memfit.integrations.torchtune_export): a plan as the fields of a torchtune
recipe config, which memfit's reader of torchtune's configs (memfit.integrations.torchtune) reads back into the same
plan; what torchtune's single-device recipes have no field for is listed, and the search keeps to the plans they run."""

import json

import pytest
import yaml

from memfit.devices import get_device
from memfit.integrations.torchtune import map_config
from memfit.integrations.torchtune_export import to_torchtune
from memfit.plans import Plan
from tests.integration.test_cli_errors import run

CARD = get_device("rtx4090")
LORA = "lora:r=8,alpha=16,targets=q_proj+v_proj+o_proj+gate_proj+up_proj+down_proj"


@pytest.mark.parametrize("fields, builder", [
    ({"precision": "bf16-pure", "checkpointing": "blocks", "optimizer": "adamw8bit-paged", "optimizer_in_backward": True,
      "loss_chunks": 8, "compile": "blocks"}, "llama3_1_8b"),
    ({"adapter": LORA, "base_weights": "nf4:double_quant=true", "precision": "bf16-pure", "checkpointing": "blocks",
      "loss_chunks": 8, "micro_batch_size": 2}, "qlora_llama3_1_8b"),
    ({"adapter": "lora:r=64,alpha=128,targets=q_proj+k_proj+lm_head,dropout=0.05", "precision": "fp32",
      "checkpointing": "blocks:every=2", "offload": ["activations"], "optimizer": "adamw8bit-ao", "max_grad_norm": 1.0},
     "lora_llama3_2_1b"),
])
def test_the_fields_read_back_into_the_same_plan(fields, builder):
    plan = Plan(**fields)
    out = to_torchtune(plan, 16, 2048)
    assert out.unmapped == ()
    assert f"torchtune.models.llama3_1.{builder.split('llama')[0]}llama3_1_8b" in out.notes[0]
    data = json.loads(json.dumps(out.fields))  # (plain data, as a YAML file holds)
    data["model"] = {**data.get("model", {}), "_component_": f"torchtune.models.x.{builder}"}
    back = map_config(yaml.safe_load(yaml.safe_dump(data)), "exported.yaml", CARD, "# tune download org/model")
    assert back.plan == plan and all("torchao's NF4" in w for w in back.warnings)  # (the one line it says of QLoRA)
    assert (back.workload, back.seq_len, back.batch_size) == ("org/model", 2048, 16)


@pytest.mark.parametrize("fields, unmapped", [
    ({"precision": "bf16"}, ["precision: bf16 (torchtune's recipes train every weight in one dtype: bf16-pure or fp32)"]),
    ({"checkpointing": "selective"}, ["checkpointing: selective (torchtune checkpoints whole layers, non-reentrant)"]),
    ({"checkpointing": "blocks:reentrant=true"},
     ["checkpointing: blocks:reentrant=true (torchtune checkpoints whole layers, non-reentrant)"]),
    ({"offload": ["optimizer_states"]}, ["offload: [optimizer_states] (torchtune offloads activations only)"]),
    ({"compile": "full"}, ["compile: full (torchtune compiles each layer and the loss: compile: blocks)"]),
    ({"adapter": "lora:targets=q_proj+gate_proj"},
     ["adapter: lora:r=16,targets=q_proj+gate_proj (torchtune adapts q_proj, k_proj, v_proj, o_proj, the whole MLP or the "
      "output)"]),
    ({"base_weights": "int8", "adapter": "lora"}, ["base_weights: int8 (torchtune's QLoRA is NF4 with double "
                                                   "quantization)"]),
    ({"swap_blocks": 2, "adapter": "lora"}, ["swap_blocks: 2"]),
])
def test_what_torchtune_has_no_field_for_is_listed_as_plan_keys(fields, unmapped):
    assert list(to_torchtune(Plan(**{"precision": "bf16-pure", **fields}), 8, 1024).unmapped) == unmapped


def test_plan_format_torchtune_searches_the_plans_it_runs(tmp_path):
    """The whole command: the chosen plan printed as torchtune's fields, which read back into that plan."""
    spec = ("llama:num_hidden_layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4,"
            "num_key_value_heads=2,vocab_size=512")
    code, out, err = run(["plan", spec, "--adapter", "lora:r=8,alpha=16,targets=linear-modules", "-b", "4",
                          "--seq-len", "256", "--device", "rtx4060", "--format", "torchtune", "--json"])
    assert code == 0, err
    answer = json.loads(out)
    assert answer["torchtune_unmapped"] == []
    fields = {**answer["torchtune_fields"]}
    fields["model"] = {**fields["model"], "_component_": "torchtune.models.llama3_2.lora_llama3_2_1b"}
    back = map_config(fields, "exported.yaml", get_device("rtx4060"), "# tune download org/model")
    assert back.plan.precision == "bf16-pure" and back.plan.adapter == \
        "lora:r=8,alpha=16,targets=q_proj+k_proj+v_proj+o_proj+gate_proj+up_proj+down_proj"
