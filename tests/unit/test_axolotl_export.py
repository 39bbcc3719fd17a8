"""``memfit plan --format axolotl`` (memfit.integrations.axolotl_export): a plan as the fields of an axolotl config,
which axolotl's own reader (memfit.integrations.axolotl) reads back into the same plan; what axolotl has no field for
is listed, and the search keeps to the plans axolotl runs."""

import json

import pytest
import yaml

from memfit.devices import get_device
from memfit.integrations.axolotl import map_config
from memfit.integrations.axolotl_export import to_axolotl
from memfit.plans import Plan
from tests.integration.test_cli_errors import check, run

CARD = get_device("rtx4090")


@pytest.mark.parametrize("fields", [
    {},
    {"precision": "bf16-pure", "checkpointing": "blocks", "optimizer": "adamw8bit", "max_grad_norm": 1.0},
    {"adapter": "lora:r=8,alpha=16,targets=q_proj+v_proj,dropout=0.05", "precision": "bf16-base",
     "micro_batch_size": 2, "optimizer": "adamw8bit-paged"},
    {"adapter": "lora:r=16,targets=linear-modules+lm_head,save=embed_tokens", "base_weights": "nf4:double_quant=true",
     "precision": "bf16-base", "checkpointing": "blocks", "offload": ["activations"], "compile": "full"},
    {"adapter": "dora:r=4", "base_weights": "int8", "precision": "fp16-base", "optimizer": "adamw4bit-ao"},
    {"adapter": "lora:r=8", "precision": "bf16-base", "checkpointing": "blocks:reentrant=true"},
])
def test_the_fields_read_back_into_the_same_plan(fields):
    plan = Plan(**fields)
    out = to_axolotl(plan, 8, "NousResearch/Llama-2-7b-hf", 2048, CARD)
    assert out.unmapped == ()
    assert map_config(yaml.safe_load(out.yaml()), "c.yml", CARD).plan == plan


@pytest.mark.parametrize("fields,unmapped", [
    ({"optimizer_in_backward": True}, "optimizer_in_backward: true"),
    ({"offload": ["optimizer_states"]}, "offload: [optimizer_states]"),
    ({"ema": {"decay": 0.999}}, "ema: {decay: 0.999"),
    ({"checkpointing": "selective"}, "checkpointing: selective"),
    ({"precision": "bf16"}, "precision: bf16"),
    ({"adapter": "lora:r=8", "base_weights": "fp8", "precision": "bf16-base"}, "base_weights: fp8"),
    ({"loss_chunks": 8}, "loss_chunks: 8"),
])
def test_what_axolotl_has_no_field_for_is_listed_as_plan_keys(fields, unmapped):
    out = to_axolotl(Plan(**fields), 8, "NousResearch/Llama-2-7b-hf", 2048, CARD)
    assert any(u.startswith(unmapped) for u in out.unmapped), out.unmapped


def test_ligers_own_slices_are_written_as_liger(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 3072, "vocab_size": 128256}))
    out = to_axolotl(Plan(loss_chunks=32), 16, str(tmp_path), 8192, CARD)
    assert out.fields["liger_fused_linear_cross_entropy"] is True and out.unmapped == ()
    assert map_config(yaml.safe_load(out.yaml()), "c.yml", CARD).plan.loss_chunks == 32


def test_a_plan_searched_for_axolotl_is_one_it_runs(tmp_path):
    """The search keeps to what axolotl's fields carry (no optimizer stepped in backward, no states on the host),
    with axolotl's precision (bf16: true, the adapter in fp32 over it), and prints the fields."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
        "max_position_embeddings": 128}))
    argv = ["plan", str(tmp_path), "--adapter", "lora:r=4", "-b", "4", "--seq-len", "64", "--device", "rtx4090",
            "--format", "axolotl", "--json"]
    rc, out, err = run(argv)
    check(argv, rc, err)
    report = json.loads(out)
    assert rc == 0 and report["axolotl_unmapped"] == [], report["axolotl_unmapped"]
    fields = report["axolotl_fields"]
    assert (fields["base_model"], fields["sequence_len"], fields["adapter"], fields["bf16"]) == (str(tmp_path), 64, "lora",
                                                                                               True)
    assert map_config(fields, "c.yml", CARD).plan == Plan.from_dict(report["chosen"]["plan"])


def test_a_sharded_plan_writes_fsdp2_and_reads_back_over_the_launchers_ranks():
    """FSDP2's fields (axolotl_fsdp's table read backwards); the ranks are the launcher's, said in a note, and
    micro_batch_size is each rank's share of the plan's batch."""
    plan = Plan(shard="fsdp", world_size=4, reshard_after_forward=False, checkpointing="blocks", precision="bf16-pure")
    out = to_axolotl(plan, 8, "NousResearch/Llama-2-7b-hf", 2048, get_device("h100-80gb"))
    assert out.unmapped == () and out.fields["fsdp_version"] == 2 and out.fields["micro_batch_size"] == 2
    assert any("launch it on 4 GPUs" in n for n in out.notes)
    back = map_config(yaml.safe_load(out.yaml()), "c.yml", get_device("h100-80gb")).plan
    assert back == plan.replace(world_size=1)  # (--world-size 4 gives the ranks back)
    mixed = to_axolotl(plan.replace(shard_param_dtype="bf16"), 8, "m", 2048, get_device("h100-80gb"))
    assert any(u.startswith("shard: fsdp") for u in mixed.unmapped)
