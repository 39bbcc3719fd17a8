"""Profiler extras: leak finder, memory timeline PNG, per-module table."""

import torch
from torch import nn

from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.workload import Workload

KEPT: list = []


def _leaky_workload():
    def loss(m, x):
        out = m(x)
        KEPT.append(out)  # keeps the output (and its graph) alive after the step
        return out.pow(2).mean()
    return Workload(model=lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)),
                    batch=lambda n: torch.randn(n, 64), loss=loss, name="leaky", default_batch_size=16)


def test_leak_finder_names_what_outlives_the_step():
    KEPT.clear()
    report = estimate(_leaky_workload(), batch_size=16)
    assert report.leaks, "the kept output was not found"
    top = report.leaks[0]
    assert top["phase"] == "forward" and top["nbytes"] >= 16 * 64 * 4
    clean = estimate("mha", batch_size=2)
    assert clean.leaks == []
    KEPT.clear()
    measured = profile(_leaky_workload(), batch_size=16, repeats=0)
    assert measured.measured.leaks
    KEPT.clear()


def test_timeline_series_stack_to_the_peak():
    from memfit.devices import get_device
    from memfit.memory.faketrace import run_tracked
    from memfit.memory.report import peak_of, step_window
    from memfit.memory.timeline import category_timeline
    from memfit.plans import Plan
    from memfit.target import Target
    from memfit.workloads import load_workload
    run = run_tracked(Target.resolve(load_workload("mha"), Plan(), 2, get_device("cpu")), fake=True)
    window = step_window(run.tracker, 2)
    xs, series, _ = category_timeline(run.tracker, "cpu", window, points=10**9)
    totals = [sum(series[c][i] for c in series) for i in range(len(xs))]
    assert max(totals) == peak_of(run.tracker, "cpu", window)[0]
