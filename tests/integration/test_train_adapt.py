"""memfit train under a budget: OOMs at random steps and real budget-guard OOMs change nothing in
the training; budgets that cannot work are refused with the smallest that would."""

import json
import random

import pytest
import torch

from memfit.cli.main import main
from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.training.loop import train

NO_DROPOUT = "gpt2:n_layer=2,n_embd=64,n_head=4,n_positions=128,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"
STEPS, BATCH = 8, 8


def _run(out, **kw):
    return train(NO_DROPOUT, steps=STEPS, out=out, seq_len=64, batch_size=BATCH, progress=False, report=False, **kw)


def _lines(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("clean"))


@pytest.mark.parametrize("seed", [11, pytest.param(23, marks=pytest.mark.slow), pytest.param(47, marks=pytest.mark.slow)])
def test_ooms_at_random_steps_leave_the_loss_trajectory_unchanged(tmp_path, clean, seed, inject_oom):
    rng = random.Random(seed)
    oom_steps = set(rng.sample(range(1, STEPS + 1), 3))
    with inject_oom(oom_steps):
        oom = _run(tmp_path)
    torch.testing.assert_close(torch.tensor(oom.losses), torch.tensor(clean.losses), rtol=1e-5, atol=1e-6)
    lines = _lines(tmp_path)
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))  # one record a step, each with its loss
    assert all("loss" in x and "peak_bytes" in x for x in lines)
    events = [a for x in lines for a in x.get("adaptations", [])]
    assert sorted(e["step"] for e in events) == sorted(oom_steps)
    assert [e["adaptation"].split(" x")[0] for e in events] == [f"micro_batch_size {m}" for m in (4, 2, 1)]
    assert all("injected" in e["cause"] for e in events)


def test_the_budget_guard_raises_real_ooms_and_training_adapts_without_changing(tmp_path, clean):
    """A plan that needs more than the budget: the CPU guard raises torch.OutOfMemoryError inside
    the step, the loop re-splits the same batch, and every step then stays within the budget, as
    the profiler (independent of the guard) measures."""
    predicted = estimate(NO_DROPOUT, Plan(), batch_size=BATCH, seq_len=64).peak_bytes
    budget = int(predicted * 0.75)
    r = _run(tmp_path, plan=Plan(), budget=budget)
    torch.testing.assert_close(torch.tensor(r.losses), torch.tensor(clean.losses), rtol=1e-5, atol=1e-6)
    # one OOM: the estimate picks the largest micro-batch predicted to fit, not halving by trial
    assert len(r.adaptations) == 1 and "budget guard" in r.adaptations[0]["cause"]
    assert "the largest predicted to fit" in r.adaptations[0]["adaptation"]
    fitting = [m for m in (4, 2, 1) if estimate(NO_DROPOUT, Plan(micro_batch_size=m), batch_size=BATCH,
                                                seq_len=64).peak_bytes <= budget]
    assert r.adapted_plan["micro_batch_size"] == fitting[0]
    steps = _lines(tmp_path)
    assert all(x["peak_bytes"] <= budget for x in steps)
    assert r.measured_peak_bytes <= budget  # the profiler's measurement of step 2
    assert abs(r.predicted_peak_bytes - r.measured_peak_bytes) <= 0.01 * r.measured_peak_bytes


@pytest.mark.slow  # plans (with real calibration steps) before refusing: 1.5-2 minutes on 2 cores
def test_budgets_that_cannot_work_are_refused_with_what_would(tmp_path, capsys):
    with pytest.raises(UserError, match="below what the model and optimizer hold"):
        _run(tmp_path / "a", plan=Plan(), budget="10MiB")
    code = main(["train", NO_DROPOUT, "--seq-len", "64", "-b", "8", "--budget", "40MiB", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and "no plan fits the budget" in err and "smallest footprint found is" in err
    assert not list((tmp_path / "b").glob("checkpoint*"))


def test_an_existing_run_is_not_overwritten(tmp_path, capsys):
    train(NO_DROPOUT, steps=1, out=tmp_path, seq_len=64, batch_size=2, progress=False, report=False)
    before = (tmp_path / "checkpoint-00000001.pt").read_bytes()
    assert main(["train", NO_DROPOUT, "--seq-len", "64", "-b", "2", "--steps", "1", "--out", str(tmp_path)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "checkpoint-00000001.pt").read_bytes() == before


def test_out_of_adaptations_says_what_the_most_frugal_plan_needs(tmp_path, inject_oom):
    plan = Plan(optimizer_in_backward=True, checkpointing="blocks", offload=("activations",))  # nothing left to do
    need = estimate(NO_DROPOUT, plan, batch_size=2, seq_len=64).peak_bytes
    with pytest.raises(UserError, match="every adaptation applied") as info, inject_oom({1}):
        train(NO_DROPOUT, plan=plan, steps=2, out=tmp_path, seq_len=64, batch_size=2, progress=False,
              report=False)
    from memfit.units import fmt_bytes
    assert f"needs {fmt_bytes(need)} (predicted)" in str(info.value)


def test_after_resume_the_guard_counts_what_it_counted_before(tmp_path):
    """Offloaded optimizer states and a host EMA restored from a checkpoint stay host memory: the
    guard's device peaks after a resume equal those of the straight run (and so do the losses)."""
    plan = Plan(offload=("optimizer_states",), ema={"decay": 0.9, "device": "cpu"})
    run = dict(plan=plan, budget="8GiB", seq_len=64, batch_size=2, progress=False, report=False)
    straight = train(NO_DROPOUT, steps=4, out=tmp_path / "a", **run)
    train(NO_DROPOUT, steps=2, out=tmp_path / "b", **run)
    resumed = train(NO_DROPOUT, steps=4, out=tmp_path / "b", resume=True, **run)
    assert resumed.losses == straight.losses[2:]
    peaks = [[x["peak_bytes"] for x in _lines(out) if x["step"] > 2] for out in (tmp_path / "a", tmp_path / "b")]
    assert peaks[0] == peaks[1]


def test_on_a_gpu_the_budget_is_the_allocators_limit_and_predictions_use_reserved_bytes(monkeypatch):
    """The GPU logic, on this CPU: a GPU preset's estimate decides what fits, and the allocator's
    per-process fraction is set from the budget."""
    from types import SimpleNamespace

    from memfit.devices import get_device
    from memfit.memory.budget import Budget
    from memfit.target import Target
    from memfit.training.adapt import FitPredictor
    from memfit.training.enforce import limit_cuda_allocator
    gpu = get_device("rtx4090")
    plan = Plan(micro_batch_size=2)
    reserved = estimate(NO_DROPOUT, plan, batch_size=BATCH, seq_len=64, device=gpu).reserved_bytes
    from memfit.workloads import load_workload
    target = Target.resolve(load_workload(NO_DROPOUT, seq_len=64), None, BATCH, gpu)
    assert FitPredictor(target, Budget(reserved, gpu))(plan)
    assert not FitPredictor(target, Budget(reserved - 1, gpu))(plan)
    assert FitPredictor(target, Budget.of_device(gpu))(plan)  # no budget: the whole card
    set_to = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f: set_to.append(f))
    assert limit_cuda_allocator(20 << 30) == 0.25 and set_to == [0.25]
    assert limit_cuda_allocator(100 << 30) == 1.0


@pytest.mark.slow
def test_a_compiled_run_lowers_its_activation_budget_first(tmp_path, inject_oom):
    """compile: blocks with OOMs at steps 2 and 3: the budget goes 1 -> 0.5 -> 0.1 (Inductor compiles the
    block again for each), the batch stays whole, and the losses are those of the run without OOMs
    (the partition changes what is recomputed, not the arithmetic, up to Inductor's float reordering)."""
    def run(out):
        return train(NO_DROPOUT, plan=Plan(compile="blocks"), steps=4, out=out, seq_len=32, batch_size=4,
                     progress=False, report=False)
    clean = run(tmp_path / "clean")
    with inject_oom({2, 3}):
        oom = run(tmp_path / "oom")
    changes = [a["adaptation"] for line in _lines(tmp_path / "oom") for a in line.get("adaptations", [])]
    assert [c.split(" (")[0] for c in changes] == ["checkpointing: budget:0.5", "checkpointing: budget:0.1"]
    assert oom.adapted_plan["checkpointing"] == "budget:0.1" and oom.adapted_plan["micro_batch_size"] is None
    torch.testing.assert_close(torch.tensor(oom.losses), torch.tensor(clean.losses), rtol=1e-4, atol=1e-5)
