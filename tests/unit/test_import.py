"""`import memfit` imports neither torch nor transformers, and never initialises CUDA."""

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_is_light():
    """What makes `import memfit` fast is what it does not import (no timing here: see bench/)."""
    out = _run("import sys; import memfit; print('torch' in sys.modules, 'transformers' in sys.modules)")
    assert out.split() == ["False", "False"]


def test_estimate_for_a_gpu_preset_does_not_initialise_cuda():
    out = _run("import memfit, torch; memfit.estimate('mha', batch_size=2, device='h100-80gb'); "
               "print(torch.cuda.is_initialized())")
    assert out.endswith("False")
