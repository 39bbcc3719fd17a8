"""The CPU planner times real steps only where they fit this machine's free memory (NOTE [ Real
steps that fit this machine ] in memfit.planner.cost): `memfit plan gpt2 --budget 2GiB` on the cpu
device needed 28 GiB for its plain fp32 step at batch 8 x 1024, and the OS killed it."""

from __future__ import annotations

import types

import pytest

from memfit.devices import get_device
from memfit.memory.estimate import estimate_target
from memfit.planner import cost
from memfit.planner.space import default_space, model_facts
from memfit.plans import Plan
from memfit.target import Target
from memfit.workloads import load_workload

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128"
BATCH = 8


def _peak(wl, batch: int) -> int:
    return estimate_target(Target(wl, Plan(), batch, get_device("cpu"))).peak_bytes


def _space(wl):
    space = default_space(model_facts(wl), get_device("cpu"), BATCH)
    space.values = {"checkpointing": ["none", "blocks"]}
    return space


def test_calibration_times_no_step_over_the_free_memory_and_scales_the_plain_step(monkeypatch):
    """Free memory set between the plain step's peaks at batch 2 and 4: every step timed for real
    runs at most 2 samples at once (its peak, traced independently here, fits), and the whole
    batch's time is the batch-2 step's scaled by 8 / 2."""
    wl = load_workload(SPEC, seq_len=64)
    peaks = {b: _peak(wl, b) for b in (1, 2, 4, 8)}
    assert peaks[1] < peaks[2] < peaks[4] < peaks[8]
    free = int((peaks[2] + peaks[4]) / 2 / cost.HOST_SHARE)
    monkeypatch.setattr(cost, "available_host_bytes", lambda: free)
    timed: list[int] = []
    times = {1: 0.05, 2: 0.1}

    def fake_time_steps(target, steps):
        micro = target.plan.micro_batches(target.batch_size)[0]
        timed.append(micro)
        return times[micro] * (target.batch_size // micro), 0.0
    monkeypatch.setattr(cost, "_time_steps", fake_time_steps)
    stages: list[str] = []
    progress = type("Recorded", (), {"stage": lambda self, text: stages.append(text)})()
    model = cost.calibrate(Target.resolve(wl, None, BATCH, "cpu"), _space(wl), progress=progress)
    assert stages == ["timing the plain step at batch 2", "timing checkpointing=blocks (1 of 1, at batch 1)"]
    assert timed and max(timed) == 2
    assert all(peaks[m] <= cost.HOST_SHARE * free for m in timed)
    assert model.base_seconds[BATCH] == pytest.approx(0.1 * BATCH / 2)
    assert model.extrapolated_from == 2 and model.reduced_batch == 1
    assert "timed at batch 2, scaled to 8" in model.describe()


def test_calibration_at_the_whole_batch_where_it_fits(monkeypatch):
    wl = load_workload(SPEC, seq_len=64)
    monkeypatch.setattr(cost, "available_host_bytes", lambda: int(2 * _peak(wl, BATCH) / cost.HOST_SHARE))
    timed: list[int] = []

    def fake_time_steps(target, steps):
        timed.append(target.plan.micro_batches(target.batch_size)[0])
        return 0.01, 0.0
    monkeypatch.setattr(cost, "_time_steps", fake_time_steps)
    model = cost.calibrate(Target.resolve(wl, None, BATCH, "cpu"), _space(wl))
    assert timed == [BATCH, 4, 2, 1, BATCH] and model.extrapolated_from is None and model.reduced_batch is None


@pytest.mark.parametrize(("seconds", "calls"), [(3.0, 2), (0.25, 3), (0.125, 4)])
def test_a_slow_step_is_timed_once_after_its_warm_up(monkeypatch, seconds, calls):
    """A timed step over 2 s: the warm-up and that step (GPT-2 at 1024 tokens: 12 s a step here); a
    faster one: at least two, and at least 0.3 s of them. A slow warm-up (compiling) decides nothing."""
    clock = [0.0]
    ran = []

    def step(batch):
        clock[0] += seconds + (30.0 if not ran else 0.0)  # (the warm-up compiles)
        ran.append(batch)
    monkeypatch.setattr(cost, "build_step", lambda target: step)
    monkeypatch.setattr(cost, "make_batch", lambda target: "batch")
    monkeypatch.setattr(cost, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))  # (this module's clock only)
    median, warmup = cost._time_steps(None, 2)
    assert len(ran) == calls and median == pytest.approx(seconds) and warmup == pytest.approx(30.0)


@pytest.mark.parametrize(("step_seconds", "said"), [(40.0, True), (0.5, False)])
def test_the_user_is_told_up_front_when_timing_takes_minutes(monkeypatch, step_seconds, said):
    """A slow step (GPT-2 at 1024 tokens: 12 s here) times each value for minutes: one line says how
    long, and names --device; a fast one says nothing."""
    wl = load_workload(SPEC, seq_len=64)
    monkeypatch.setattr(cost, "available_host_bytes", lambda: int(2 * _peak(wl, BATCH) / cost.HOST_SHARE))
    monkeypatch.setattr(cost, "_time_steps",  # (seconds per sample)
                        lambda target, steps: (step_seconds * target.plan.micro_batches(target.batch_size)[0], 0.0))
    notes: list[str] = []
    progress = type("Recorded", (), {"stage": lambda self, text: None, "note": lambda self, text: notes.append(text)})()
    space = _space(wl)
    space.values["loss_chunks"] = [0, 8]
    cost.calibrate(Target.resolve(wl, None, BATCH, "cpu"), space, progress=progress)
    if said:
        assert notes == ["memfit plan: timing 2 technique values by real steps on this machine's CPU takes about 3 min "
                         "(40.0 s a step at batch 1); to plan for a GPU instead, give --device (see memfit devices)"]
    else:
        assert notes == []


def test_a_note_is_written_to_a_log_and_above_the_bar_on_a_terminal():
    import io

    from memfit.planner.progress import PlanProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    log, terminal = io.StringIO(), Terminal()
    with PlanProgress(log) as quiet:
        quiet.stage("timing techniques")
        quiet.note("takes about 3 min")
    with PlanProgress(terminal) as bar:
        bar.note("takes about 3 min")
    assert log.getvalue() == "takes about 3 min\n" and "takes about 3 min" in terminal.getvalue()
