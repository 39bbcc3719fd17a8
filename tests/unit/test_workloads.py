import pytest
import torch

from memfit.errors import UserError
from memfit.workload import Workload, load_workload
from memfit.workloads import builtin_names


def test_builtins_listed():
    assert {"gpt2", "llama", "bert", "t5", "vit", "cnn", "lstm", "transformer", "mha", "dit"} <= set(builtin_names())


def test_overrides_and_seq_len():
    wl = load_workload("gpt2:n_layer=3,n_embd=64,n_head=2", seq_len=32)
    assert wl.info["n_layer"] == 3 and wl.info["seq_len"] == 32
    assert wl.batch(2)["input_ids"].shape == (2, 32)
    llama = load_workload("llama")
    assert llama.info["hidden"] == 4096 and llama.info["layers"] == 32  # Llama-2-7B sizes


@pytest.mark.parametrize("spec,match", [
    ("nosuch", "unknown workload"),
    ("gpt2:nlayer=3", "no field 'nlayer'"),
    ("gpt2:n_layer", "key=value"),
    ("cnn:widht=3", "unknown field"),
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


def test_default_optimizer_is_adamw():
    wl = Workload(model=lambda: torch.nn.Linear(2, 2), batch=lambda n: torch.randn(n, 2), loss=lambda m, x: m(x).sum())
    opt = wl.build_optimizer(torch.nn.Linear(2, 2).parameters())
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 1e-4
