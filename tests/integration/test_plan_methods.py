"""memfit plan --methods: full fine-tuning and adapters side by side, only when asked."""

from __future__ import annotations

import json

import pytest
from test_cli_errors import run

from memfit.errors import UserError
from memfit.planner.methods import parse_methods

pytest.importorskip("peft")

TINY = ("llama:num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
        "num_key_value_heads=4,vocab_size=500")


def test_methods_are_ranked_side_by_side_and_said_to_train_different_things():
    code, out, _ = run(["plan", TINY, "--seq-len", "32", "-b", "2", "--methods", "full,lora", "--device",
                        "h100-80gb", "--max-traces", "4", "--optimizers", "adamw", "--json"])
    assert code == 0
    data = json.loads(out)
    assert "train different things" in data["note"]
    rows = {m["method"]: m for m in data["methods"]}
    assert rows["full"]["chosen"]["plan"]["adapter"] == "none"
    assert rows["lora"]["chosen"]["plan"]["adapter"] == "lora:r=16"
    # 1 layer x (q_proj, v_proj) x r=16 x (64 in + 64 out)
    assert rows["lora"]["trainable_parameters"] == 2 * 16 * 128
    assert rows["full"]["trainable_parameters"] > 20 * rows["lora"]["trainable_parameters"]


def test_the_planner_never_changes_the_method_by_itself():
    code, out, _ = run(["plan", TINY, "--seq-len", "32", "-b", "2", "--device", "h100-80gb", "--max-traces", "4",
                        "--optimizers", "adamw", "--json"])
    assert code == 0
    ranked = json.loads(out)["ranked"]
    assert ranked and all(r["plan"]["adapter"] == "none" and r["plan"]["base_weights"] == "as-is" for r in ranked)


def test_methods_take_the_users_adapter_settings():
    methods = {m.name: m.keys for m in parse_methods("lora,dora,qlora", "lora:r=4,targets=q_proj")}
    assert methods["lora"] == {"adapter": "lora:r=4,targets=q_proj", "base_weights": "as-is"}
    assert methods["dora"]["adapter"] == "dora:r=4,targets=q_proj"
    assert methods["qlora"] == {"adapter": "lora:r=4,targets=q_proj", "base_weights": "nf4"}


@pytest.mark.parametrize("text,problem", [("full,prefix", "unknown method 'prefix'"), ("lora,lora", "named twice"),
                                          (",", "give some of")])
def test_bad_methods_get_one_line(text, problem):
    with pytest.raises(UserError, match=problem):
        parse_methods(text)
    code, _, err = run(["plan", TINY, "--methods", text])
    assert code == 2 and problem.split("'")[0] in err and err.count("\n") <= 1
