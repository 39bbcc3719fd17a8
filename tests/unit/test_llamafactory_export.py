"""A plan as a LLaMA-Factory config's fields (memfit.integrations.llamafactory_export): each one read back by
``--from`` (memfit.integrations.llamafactory) is the same plan; what LLaMA-Factory cannot carry is listed."""

import json

import pytest

from memfit.devices import get_device
from memfit.integrations.llamafactory import map_config
from memfit.integrations.llamafactory_export import to_llamafactory
from memfit.plans import Plan

CARD = get_device("rtx4090")
ALL = "lora:r=8,alpha=16,targets=linear-modules"


@pytest.mark.parametrize("fields", [
    dict(adapter=ALL, base_weights="nf4:double_quant=true", precision="bf16-base", checkpointing="blocks",
         micro_batch_size=2, max_grad_norm=1.0),
    dict(adapter="lora:r=16,alpha=16,targets=q_proj+v_proj,dropout=0.05,save=lm_head", base_weights="int8",
         precision="fp16-base", checkpointing="blocks", offload=("activations",), optimizer="adamw8bit-paged"),
    dict(adapter="dora:r=4,alpha=8,targets=linear-modules", base_weights="fp4", precision="bf16-pure",
         checkpointing="none", compile="full", max_grad_norm=0.3),
    dict(adapter=ALL, precision="bf16-base-noautocast", checkpointing="blocks", optimizer="adafactor"),
    dict(precision="bf16", checkpointing="blocks", micro_batch_size=1, max_grad_norm=1.0),
    dict(precision="bf16-pure", checkpointing="blocks", optimizer="galore:rank=128,update_proj_gap=200,scale=2",
         optimizer_in_backward=True),
    dict(precision="bf16-pure", optimizer="galore8bit:rank=64,scale=0.25", max_grad_norm=1.0, checkpointing="blocks"),
    dict(precision="fp32", checkpointing="blocks", optimizer="apollo-mini", optimizer_in_backward=True),
    dict(precision="fp16", checkpointing="blocks", optimizer="apollo:rank=32,update_proj_gap=100,scale=1"),
    dict(adapter=ALL, precision="bf16-base", checkpointing="blocks:reentrant=true"),
], ids=["qlora", "int8-lora-paged", "dora-fp4-pure-compiled", "lora-no-autocast", "full-autocast", "galore-layerwise",
        "galore8bit", "apollo-mini-layerwise", "apollo-fp16", "lora-reentrant"])
def test_each_plan_reads_back_as_itself(fields):
    plan = Plan(**fields)
    out = to_llamafactory(plan, 8, "org/model", 2048, CARD)
    assert out.unmapped == ()
    back = map_config(json.loads(json.dumps(out.fields)), "exported.yaml", CARD)  # (plain data, as a YAML file holds)
    assert back.plan == plan and back.warnings == ()
    assert (back.workload, back.seq_len, back.batch_size) == ("org/model", 2048, 8)


def test_the_qlora_fields():
    out = to_llamafactory(Plan(adapter=ALL, base_weights="nf4:double_quant=true", precision="bf16-base",
                               checkpointing="blocks", micro_batch_size=2, max_grad_norm=1.0), 16, "Qwen/Qwen2.5-7B",
                          2048, CARD)
    assert out.fields == {
        "model_name_or_path": "Qwen/Qwen2.5-7B", "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "lora_rank": 8, "lora_alpha": 16, "lora_target": "all", "quantization_bit": 4, "quantization_type": "nf4",
        "double_quantization": True, "cutoff_len": 2048, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 8, "use_reentrant_gc": False, "bf16": True, "max_grad_norm": 1.0}
    assert out.yaml().splitlines()[:2] == ["model_name_or_path: Qwen/Qwen2.5-7B", "stage: sft"]


def test_checkpointing_off_and_no_clipping_are_written_against_llamafactorys_defaults():
    """And axolotl's notes of what its own fields cannot say (clipping left at 1.0, double quantization always on) are
    not LLaMA-Factory's, whose fields say it."""
    out = to_llamafactory(Plan(adapter=ALL, precision="bf16-base", base_weights="nf4"), 4, "org/model", 512, CARD)
    assert out.fields["disable_gradient_checkpointing"] is True and out.fields["max_grad_norm"] == 0.0
    assert out.fields["double_quantization"] is False
    assert not any("clips at" in n or "double quantization" in n for n in out.notes), out.notes


@pytest.mark.parametrize("dtype, precision, carried", [
    ("float32", "fp32", {}), ("float32", "bf16", {"bf16": True}), ("float32", "bf16-base", None),
    ("bfloat16", "fp32", None), ("bfloat16", "bf16-base-noautocast", {}), ("float16", "fp16-base-noautocast", {}),
    ("float16", "bf16-base-noautocast", None),
])
def test_an_adapters_precision_follows_the_checkpoints_dtype(tmp_path, dtype, precision, carried):
    """LLaMA-Factory loads the checkpoint in its own dtype: an fp32 base is an fp32 checkpoint's, no flag set."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": dtype}))
    out = to_llamafactory(Plan(adapter=ALL, precision=precision, checkpointing="blocks"), 4, str(tmp_path), 512, CARD)
    flags = {k: v for k, v in out.fields.items() if k in ("bf16", "fp16", "pure_bf16")}
    if carried is None:
        assert out.unmapped[0].startswith(f"precision: {precision} (LLaMA-Factory loads the checkpoint in its own dtype")
    else:
        assert out.unmapped == () and flags == carried
        assert map_config(out.fields, "c.yaml", CARD).plan.precision == precision


@pytest.mark.parametrize("fields, listed", [
    (dict(adapter="lora:r=8,targets=all-linear"), "adapter: lora:r=8,targets=all-linear"),
    (dict(adapter="lora:r=8,targets=in-blocks"), "adapter: lora:r=8,targets=in-blocks"),
    (dict(adapter="lokr:r=8"), "adapter: lokr:r=8"),
    (dict(adapter=ALL, base_weights="nf4:experts=true"), "base_weights: nf4:experts=true"),
    (dict(adapter=ALL, base_weights="fp8"), "base_weights: fp8"),
    (dict(checkpointing="selective"), "checkpointing: selective"),
    (dict(optimizer_in_backward=True), "optimizer_in_backward: true"),
    (dict(offload=("optimizer_states",)), "offload: [optimizer_states]"),
])
def test_what_llamafactory_cannot_carry_is_listed(fields, listed):
    out = to_llamafactory(Plan(**{"precision": "bf16-base" if "adapter" in fields else "bf16", **fields}), 4,
                          "org/model", 512, CARD)
    assert any(u.startswith(listed) for u in out.unmapped), out.unmapped
    assert not any("axolotl" in line for line in (*out.unmapped, *out.notes))


def test_a_trainers_liger_slices_are_the_chunked_loss_it_searches(tmp_path):
    """The chunked loss the planner searches (8 slices) is not one LLaMA-Factory or axolotl runs: their only one is
    Liger's, in slices the model's width and vocabulary set (32 for Qwen2.5-7B at 4,096 tokens). ``--format
    llamafactory`` searches that one in its place (``search_values``), where the loss is chunked at all."""
    from memfit.cli.trainer_formats import LlamaFactoryTarget
    from memfit.planner.space import default_space, model_facts
    from memfit.workloads import load_workload
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 2048,
              "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    target = LlamaFactoryTarget(str(tmp_path), 4, "rtx4090", str(tmp_path), 256)
    assert target.search_values() == {"loss_chunks": [0, 32]}  # (1,024 tokens in slices of 32: 2,048 / 64 = 32)
    facts = model_facts(load_workload(str(tmp_path), seq_len=256))
    assert default_space(facts, CARD, 4).values["loss_chunks"] == [0, 8]
    space = default_space(facts, CARD, 4, search_values={**target.search_values(), "swap_blocks": [0, 1]})
    assert space.values["loss_chunks"] == [0, 32]
    assert space.values.get("swap_blocks", [0]) == default_space(facts, CARD, 4).values.get("swap_blocks", [0])
