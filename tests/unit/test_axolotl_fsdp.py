"""An axolotl config's FSDP keys as memfit's FSDP2 plan (memfit.integrations.axolotl_fsdp): they were refused
("remove fsdp from the config"), and 14 of axolotl's 59 llama, mistral, qwen2, gemma2 and phi examples set them."""

import json

import pytest
import yaml

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.axolotl import map_config
from tests.integration.test_cli_errors import check, run

CARD = get_device("h100-80gb")
FSDP1 = {"fsdp": ["full_shard", "auto_wrap"],  # (axolotl's examples/llama-2/qlora-fsdp.yml, 2026-07)
         "fsdp_config": {"fsdp_limit_all_gathers": True, "fsdp_sync_module_states": True, "fsdp_offload_params": True,
                         "fsdp_use_orig_params": False, "fsdp_cpu_ram_efficient_loading": True,
                         "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                         "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                         "fsdp_state_dict_type": "FULL_STATE_DICT"}}
FSDP2 = {"fsdp_version": 2,  # (examples/llama-3/3b-fp8-fsdp2.yaml's, its checkpointing on, resharding off)
         "fsdp_config": {"offload_params": False, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                         "transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "state_dict_type": "FULL_STATE_DICT",
                         "sharding_strategy": "FULL_SHARD", "reshard_after_forward": False,
                         "activation_checkpointing": True}}
BASE = {"base_model": "NousResearch/Llama-2-7b-hf", "sequence_len": 512, "micro_batch_size": 2, "bf16": True}


def test_fsdp1_with_offload_is_fsdp2_with_offload_said():
    c = map_config({**BASE, **FSDP1}, "q.yml", CARD)
    assert (c.plan.shard, c.plan.reshard_after_forward, c.plan.shard_offload) == ("fsdp", True, True)
    assert c.plan.world_size == 1 and c.ranks_from_launcher  # (the launcher's ranks: --world-size gives them)
    assert [w for w in c.warnings if "FSDP1" in w] and not [w for w in c.warnings if "not mapped" in w]


def test_fsdp2s_own_keys():
    c = map_config({**BASE, **FSDP2}, "q.yml", CARD)
    assert (c.plan.shard, c.plan.reshard_after_forward, c.plan.shard_offload, c.plan.checkpointing) == \
        ("fsdp", False, False, "blocks")
    assert c.warnings == ()
    grad_op = map_config({**BASE, "fsdp": ["shard_grad_op", "auto_wrap"]}, "q.yml", CARD)
    assert grad_op.plan.reshard_after_forward is False
    moe = map_config({**BASE, **FSDP2, "fsdp_config": {**FSDP2["fsdp_config"],
                                                      "transformer_layer_cls_to_wrap": "MixtralSparseMoeBlock"}},
                     "q.yml", CARD)
    assert any("MixtralSparseMoeBlock: memfit shards each repeated block" in w for w in moe.warnings)


@pytest.mark.parametrize("fields,message", [
    ({"fsdp": ["hybrid_shard"], "fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD"}},
     "fsdp sharding_strategy HYBRID_SHARD is not one memfit predicts"),
    ({"fsdp_config": "full_shard"}, "fsdp_config must be a mapping of FSDP options"),
])
def test_what_memfit_does_not_shard_is_one_line(fields, message):
    with pytest.raises(UserError, match=message):
        map_config({**BASE, **fields}, "q.yml", CARD)


def test_on_the_command_line_the_ranks_come_from_world_size(tmp_path):
    """Without --world-size, one line (the config does not count its ranks); with it, one rank of FSDP2 over them."""
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
        "max_position_embeddings": 128}))
    config = tmp_path / "fsdp.yml"
    config.write_text(yaml.safe_dump({**BASE, **FSDP2, "base_model": str(folder), "sequence_len": 64}))
    argv = ["estimate", "--from", str(config), "--device", "cpu"]
    rc, _, err = run(argv)
    check(argv, rc, err)
    assert rc == 2 and "fsdp: the ranks come from the launcher" in err and "--world-size N" in err
    argv += ["--world-size", "2", "--json"]
    rc, out, err = run(argv)
    check(argv, rc, err)
    report = json.loads(out)
    assert rc == 0 and report["plan"]["shard"] == "fsdp" and report["plan"]["world_size"] == 2
    assert report["plan"]["reshard_after_forward"] is False and report["breakdown"]["communication"] > 0
    assert report["batch_size"] == 2 * BASE["micro_batch_size"]  # (axolotl's micro_batch_size is each GPU's)


def test_max_world_size_gives_each_rank_the_configs_batch(tmp_path, monkeypatch):
    """``plan --from --max-world-size``: axolotl's micro_batch_size is each GPU's, so 2 ranks plan a batch of twice it
    (they planned the config's batch split over the ranks before, as --world-size did until 2026-12-05). The searches
    are stood in for (a real one is 15 s a world size here): what matters is the batch each is asked for."""
    import types

    import memfit.planner.search
    asked = []

    def search(workload, *, batch_size, fixed, **kwargs):
        asked.append((fixed.get("world_size", 1), batch_size))
        return types.SimpleNamespace(chosen=None, to_json=lambda: {"batch_size": batch_size})

    monkeypatch.setattr(memfit.planner.search, "plan", search)
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump({**BASE, "base_model": "llama"}))
    argv = ["plan", "--from", str(config), "--device", "h100-80gb", "--max-world-size", "4", "--json"]
    rc, out, err = run(argv)
    check(argv, rc, err)
    assert rc == 1 and asked == [(1, 2), (2, 4), (4, 8)]  # (4 did not divide the batch of 2: never tried before)
    assert json.loads(out)["world_sizes_tried"] == [1, 2, 4]
