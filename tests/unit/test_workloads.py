import pytest
import torch

from memfit.errors import UserError
from memfit.workload import Workload
from memfit.workloads import builtin_names, load_workload


def test_builtins_listed():
    assert {"gpt2", "llama", "bert", "t5", "vit", "cnn", "lstm", "transformer", "mha", "dit"} <= set(builtin_names())


def test_overrides_and_seq_len():
    wl = load_workload("gpt2:n_layer=3,n_embd=64,n_head=2", seq_len=32)
    assert wl.info.config["n_layer"] == 3 and wl.info.seq_len == 32
    assert wl.batch(2)["input_ids"].shape == (2, 32)
    llama = load_workload("llama")
    assert llama.info.config["hidden"] == 4096 and llama.info.config["layers"] == 32  # Llama-2-7B sizes


def test_fields_a_config_derives_follow_the_overrides():
    """LlamaConfig derives head_dim = hidden_size // num_attention_heads in its constructor: an override
    of hidden_size must not leave the default's 128 (q_proj would be 4096 -> 64 x 32 heads x 128 wide)."""
    wl = load_workload("llama:num_hidden_layers=1,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
                       "intermediate_size=128,vocab_size=100")
    with torch.device("meta"):
        model = wl.model()
    assert model.config.head_dim == 16 and model.config.use_cache is False
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features) == (64, 32)


@pytest.mark.parametrize("spec,match", [
    ("nosuch", "unknown workload"),
    ("qlora.yml", r"axolotl config is read with --from: memfit estimate --from qlora\.yml"),
    ("configs/qlora.yaml", r"memfit estimate --from configs/qlora\.yaml \(or plan --from\)"),
    ("gpt2:nlayer=3", "no field 'nlayer'"),
    ("gpt2:n_layer", "key=value"),
    ("cnn:widht=3", "unknown field"),
    ("gpt2:n_layer=abc", r"gpt2: n_layer must be an int \(a whole number\), got 'abc'; write e.g. gpt2:n_layer=12"),
    ("gpt2:n_layer=true", "n_layer must be an int"),
    ("gpt2:activation_function=1", "activation_function must be a string"),
    ("llama:no_such_field=1", "LlamaConfig has no field 'no_such_field'"),
    ("vit:image_size=abc", "ViTConfig refuses image_size='abc'"),
    ("mha:dim=abc", "mha: dim must be an int"),
    ("mha:heads=3", "dim=128 must be divisible by heads=3"),
    ("dit:patch=3", "image_size=16 must be divisible by patch=3"),
    ("cnn:depth=0", "depth must be a whole number >= 1"),
    ("transformer:dropout=1", r"dropout must be in \[0, 1\)"),
])
def test_bad_specs(spec, match):
    with pytest.raises(UserError, match=match):
        load_workload(spec)


def test_seq_len_checks():
    with pytest.raises(UserError, match="n_positions"):
        load_workload("gpt2", seq_len=4096)
    with pytest.raises(UserError, match="image"):
        load_workload("vit", seq_len=16)


def test_file_workloads(tmp_workload_file):
    body = '''
import torch
from memfit import Workload
def make():
    return Workload(model=lambda: torch.nn.Linear(4, 4), batch=lambda n: torch.randn(n, 4),
                    loss=lambda m, x: m(x).sum())
WL = make()
NOT_A_WORKLOAD = 3
def returns_other():
    return 3
def raises():
    raise RuntimeError("boom")
'''
    p = tmp_workload_file(body)
    assert isinstance(load_workload(f"{p}:WL"), Workload)
    assert isinstance(load_workload(f"{p}:make"), Workload)
    for name, match in [("MISSING", "has no 'MISSING'"), ("NOT_A_WORKLOAD", "not a Workload"),
                        ("returns_other", "returned a int"), ("raises", "raised RuntimeError: boom")]:
        with pytest.raises(UserError, match=match):
            load_workload(f"{p}:{name}")
    with pytest.raises(UserError, match="names no object"):
        load_workload(str(p))
    bad = tmp_workload_file("raise ImportError('nope')\n", "bad.py")
    with pytest.raises(UserError, match="while importing"):
        load_workload(f"{bad}:X")


def test_module_workloads(tmp_path, monkeypatch):
    """``package.module:NAME`` imports an installed module, as ``python -m`` names one; a missing
    module, a missing ``:NAME`` and a failing import each get one line."""
    pkg = tmp_path / "wlpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cases.py").write_text(
        "import torch\nfrom memfit import Workload\n"
        "def tiny():\n    return Workload(model=lambda: torch.nn.Linear(4, 4), "
        "batch=lambda n: torch.randn(n, 4), loss=lambda m, x: m(x).sum())\n")
    (pkg / "broken.py").write_text("raise ImportError('nope')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    wl = load_workload("wlpkg.cases:tiny")
    assert isinstance(wl, Workload) and wl.name == "wlpkg.cases:tiny"
    assert isinstance(load_workload("memfit.workloads.gpu_cases:mlp"), Workload)  # the GPU rows' cases
    for spec, match in [("wlpkg.nothere:tiny", "no module 'wlpkg.nothere'"),
                        ("nopkg_at_all.cases:tiny", "no module"),
                        ("wlpkg.cases", "names no object"),
                        ("wlpkg.cases:MISSING", "has no 'MISSING'"),
                        ("wlpkg.broken:X", "while importing")]:
        with pytest.raises(UserError, match=match):
            load_workload(spec)
    # built-ins with overrides are not module names
    assert load_workload("gpt2:n_layer=1").name.startswith("gpt2")


def test_default_optimizer_is_adamw():
    wl = Workload(model=lambda: torch.nn.Linear(2, 2), batch=lambda n: torch.randn(n, 2), loss=lambda m, x: m(x).sum())
    opt = wl.build_optimizer(torch.nn.Linear(2, 2).parameters())
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 1e-4


def test_override_values_are_converted_where_lossless():
    from memfit.workloads.hf import _config
    assert _config("GPT2Config", "gpt2", {"layer_norm_epsilon": 1}).layer_norm_epsilon == 1.0  # 5.x refuses int
    assert _config("GPT2Config", "gpt2", {"layer_norm_epsilon": "1e-6"}).layer_norm_epsilon == 1e-6  # YAML text
    assert load_workload("transformer:dropout=0").info.config["dropout"] == 0.0


def test_override_types_without_dataclass_configs(monkeypatch):
    """transformers 4.x configs are plain classes that accept any value: the default's type decides."""
    from types import SimpleNamespace

    from memfit.workloads import hf

    class OldConfig:  # a 4.x-style config: attributes, no annotations, no validation
        def __init__(self, **kwargs):
            self.n_layer, self.layer_norm_epsilon, self.activation_function = 12, 1e-5, "gelu_new"
            self.scale_attn_weights, self.n_inner = True, None
            for key, value in kwargs.items():
                setattr(self, key, value)

    monkeypatch.setattr(hf, "_transformers", lambda: SimpleNamespace(GPT2Config=OldConfig))
    with pytest.raises(UserError, match="gpt2: n_layer must be an int .* got 'abc'"):
        hf._config("GPT2Config", "gpt2", {"n_layer": "abc"})
    with pytest.raises(UserError, match="scale_attn_weights must be a bool"):
        hf._config("GPT2Config", "gpt2", {"scale_attn_weights": 2})
    config = hf._config("GPT2Config", "gpt2", {"layer_norm_epsilon": 1, "n_inner": 64})
    assert config.layer_norm_epsilon == 1.0 and isinstance(config.layer_norm_epsilon, float) and config.n_inner == 64


def test_what_the_config_class_refuses_names_the_field(monkeypatch):
    from types import SimpleNamespace

    from memfit.workloads import hf

    class StrictConfig:  # refuses on setattr, as transformers 5.x's strict dataclasses do
        def __init__(self):
            object.__setattr__(self, "rope", {"theta": 1.0})

        def __setattr__(self, key, value):
            if key == "rope" and not isinstance(value, dict):
                raise TypeError(f"Field 'rope' expected dict, got {type(value).__name__}")
            object.__setattr__(self, key, value)

    monkeypatch.setattr(hf, "_transformers", lambda: SimpleNamespace(StrictConfig=StrictConfig))
    with pytest.raises(UserError, match="gpt2: StrictConfig refuses rope=3 .*expected dict"):
        hf._config("StrictConfig", "gpt2", {"rope": 3})


def test_builtin_failures_name_the_overrides():
    import torch
    wl = load_workload("gpt2:n_layer=1,n_embd=30,n_head=4")
    with pytest.raises(UserError, match="gpt2:n_layer=1,n_embd=30,n_head=4: building the model failed with "
                                        "ValueError"):
        with torch.device("meta"):
            wl.model()
    wl = load_workload("gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=0", seq_len=8)
    with pytest.raises(UserError, match="batch\\(batch_size\\) failed with RuntimeError"):
        wl.batch(2)
    plain = load_workload("mha")  # no overrides: a failure is memfit's own bug, reported as raised
    with pytest.raises(TypeError):
        plain.loss(None, None)
