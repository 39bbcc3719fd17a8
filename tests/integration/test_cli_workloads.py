"""Workloads named on the command line: hub ids from the Hugging Face cache and model folders, and
one-line errors naming the fix."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from memfit.cli.main import main
from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.workloads import load_workload
from tests.unit.test_workloads_hub import ERRORS, GPT2, ID
from tests.unit.test_workloads_local_hf import BAD, folder

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("spec,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_uncached_ids_offline_are_one_line_naming_the_fix(hub_cache, no_network, capsys, spec, message):
    hub_cache(ID, GPT2)
    for command in (["estimate"], ["plan", "--budget", "1GiB", "--max-traces", "2"]):
        code = main([*command, spec, "-b", "2", "--seq-len", "16"])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"memfit {command[0]}: error: "), err
        assert re.search(message, lines[0]), lines[0]
    with pytest.raises(UserError):
        load_workload(spec)


def test_cli_reads_a_hub_id_from_hf_home_in_a_fresh_process(hub_cache, tmp_path):
    """The environment alone (HF_HOME, HF_HUB_OFFLINE=1) points a fresh process at the cache."""
    home = hub_cache(ID, GPT2)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-m", "memfit.cli.main", "estimate", ID, "-b", "2", "--seq-len", "16",
                          "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    peak = json.loads(out.stdout)["peak_bytes"]
    assert peak == estimate(ID, Plan(), batch_size=2, seq_len=16).peak_bytes


def test_no_network_and_no_cache_is_one_line_naming_the_fix(hub_cache, monkeypatch, capsys):
    """Online mode, but the hub's name does not resolve (this machine): the hub library retries,
    quietly, then memfit says what to do in one line."""
    import time

    from huggingface_hub import constants

    hub_cache(ID, GPT2)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # the hub's backoff between its retries
    code = main(["estimate", "acme/other", "-b", "2", "--seq-len", "16"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert re.search(r"config\.json is not in the Hugging Face cache \(.*\) and the hub cannot be reached.*; "
                     r"run `hf download acme/other config\.json`", lines[0]), lines[0]


def test_the_cli_names_a_folder_and_its_config_json(tmp_path, monkeypatch, capsys):
    d = folder(tmp_path, GPT2, name="gpt2-tiny")
    monkeypatch.chdir(tmp_path)
    for spec in ("./gpt2-tiny", "hf:./gpt2-tiny", "hf:gpt2-tiny", "gpt2-tiny", str(d / "config.json")):
        assert main(["estimate", spec, "-b", "2", "--seq-len", "16", "--json"]) == 0, spec
        out = json.loads(capsys.readouterr().out)
        assert out["workload"] == spec.removeprefix("hf:") and out["method"] == "fake"
    (tmp_path / "gpt2").mkdir()  # a folder named like a built-in does not hide the built-in
    assert load_workload("gpt2").info.config == {"n_layer": 12, "n_embd": 768}
    assert load_workload("./gpt2/../gpt2-tiny").info.config["model_class"] == "GPT2LMHeadModel"


@pytest.mark.parametrize("case,content,message", BAD, ids=[b[0] for b in BAD])
def test_bad_folders_are_one_line_naming_the_fix(tmp_path, capsys, case, content, message):
    if case == "missing":
        spec = str(tmp_path / "nowhere")
    elif case == "no config.json":
        (tmp_path / "empty").mkdir()
        spec = str(tmp_path / "empty")
    else:
        spec = str(folder(tmp_path, content if isinstance(content, dict) else None,
                          text=content if isinstance(content, str) else None))
    seq = "4096" if case == "seq too long" else "16"
    for command in (["estimate"], ["plan", "--budget", "1GiB", "--max-traces", "2"]):
        code = main([*command, spec, "-b", "2", "--seq-len", seq])
        err = capsys.readouterr().err
        assert code == 2, (case, command, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"memfit {command[0]}: error: "), err
        assert "Traceback" not in err
        assert re.search(message, lines[0]), lines[0]
    with pytest.raises(UserError):  # (from the library too: loading, building, or the step's loss)
        wl = load_workload(spec, seq_len=int(seq))
        wl.loss(wl.model(), wl.batch(2))
