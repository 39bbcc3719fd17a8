"""End-to-end CLI: JSON outputs, plan files and flags, and one-line errors with exit status 2."""

import json
import subprocess
import sys

import pytest

from memfit.cli.main import main
from memfit.memory.categories import CATEGORIES
from memfit.workloads.small import SMALL_HF

pytestmark = pytest.mark.integration
GPT2 = SMALL_HF["gpt2"]


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_json(capsys):
    out = _json(capsys, ["estimate", GPT2, "--batch-size", "2", "--seq-len", "64", "--json"])
    assert set(CATEGORIES) == set(out["breakdown"])
    assert out["peak_bytes"] == sum(out["breakdown"].values()) > 0
    assert out["method"] == "fake"


def test_estimate_gpu_preset_json(capsys):
    out = _json(capsys, ["estimate", GPT2, "-b", "2", "--seq-len", "64", "--device", "h100-80gb", "--json",
                         "--precision", "auto"])
    assert out["reserved_bytes"] >= out["peak_bytes"]
    assert out["device_total_bytes"] == 85_017_493_504 and out["cuda_context_bytes"] > 0
    assert out["precision"] == "bf16" and out["fits"] is True


def test_profile_json(capsys):
    out = _json(capsys, ["profile", "mha", "-b", "2", "--json", "--repeats", "1"])
    assert {"peak_bytes", "predicted_peak_bytes", "step_seconds", "error_percent"} <= set(out)
    assert abs(out["error_percent"]) <= 1.0 and out["step_seconds"] > 0


def test_plan_file_and_flag_override(capsys, tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("precision: bf16\nmicro_batch_size: 1\n")
    out = _json(capsys, ["estimate", "mha", "-b", "2", "--plan", str(plan), "--json"])
    assert out["plan"]["precision"] == "bf16" and out["plan"]["micro_batch_size"] == 1
    out = _json(capsys, ["estimate", "mha", "-b", "2", "--plan", str(plan), "--precision", "fp32", "--json"])
    assert out["plan"]["precision"] == "fp32" and out["plan"]["micro_batch_size"] == 1


def test_tables_render(capsys):
    assert main(["estimate", "mha", "-b", "2", "--device", "rtx4090"]) == 0
    text = capsys.readouterr().out
    assert "peak allocated" in text and "CUDA context" in text and "fits" in text
    assert main(["profile", "mha", "-b", "2", "--repeats", "1"]) == 0
    assert "prediction error" in capsys.readouterr().out


BAD_FILE = '''
import torch
from memfit import Workload
VECTOR_LOSS = Workload(model=lambda: torch.nn.Linear(4, 4), batch=lambda n: torch.randn(n, 4),
                       loss=lambda m, x: m(x))
def _boom():
    raise RuntimeError("cannot build")
RAISES = Workload(model=_boom, batch=lambda n: torch.randn(n, 4), loss=lambda m, x: m(x).sum())
'''


@pytest.mark.parametrize("argv,message", [
    (["estimate", "nosuch"], "unknown workload 'nosuch'"),
    (["estimate", "mha", "--batch-size", "0"], "--batch-size must be a positive"),
    (["estimate", "mha", "--batch-size", "eight"], "malformed --batch-size"),
    (["estimate", "mha", "--device", "h300"], "unknown device 'h300'"),
    (["estimate", "missing.py:WL"], "not found"),
    (["estimate", "mha", "--precision", "fp8"], "precision 'fp8' is not valid"),
    (["estimate", "mha", "--plan", "nope.yaml"], "plan file 'nope.yaml' not found"),
    (["estimate", "mha", "-b", "6", "--micro-batch-size", "4"], "not a multiple"),
    (["estimate", "gpt2", "--seq-len", "5000"], "exceeds"),
    (["profile", "mha", "--device", "a100-80gb"], "preset for prediction"),
    (["estimate", "{file}:VECTOR_LOSS"], "must return a scalar"),
    (["estimate", "{file}:RAISES"], "model() raised RuntimeError: cannot build"),
    (["estimate", "{file}:NOPE"], "has no 'NOPE'"),
])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, argv, message):
    f = tmp_path / "wl.py"
    f.write_text(BAD_FILE)
    argv = [a.replace("{file}", str(f)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_subprocess_exit_status_and_debug_traceback():
    cmd = [sys.executable, "-m", "memfit.cli.main", "estimate", "nosuch"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    p = subprocess.run(cmd + ["--debug"], capture_output=True, text=True)
    assert p.returncode != 0 and "Traceback" in p.stderr


WARNING_WORKLOAD = """
import warnings
import torch
from memfit import Workload

def W():
    warnings.warn("something odd\\nmore detail")
    warnings.warn("Triton is not supported on current platform, roll back to CPU.")  # (fla's, importing here)
    return Workload(model=lambda: torch.nn.Linear(4, 4), batch=lambda n: torch.randn(n, 4),
                    loss=lambda m, x: m(x).sum(), name="w")
"""


def test_warnings_are_one_line(capsys, tmp_path):
    """A warning (memfit's, e.g. the planner leaving adamw8bit out, or a workload's) reaches the user
    as one 'memfit: warning: ...' line, without Python's source line."""
    path = tmp_path / "wl.py"
    path.write_text(WARNING_WORKLOAD)
    assert main(["estimate", f"{path}:W", "--batch-size", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "memfit: warning: something odd" in err
    assert not any("warnings.warn" in line or "UserWarning" in line or "more detail" in line for line in err)
    assert not any("Triton is not supported" in line for line in err)  # (not about what memfit answers)
