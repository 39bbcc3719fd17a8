"""PEFT adapter checkpoints (NOTE [ Adapter checkpoints ]): a LoRA's folder or hub id trains that LoRA
on the base model its adapter_config.json names, in every plan; a pre-quantized base keeps its format
in every plan the planner weighs (it planned full-precision weights before)."""

import json

import pytest

from memfit.cli.main import main
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads import load_workload

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
         "max_position_embeddings": 64}
NF4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
LORA = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "task_type": "CAUSAL_LM",
        "target_modules": ["v_proj", "q_proj"], "modules_to_save": None, "use_dora": False}
VALUE = "lora:r=8,alpha=16,targets=q_proj+v_proj,dropout=0.05"


def write(folder, name, data) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data))
    return str(folder)


def test_an_adapter_folder_trains_its_lora_on_its_base(tmp_path):
    base = write(tmp_path / "base", "config.json", LLAMA)
    adapter = write(tmp_path / "lora", "adapter_config.json", {**LORA, "base_model_name_or_path": base})
    wl = load_workload(adapter, seq_len=16)
    assert wl.info.adapter == VALUE and wl.name == adapter
    ours = estimate(adapter, Plan(), batch_size=2, seq_len=16)
    assert ours.plan["adapter"] == VALUE
    assert ours.peak_bytes == estimate(base, Plan(adapter=VALUE), batch_size=2, seq_len=16).peak_bytes
    r = profile(adapter, Plan(), batch_size=2, seq_len=16, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_a_hub_adapter_over_a_pre_quantized_hub_base_is_a_qlora(hub_cache, no_network):
    hub_cache("acme/llama-bnb-4bit", {**LLAMA, "quantization_config": NF4})
    hub_cache("acme/llama-qlora", None, files={"adapter_config.json": {**LORA, "use_dora": True,
                                                                       "base_model_name_or_path": "acme/llama-bnb-4bit"}})
    plan = estimate("acme/llama-qlora", Plan(), batch_size=2, seq_len=16).plan
    assert plan["base_weights"] == "nf4" and plan["adapter"] == VALUE.replace("lora:", "dora:")


def test_the_planner_keeps_a_checkpoints_own_format_and_adapter_in_every_plan(tmp_path):
    """Before, ``memfit plan`` of a pre-quantized checkpoint chose base_weights as-is: full-precision
    weights it cannot load."""
    from memfit.planner.search import plan
    base = write(tmp_path / "base", "config.json", {**LLAMA, "quantization_config": NF4})
    adapter = write(tmp_path / "lora", "adapter_config.json", {**LORA, "base_model_name_or_path": base})
    kw = dict(budget="2GiB", device="h100-80gb", batch_size=2, seq_len=16, max_traces=6, optimizers=("adamw",),
              compile_modes=("none",))
    for spec, given, adapted in ((base, {"adapter": "lora:r=4"}, "lora:r=4"), (adapter, {}, VALUE)):
        result = plan(spec, fixed={"precision": "bf16-pure", **given}, **kw)
        assert {(c.plan.base_weights, c.plan.adapter) for c in result.candidates} == {("nf4", adapted)}
    # without an adapter it trains none of its quantized weights: one line, as transformers' Trainer refuses it
    from memfit.errors import UserError
    with pytest.raises(UserError, match=r"pre-quantized checkpoint \(nf4\).*without an adapter.*add --adapter lora:r=16"):
        plan(base, fixed={"precision": "bf16-pure"}, **kw)


@pytest.mark.parametrize("config,args,error", [
    ({**LORA, "peft_type": "IA3"}, [], "a IA3 adapter (adapter_config.json's peft_type); memfit trains LoRA and DoRA"),
    ({**LORA, "rank_pattern": {"q_proj": 4}}, [], "gives layers their own ranks (rank_pattern/alpha_pattern)"),
    ({**LORA, "base_model_name_or_path": None}, [], "names no base_model_name_or_path"),
    (LORA, ["--adapter", "lora:r=4"], f"is an adapter checkpoint ({VALUE}, its adapter_config.json): its adapter is "
                                      f"{VALUE}, not lora:r=4; drop --adapter"),
], ids=["ia3", "rank-pattern", "no-base", "another-adapter"])
def test_what_an_adapter_checkpoint_cannot_be_is_one_line(tmp_path, capsys, config, args, error):
    base = write(tmp_path / "base", "config.json", LLAMA)
    adapter = write(tmp_path / "lora", "adapter_config.json", {"base_model_name_or_path": base, **config})
    assert main(["estimate", adapter, "--seq-len", "16", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and error in err, err


def test_fit_refuses_an_adapter_checkpoint_and_a_pre_quantized_ones_full_methods_in_one_line(tmp_path, capsys):
    """fit's table compares methods of a base model: an adapter checkpoint has one, a pre-quantized one
    trains only an adapter over its own format (its full column showed full-precision weights before)."""
    base = write(tmp_path / "base", "config.json", {**LLAMA, "quantization_config": NF4})
    adapter = write(tmp_path / "lora", "adapter_config.json", {**LORA, "base_model_name_or_path": base})
    for args, error in ((["fit", adapter, "--seq-len", "16"], "is an adapter checkpoint (lora:r=8"),
                        (["fit", base, "--seq-len", "16", "--methods", "full,qlora"],
                         "is a pre-quantized checkpoint (nf4); only qlora or qdora trains it")):
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and error in err, err
