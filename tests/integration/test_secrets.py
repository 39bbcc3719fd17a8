"""A Hugging Face token (HF_TOKEN, or hf auth login's token file) never appears in what memfit
writes (memfit.secrets): the command's output, its one-line errors and --debug tracebacks,
metrics.jsonl, report.json, plan files and checkpoints. The token reaches memfit here the ways it
can: a workload that prints it, warns with it, fails with it (an error echoing a request) or is
named with it.

On main before this change, each of these showed the token."""

import os
import subprocess
import sys

from memfit.cli.main import main
from memfit.plans import Plan
from memfit.secrets import MASK, redact, tokens
from memfit.training import checkpoint

TOKEN = "hf_" + "Zq7Lw" * 7

WORKLOAD = '''
import os
import warnings

import torch

from memfit.workload import Workload


def _model():
    token = os.environ["HF_TOKEN"]
    print("downloaded with", token)
    warnings.warn(f"the hub said: token {token} expires soon")
    return torch.nn.Linear(8, 2)


def _failing():
    raise RuntimeError(f"401 Client Error: Unauthorized (Authorization: Bearer {os.environ['HF_TOKEN']})")


def _batch(b):
    return torch.randn(b, 8), torch.randint(0, 2, (b,))


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


# a name with credentials in it, as an authenticated URL has them
W = Workload(model=_model, batch=_batch, loss=_loss, name=f"https://user:{os.environ['HF_TOKEN']}@hf.co/org/tiny")
FAILING = Workload(model=_failing, batch=_batch, loss=_loss, name="failing")
'''


def _workload(tmp_path):
    folder = tmp_path / f"models-{TOKEN}"  # (a path holding the token: error lines name it)
    folder.mkdir()
    (folder / "wl.py").write_text(WORKLOAD)
    return folder / "wl.py"


def _files_hold_token(folder) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]


def test_the_token_is_in_no_output_file_or_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    wl, out = _workload(tmp_path), tmp_path / "out"
    argv = ["train", f"{wl}:W", "-b", "4", "--steps", "2", "--checkpoint-every", "1", "--out", str(out)]
    assert main(argv) == 0
    assert main([*argv[:5], "3", *argv[6:], "--resume", "--json"]) == 0  # (the name stored redacted still matches)
    shown = capsys.readouterr()
    assert TOKEN not in shown.out + shown.err and MASK in shown.out + shown.err
    assert (out / "report.json").is_file() and _files_hold_token(out) == []
    assert checkpoint.read(out)["workload"] == f"https://user:{MASK}@hf.co/org/tiny"
    Plan(adapter="lora").save(tmp_path / "plan.yaml")
    assert TOKEN not in (tmp_path / "plan.yaml").read_text()


def test_the_token_is_in_no_error_line_nor_debug_traceback(tmp_path):
    wl = _workload(tmp_path)
    env = {**os.environ, "HF_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    for debug in ([], ["--debug"]):
        done = subprocess.run([sys.executable, "-m", "memfit.cli.main", "train", f"{wl}:FAILING", "--steps", "1",
                               "--out", str(tmp_path / "out"), *debug], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode != 0
        assert "401 Client Error" in done.stderr and TOKEN not in done.stderr + done.stdout, done.stderr
        assert ("Traceback" in done.stderr) == bool(debug)


def test_tokens_are_found_where_huggingface_hub_looks(tmp_path, monkeypatch):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_STORED_TOKENS_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    (tmp_path / "token").write_text("hf_fromthetokenfile\n")
    (tmp_path / "stored_tokens").write_text("[work]\nhf_token = hf_astoredtoken1\n")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_theoldvariable")
    monkeypatch.setenv("HF_TOKEN", "short")  # (too short to be one: ordinary text is left alone)
    found = tokens()
    assert {"hf_fromthetokenfile", "hf_astoredtoken1", "hf_theoldvariable"} <= set(found) and "short" not in found
    assert redact("a hf_fromthetokenfile b short") == f"a {MASK} b short"
