import json

import pytest

from memfit.errors import UserError
from memfit.plans import Plan
from memfit.techniques.ema import EMA


def test_defaults_and_roundtrip(tmp_path):
    plan = Plan(precision="bf16", micro_batch_size=2, offload=["activations"], ema={"decay": 0.99})
    assert plan.offload == ("activations",)
    assert plan.ema == EMA(decay=0.99)
    for name in ("p.yaml", "p.json"):
        path = tmp_path / name
        plan.save(path)
        assert Plan.load(path) == plan


def test_plan_is_frozen():
    import dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        Plan().precision = "bf16"


@pytest.mark.parametrize("data,match", [
    ({"precison": "bf16"}, "unknown key"),
    ({"precision": "fp8"}, "precision 'fp8' is not valid"),
    ({"checkpointing": "blocks:every=0"}, "N >= 1"),
    ({"checkpointing": "some"}, "checkpointing 'some'"),
    ({"checkpointing": "budget:1.5"}, "fraction"),
    ({"grad_accum_steps": 0}, "grad_accum_steps"),
    ({"micro_batch_size": -1}, "micro_batch_size"),
    ({"offload": ["gradients"]}, "offload 'gradients'"),
    ({"ema": {"decay": 2}}, "ema"),
    ({"ema": {"decay": "x"}}, "decay='x'"),
    ({"ema": {"every": 1.5}}, "every=1.5"),
    ({"optimizer_in_backward": True, "grad_accum_steps": 4}, "cannot accumulate"),
    ({"optimizer_in_backward": True, "precision": "fp16"}, "fp16"),
])
def test_bad_plans_name_the_problem(data, match):
    with pytest.raises(UserError, match=match):
        Plan.from_dict(data)


def test_bad_plan_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("precision: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        Plan.load(p)
    p.write_text('model:\n  name: "a quote not closed\n  arch: "x"\n')  # (ai-toolkit's omnigen2 example, 2026-08)
    with pytest.raises(UserError, match=r"not valid YAML: line 3, column 10: expected <block end>, but found '<scalar>'$"):
        Plan.load(p)
    q = tmp_path / "broken.json"
    q.write_text('{"precision": "bf16",\n "compile" "full"}')
    with pytest.raises(UserError, match=r"not valid JSON: line 2, column 12: Expecting ':' delimiter$"):
        Plan.load(q)
    q = tmp_path / "x.json"
    q.write_text(json.dumps({"precision": "bf16", "extra_key": 1}))
    with pytest.raises(UserError, match="unknown key.*extra_key"):
        Plan.load(q)
    with pytest.raises(UserError, match="not found"):
        Plan.load(tmp_path / "missing.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"precision: \xff\xfe")
    with pytest.raises(UserError, match="is not text"):
        Plan.load(binary)
    with pytest.raises(UserError, match="is a folder"):
        Plan.load(tmp_path)


def test_save_to_an_unwritable_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot write the plan"):
        Plan().save(tmp_path / "missing" / "plan.yaml")


def test_micro_batches():
    assert Plan().micro_batches(8) == (8, 1)
    assert Plan(micro_batch_size=2).micro_batches(8) == (2, 4)
    assert Plan(grad_accum_steps=4).micro_batches(8) == (2, 4)
    assert Plan(micro_batch_size=2, grad_accum_steps=4).micro_batches(8) == (2, 4)
    with pytest.raises(UserError, match="not a multiple"):
        Plan(micro_batch_size=3).micro_batches(8)
    with pytest.raises(UserError, match="give only one"):
        Plan(micro_batch_size=2, grad_accum_steps=2).micro_batches(8)
    with pytest.raises(UserError, match="not divisible"):
        Plan(grad_accum_steps=3).micro_batches(8)


def test_every_schema_field_is_implemented_and_budget_needs_compile():
    for plan in (Plan(compile="full", checkpointing="budget:0.5"), Plan(compile="blocks"),
                 Plan(precision="bf16", micro_batch_size=2, checkpointing="blocks", loss_chunks=4)):
        plan.check_implemented()
    with pytest.raises(UserError, match="needs compile"):
        Plan(checkpointing="budget:0.5")


def test_plan_is_written_and_its_field_order_is_the_build_order():
    """Plan's fields are written in memfit/plans.py (readable, typed); every technique's keys are
    fields, and the order of the fields is the order build_step applies the configs in."""
    import ast
    import dataclasses
    import inspect
    import typing

    import memfit.plans as plans
    from memfit.techniques import KEYS

    written = [node.target.id for node in ast.parse(inspect.getsource(plans.Plan)).body[0].body
               if isinstance(node, ast.AnnAssign)]
    fields = [f.name for f in dataclasses.fields(Plan) if f.init]
    assert written[:len(fields)] == fields and sorted(fields) == sorted(KEYS)
    hints = typing.get_type_hints(Plan, vars(plans))
    assert hints["micro_batch_size"] == int | None and hints["offload"] == tuple[str, ...]
    built = [cfg.technique.name for cfg in Plan(checkpointing="blocks", loss_chunks=2).techniques]
    firsts = []
    for name in fields:
        technique = KEYS[name][0].name
        if technique not in firsts:
            firsts.append(technique)
    assert built == firsts
    assert built.index("adapter") < built.index("precision") < built.index("checkpointing")


def test_a_plan_says_how_it_changes_numerics():
    assert Plan().numerics == () and Plan(precision="bf16", checkpointing="blocks", loss_chunks=4).numerics == ()
    lossy = Plan(precision="bf16-pure", optimizer="adamw4bit-ao", bf16_update="stochastic")
    assert lossy.numerics == ("bf16 weights (no fp32 master copy)", "4-bit AdamW states",
                              "stochastic rounding of bf16 updates")
    assert Plan(optimizer="adamw8bit").numerics == ("8-bit AdamW states",)


def test_qlora_is_a_lora_over_nf4_base_weights(tmp_path):
    """``adapter: qlora`` (what people type) is the two keys it means, in a plan, a plan file and on the command
    line; base weights that contradict it are one line (NOTE [ qlora as an adapter ])."""
    from memfit.planner.methods import parse_methods
    assert Plan(adapter="qlora:r=64,alpha=16") == Plan(adapter="lora:r=64,alpha=16", base_weights="nf4")
    assert Plan(adapter="qdora") == Plan(adapter="dora", base_weights="nf4")
    assert Plan(adapter="qlora", base_weights="nf4:double_quant=true").base_weights == "nf4:double_quant=true"
    path = tmp_path / "p.yaml"
    path.write_text("adapter: qlora:r=8\n")
    assert Plan.load(path) == Plan(adapter="lora:r=8", base_weights="nf4")
    assert Plan.load(path).to_dict()["adapter"] == "lora:r=8"  # (written back as the two keys)
    with pytest.raises(UserError, match="adapter qlora is a LoRA over 4-bit base weights, and base_weights is int8"):
        Plan(adapter="qlora", base_weights="int8")
    lora, qlora = parse_methods("lora,qlora", "qlora:r=8")  # (fit --adapter qlora:r=8: the methods' rank)
    assert (lora.keys, qlora.keys) == ({"adapter": "lora:r=8", "base_weights": "as-is"},
                                       {"adapter": "lora:r=8", "base_weights": "nf4"})


@pytest.mark.parametrize("key,theirs,said", [
    ("optimizer", "paged_adamw_8bit", "did you mean optimizer adamw8bit-paged?"),
    ("precision", "bfloat16", "did you mean precision bf16?"),
    ("precision", "bf16-true", "did you mean precision bf16-pure (Lightning's bf16-true"),
    ("base_weights", "4bit", "did you mean base_weights nf4 (QLoRA's"),
    ("checkpointing", "full", "did you mean checkpointing blocks (each repeated block)?"),
])
def test_another_tools_value_is_refused_with_the_one_meant(key, theirs, said):
    with pytest.raises(UserError) as e:
        Plan(**{key: theirs})
    assert str(e.value).startswith(f"plan: {key} '{theirs}' is not valid; ") and f"; {said}" in str(e.value)
    with pytest.raises(UserError) as e:
        Plan(precision="fp8")
    assert "did you mean" not in str(e.value)


def test_every_value_meant_is_one_memfit_takes():
    from memfit.plans import technique_of
    from memfit.synonyms import SYNONYMS
    for key, table in SYNONYMS.items():
        for ours in table.values():
            value = ours.split()[0]
            assert technique_of(key).config({key: value}) is not None, (key, value)
