"""`import memfit` is fast, imports neither torch nor transformers, and never initialises CUDA."""

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_is_light_and_fast():
    out = _run("import time, sys; t = time.perf_counter(); import memfit; dt = time.perf_counter() - t; "
               "print(dt, 'torch' in sys.modules, 'transformers' in sys.modules)")
    dt, torch_loaded, tf_loaded = out.split()
    assert float(dt) < 0.5 and torch_loaded == "False" and tf_loaded == "False"


def test_estimate_for_a_gpu_preset_does_not_initialise_cuda():
    out = _run("import memfit, torch; memfit.estimate('mha', batch_size=2, device='h100-80gb'); "
               "print(torch.cuda.is_initialized())")
    assert out.endswith("False")
