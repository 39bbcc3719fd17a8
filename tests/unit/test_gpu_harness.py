"""The GPU harness's own arithmetic, without a GPU: the ballast that makes a large card a smaller one, and
the paged (managed) bytes a row records apart from the caching allocator's."""

import ctypes
import json

import pytest
import torch

from tools.gpu import ground_truth


class _Driver:
    def __init__(self, status: int = 0) -> None:
        self.status, self.asked = status, []

    def cuMemAlloc_v2(self, pointer, size):  # noqa: N802 - the driver's name
        self.asked.append(size.value)
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_uint64)).contents.value = 0x7F00
        return self.status


def test_the_ballast_takes_what_is_free_beyond_the_bytes_left_outside_the_allocator(monkeypatch):
    driver = _Driver()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 << 30, 141 << 30))
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver if name == "libcuda.so.1" else None)
    monkeypatch.setattr(ground_truth, "_BALLAST", [])
    assert ground_truth.ballast(24 << 30) == 76 << 30 and driver.asked == [76 << 30]
    assert ground_truth._BALLAST == [0x7F00]  # (held until the process ends)
    assert ground_truth.ballast(200 << 30) == 0 and driver.asked == [76 << 30]  # (less free than asked: nothing)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _Driver(status=2))
    with pytest.raises(RuntimeError, match="cuMemAlloc_v2 of 81604378624 bytes failed .CUresult 2."):
        ground_truth.ballast(24 << 30)


def test_managed_bytes_count_the_paged_tensors_alone():
    import weakref

    class Referent:
        pass

    referent = Referent()
    dead = [weakref.proxy(referent)]  # (a process holds dead proxies: isinstance on one raised ReferenceError)
    del referent
    before = ground_truth.managed_bytes()
    paged, plain = torch.zeros(1000, dtype=torch.uint8), torch.zeros(1000)
    paged.is_paged = True  # (as bitsandbytes marks its managed state tensors)
    assert ground_truth.managed_bytes() - before == 1000
    del paged, plain, dead


def test_a_blind_row_is_set_beside_its_prediction():
    from tools.gpu.compare_blind import lines
    rows = [{"case": "a", "max_memory_allocated": 100, "max_memory_reserved": 200, "managed_bytes": 0,
             "step_seconds_median": 2.0, "alloc_retries": 0},
            {"case": "b", "error": "OutOfMemoryError: CUDA out of memory"}]
    predicted = {"a": {"predicted": {"allocated": 103, "reserved": 190, "managed": 0}, "predicted_step_seconds": {"h200": 1.8}}}
    a, b = lines(rows, predicted, "h200")
    assert "allocated 100 (+3.00%)" in a and "reserved 200 (-5.00%)" in a and "s/step 2.0 (-10.00%)" in a
    assert b.endswith("error: OutOfMemoryError: CUDA out of memory") and "allocated None (-)" in b


def test_a_blind_time_carries_the_paged_states_migration_where_the_ballast_leaves_no_room():
    from memfit.devices import get_device
    from tools.gpu.predict_cases import migration_seconds
    link = get_device("h200-141gb").host_link_bandwidth
    case = {"leave_bytes": 24 << 30}
    assert migration_seconds(case, {"reserved": 20 << 30, "managed": 15 << 30}, "h200-141gb") == \
        pytest.approx(2 * (15 << 30) / link)  # (4 GiB of room for 15: every page, in and out)
    assert migration_seconds(case, {"reserved": 8 << 30, "managed": 15 << 30}, "h200-141gb") == 0.0  # (room for all)
    assert migration_seconds({}, {"reserved": 20 << 30, "managed": 15 << 30}, "h200-141gb") == 0.0  # (no ballast)


def test_a_case_measured_then_timed_out_predicting_keeps_its_row(monkeypatch):
    """2026-12-04: four compiled GPT-2 rows were measured, then ran past their timeout while memfit predicted
    them in the same process, and were recorded as errors; the measurement now comes back without the prediction."""
    import subprocess

    from tools.gpu import ground_truth as gt
    row = {"case": "c", "max_memory_allocated": 7, "step_seconds_median": 0.03}

    def timed_out(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=f"MEASURED {json.dumps(row)}\n".encode(),
                                        stderr=b"progress: timed step 5: 0.03 s\n")
    monkeypatch.setattr(subprocess, "run", timed_out)
    got = gt.run_case({"case": "c", "workload": "gpt2"}, "cuda", timeout=150, predict="none")
    assert got["max_memory_allocated"] == 7 and "error" not in got and got["prediction"] == "timed out after 150 s"

    def stuck(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=b"", stderr=b"progress: built the step in 69.0 s\n")
    monkeypatch.setattr(subprocess, "run", stuck)
    got = gt.run_case({"case": "c", "workload": "gpt2"}, "cuda", timeout=150, predict="none")
    assert got["error"] == "timed out after 150 s" and "built the step" in got["traceback"]
