"""NOTE [ Modules loaded during a trace ] (memfit.untraced_imports): a module a step imports for the first
time while it is traced makes its tensors as a real process makes them, on the host, outside the trace."""

import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.untraced_imports import imports_outside_the_trace
from memfit.workloads import load_workload

TABLE = 1 << 20
"""Bytes of the table the lazily imported module makes as it loads (a tensor of 256Ki float32)."""


def _workload(tmp_path, monkeypatch, module: str):
    """An MLP whose model function imports ``module`` (a table made at import, read by the model) the first time."""
    (tmp_path / f"{module}.py").write_text(f"import torch\nTABLE = torch.ones({TABLE // 4})\n")
    (tmp_path / f"wl_{module}.py").write_text(
        "import importlib\nimport torch\nfrom memfit import Workload\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        f"        self.table = importlib.import_module('{module}').TABLE\n"
        "        self.a = torch.nn.Linear(64, 64)\n"
        "    def forward(self, x):\n"
        "        return self.a(x) * self.table[:64]\n"
        "WL = Workload(model=M, batch=lambda n: torch.randn(n, 64), loss=lambda m, x: m(x).sum())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return load_workload(str(tmp_path / f"wl_{module}.py") + ":WL")


def test_a_module_first_imported_in_a_trace_is_not_the_steps_and_its_tensors_are_real(tmp_path, monkeypatch):
    module = "made_at_import_a"
    wl = _workload(tmp_path, monkeypatch, module)
    assert module not in sys.modules
    for device in ("h100-80gb", "cpu"):
        sys.modules.pop(module, None)
        first = estimate(wl, Plan(), batch_size=2, device=device)
        table = sys.modules[module].TABLE
        assert type(table) is torch.Tensor and not isinstance(table, FakeTensor) and table.device.type == "cpu"
        second = estimate(wl, Plan(), batch_size=2, device=device)  # (imported by now: as a real run finds it)
        assert (first.peak_bytes, first.breakdown) == (second.peak_bytes, second.breakdown), device
    assert first.breakdown["other"] < TABLE  # (on the CPU: the table is no allocation of the step's)


def test_an_import_under_a_device_context_and_a_fake_mode_makes_host_tensors(tmp_path, monkeypatch):
    (tmp_path / "made_at_import_b.py").write_text("import torch\nTABLE = torch.zeros(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from memfit.fake_mode import fake_mode
    with torch.device("meta"), fake_mode():
        import made_at_import_b  # noqa: F401 - (imported for what it makes)
        inside = torch.zeros(3)
    assert isinstance(inside, FakeTensor) and inside.device.type == "meta"  # (the modes still hold around it)
    table = sys.modules["made_at_import_b"].TABLE
    assert type(table) is torch.Tensor and table.device.type == "cpu"
    mode = fake_mode()
    with mode, mode:  # (entries nest)
        assert sys.meta_path[0].__class__.__name__ == "_OutsideTheTrace"
    with imports_outside_the_trace():
        assert sys.meta_path[0].__class__.__name__ == "_OutsideTheTrace"
    assert all(f.__class__.__name__ != "_OutsideTheTrace" for f in sys.meta_path)
