"""Hub ids: ``memfit estimate org/name[@revision]`` reads config.json alone from the Hugging Face
cache (offline here: a cache laid out in a temporary HF_HOME, HF_HUB_OFFLINE=1, sockets refused)
and builds the same model as the equivalent model folder; an existing folder wins over an id."""

import json

import pytest

from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.workloads import load_workload
from memfit.workloads.hub import is_hub_id

GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
        "n_positions": 128, "vocab_size": 500}
ID = "acme/gpt2-toy"


def layers(spec: str) -> int:
    return load_workload(spec, seq_len=16).info.config["num_hidden_layers"]


def test_hub_id_estimates_as_its_folder_would(hub_cache, no_network, tmp_path):
    hub_cache(ID, GPT2)
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(GPT2))
    wl = load_workload(ID, seq_len=16)
    assert wl.name == ID and wl.info.config["model_class"] == "GPT2LMHeadModel"
    hub = estimate(ID, Plan(), batch_size=2, seq_len=16)
    folder = estimate(str(local), Plan(), batch_size=2, seq_len=16)
    assert hub.method == "fake" and hub.peak_bytes == folder.peak_bytes


def test_revisions_by_branch_and_commit(hub_cache, no_network):
    old, new = "1" * 40, "2" * 40
    hub_cache(ID, GPT2, commit=old, refs=("main",))
    hub_cache(ID, {**GPT2, "n_layer": 3}, commit=new, refs=("v2",))
    assert layers(ID) == 2 and layers(f"{ID}@main") == 2 and layers(f"hf:{ID}") == 2
    assert layers(f"{ID}@v2") == 3 and layers(f"{ID}@{new}") == 3 and layers(f"{ID}@{old}") == 2


def test_an_existing_folder_wins_over_a_hub_id(hub_cache, no_network, tmp_path, monkeypatch):
    hub_cache(ID, GPT2)
    (tmp_path / ID).mkdir(parents=True)
    (tmp_path / ID / "config.json").write_text(json.dumps({**GPT2, "n_layer": 1}))
    monkeypatch.chdir(tmp_path)
    assert layers(ID) == 1 and layers(f"hf:{ID}") == 1 and layers(f"./{ID}") == 1


def test_overrides_of_a_hub_ids_config_build_the_folder_that_has_them(hub_cache, no_network, tmp_path):
    """NOTE [ Overrides of a config.json ]: ``org/name:key=value`` is the hub id's config.json with those
    fields changed, as a folder holding that config.json (derived fields follow: GPT-2's head size)."""
    hub_cache(ID, GPT2)
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "config.json").write_text(json.dumps({**GPT2, "n_layer": 3, "n_embd": 128}))
    spec = f"{ID}:n_layer=3,n_embd=128"
    wl = load_workload(spec, seq_len=16)
    assert wl.name == spec and wl.info.config["num_hidden_layers"] == 3
    assert layers(f"hf:{ID}:n_layer=1") == 1 and layers(f"{edited}:n_layer=1") == 1
    hub = estimate(spec, Plan(), batch_size=2, seq_len=16)
    assert hub.method == "fake" and hub.peak_bytes == estimate(str(edited), Plan(), batch_size=2, seq_len=16).peak_bytes
    assert hub.peak_bytes > estimate(ID, Plan(), batch_size=2, seq_len=16).peak_bytes


def test_an_override_takes_transformers_aliases_class_fields_nested_fields_and_numbers(hub_cache, no_network):
    """As ``from_pretrained`` reads them: GPT-2's ``num_hidden_layers`` is ``n_layer``; a field the file
    leaves at its class default; a nested field; ``1e-6`` a number, not YAML 1.1's string."""
    hub_cache(ID, {**GPT2, "task_specific_params": {"text-generation": {"max_length": 50}}})
    spec = f"{ID}:num_hidden_layers=3,layer_norm_epsilon=1e-6,task_specific_params.text-generation.max_length=60"
    config = load_workload(spec, seq_len=16).model().config
    assert config.n_layer == 3 and config.layer_norm_epsilon == 1e-6
    assert config.task_specific_params == {"text-generation": {"max_length": 60}}


@pytest.mark.parametrize("spec,split", [
    ("path/to/file.py:NAME", ("path/to/file.py:NAME", "")), ("pkg.mod:NAME", ("pkg.mod:NAME", "")),
    ("gpt2:n_layer=2", ("gpt2", "n_layer=2")), ("org/name@refs/pr/1:n_layer=2", ("org/name@refs/pr/1", "n_layer=2")),
    ("./d:n=2,m=a/b", ("./d", "n=2,m=a/b")), ("org/name", ("org/name", ""))])
def test_where_a_spec_s_overrides_begin(spec, split):
    from memfit.workloads.config_overrides import split_overrides
    assert split_overrides(spec) == split


def test_overrides_parse_lists_and_numbers_as_the_fields_hold_them():
    from memfit.workloads.config_overrides import apply_overrides, parse_overrides
    data = {"axes": [16, 56, 56], "rope_theta": 10000.0, "max_position_embeddings": 4096, "name": "x"}
    out = apply_overrides(data, parse_overrides("axes=8/28/28,rope_theta=1e6,max_position_embeddings=3e4,name=1e3",
                                                "cfg"), "cfg")
    assert out == {"axes": [8, 28, 28], "rope_theta": 1e6, "max_position_embeddings": 30000, "name": "1e3"}
    assert data["axes"] == [16, 56, 56]  # (the file's object is left as it was)


@pytest.mark.parametrize("spec,message", [
    (f"{ID}:n_layr=3", r"hub model acme/gpt2-toy: its config has no field 'n_layr' \(did you mean n_layer\?\); "
                       r"name a field of its config\.json or of its config class$"),
    (f"{ID}:text_config.n_layer=3", r"has no nested config 'text_config' for the override text_config\.n_layer"),
    (f"{ID}:n_layer=3,oops", r"malformed override 'oops' for acme/gpt2-toy"),
    (f"{ID}:n_embd=65", r"hub model acme/gpt2-toy: building the model failed .*divisible.*; change the overrides$"),
])
def test_a_bad_override_of_a_hub_ids_config_is_one_line(hub_cache, no_network, spec, message):
    from memfit.errors import UserError
    hub_cache(ID, GPT2)
    with pytest.raises(UserError, match=message):
        estimate(spec, Plan(), batch_size=2, seq_len=16)


@pytest.mark.parametrize("text,hub", [("meta-llama/Llama-3.1-8B", True), ("org/name@refs/pr/1", True),
                                      ("./org/name", False), ("/abs/path", False), ("~/models/x", False),
                                      ("dir/wl.py", False), ("org/config.json", False), ("gpt2", False),
                                      ("a/b/c", False), ("../org/name", False)])
def test_what_reads_as_a_hub_id(text, hub):
    assert is_hub_id(text) is hub


ERRORS = [
    ("acme/missing", r"hub model acme/missing: config\.json is not in the Hugging Face cache \(.*hf-home/hub\) "
                     r"and HF_HUB_OFFLINE is set \(and no folder acme/missing here\); run `hf download "
                     r"acme/missing config\.json`"),
    (f"{ID}@nope", rf"hub model {ID}@nope: config\.json is not in the Hugging Face cache"),
    ("hf:meta-llama/Meta-Llama-3-8B", "hub model meta-llama/Meta-Llama-3-8B: config.json is not in the Hugging "
                                      "Face cache"),
]
