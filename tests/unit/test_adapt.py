"""OOM adaptation re-plans: the step that runs after an adaptation is the step ``build_step`` makes
for the adapted plan (same ops, same peak), with the running step's state moved across."""

import pytest
import torch

from helpers import OpShapes
from memfit.memory.report import Window, peak_of
from memfit.memory.tracker import MemoryTracker
from memfit.plans import Plan
from memfit.step import TrainStep, build_step
from memfit.training.adapt import OutOfAdaptations, adapt, run_adapting
from memfit.training.checkpoint import load_step_state, step_state
from memfit.workloads import load_workload

# attention dropout off: chunked attention draws its dropout per chunk
SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=300,n_positions=512,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"
SEQ, BATCH = 512, 2


def _one_step(step: TrainStep, batch) -> tuple[list, int, float]:
    """(ops with their output shapes, tracked peak bytes, loss) of one step."""
    with MemoryTracker() as tracker, OpShapes() as ops:
        loss = step(batch)
    events = len(tracker.state.events)
    return ops.seen, peak_of(tracker, "cpu", Window(0, events))[0], loss


def test_an_adapted_step_is_the_step_built_for_the_adapted_plan(monkeypatch):
    """Chunked attention with the optimizer in backward (which cannot accumulate micro-batches):
    an OOM escalates to block checkpointing, whose recomputation must run under chunked attention
    too. The running step, after the adaptation, is compared with a step built fresh from the
    adapted plan and given the same state: the same ops with the same shapes, the same peak."""
    wl = load_workload(SPEC, seq_len=SEQ)
    torch.manual_seed(0)
    step = build_step(wl, Plan(attention="chunked", optimizer_in_backward=True), BATCH, "cpu")
    batch = wl.batch(BATCH)
    step(batch)  # optimizer states exist

    real_run, fired = TrainStep.run, []

    def oom_once(self, b):
        if not fired:
            fired.append(self.plan)
            self.phase = "forward"
            raise torch.OutOfMemoryError("injected")
        return real_run(self, b)
    monkeypatch.setattr(TrainStep, "run", oom_once)
    events = []
    _, running = run_adapting(step, batch, events.append)
    monkeypatch.setattr(TrainStep, "run", real_run)

    assert [e["adaptation"] for e in events] == ["checkpointing: blocks"]
    assert running is not step and step.model is None  # a new step; the old one released
    assert running.plan == Plan(attention="chunked", optimizer_in_backward=True, checkpointing="blocks")

    fresh = build_step(wl, running.plan, BATCH, "cpu")
    load_step_state(fresh, step_state(running))
    torch.manual_seed(1)
    ops_running, peak_running, loss_running = _one_step(running, batch)
    torch.manual_seed(1)
    ops_fresh, peak_fresh, loss_fresh = _one_step(fresh, batch)
    assert ops_running == ops_fresh
    assert peak_running == peak_fresh
    assert loss_running == loss_fresh
    # chunked attention held in the recomputation too: no [T, T] score matrix anywhere in the step
    assert not [s for _, s in ops_running if len(s) >= 2 and s[-1] == SEQ and s[-2] == SEQ]


def test_the_adapted_step_keeps_training_where_the_running_one_was(monkeypatch):
    """Model, optimizer (Adam moments and step count) and EMA cross over: the losses after an
    adaptation equal those of a run that never adapted."""
    wl = load_workload(SPEC, seq_len=64)
    plan = Plan(ema={"decay": 0.9, "device": "cpu"})
    losses = {}
    for adapted in (False, True):
        torch.manual_seed(0)
        step = build_step(wl, plan, 4, "cpu")
        batch = wl.batch(4)
        out = [step(batch), step(batch)]
        if adapted:
            step, change = _rebuilt(step, 4)
            assert change.startswith("micro_batch_size 2")
        out += [step(batch), step(batch)]
        losses[adapted] = (out, {k: v.clone() for k, v in step.ema.state_dict()["shadow"].items()})
    torch.testing.assert_close(torch.tensor(losses[True][0]), torch.tensor(losses[False][0]), rtol=1e-5, atol=1e-6)
    for name, shadow in losses[False][1].items():
        torch.testing.assert_close(losses[True][1][name], shadow, rtol=1e-5, atol=1e-6)


def _rebuilt(step: TrainStep, batch_size: int):
    from memfit.training.rebuild import rebuild
    plan, change = adapt(step.plan, batch_size, step.model)
    return rebuild(step, plan), change


def test_adaptation_order_comes_from_the_techniques():
    """Micro-batches first (the largest predicted to fit), then block checkpointing, then activation
    offload; then nothing is left."""
    model = load_workload(SPEC, seq_len=64).model()
    plan, change = adapt(Plan(), 8, model, fits=lambda p: p.micro_batch_size <= 2)
    assert plan == Plan(micro_batch_size=2) and "the largest predicted to fit" in change
    plan, change = adapt(Plan(micro_batch_size=1), 8, model)
    assert plan == Plan(micro_batch_size=1, checkpointing="blocks")
    plan, change = adapt(plan, 8, model)
    assert plan.offload == ("activations",) and change == "offload: activations"
    with pytest.raises(OutOfAdaptations):
        adapt(plan, 8, model)
    plan, _ = adapt(Plan(), 8, torch.nn.Linear(2, 2))  # no repeated blocks: micro-batches, then offload
    assert plan == Plan(micro_batch_size=4)
    assert adapt(Plan(micro_batch_size=1), 8, torch.nn.Linear(2, 2))[0].offload == ("activations",)


def test_a_compiled_plan_lowers_its_activation_budget_before_micro_batches():
    """NOTE [ Activation budget ladder ]: compile without checkpointing (torch's budget 1) -> budget:0.5
    -> budget:0.1, then micro-batches, then offload; a compiled plan that checkpoints blocks or selectively
    keeps its mode and goes straight to micro-batches. Eager plans are unchanged (the test above)."""
    model = load_workload(SPEC, seq_len=64).model()
    for mode in ("blocks", "full"):
        plan, change = adapt(Plan(compile=mode), 8, model)
        assert plan == Plan(compile=mode, checkpointing="budget:0.5")
        assert change.startswith("checkpointing: budget:0.5 (the compiled regions' activation memory budget, was 1")
        plan, change = adapt(plan, 8, model)
        assert plan == Plan(compile=mode, checkpointing="budget:0.1") and "was 0.5" in change
        plan, change = adapt(plan, 8, model)
        assert plan == Plan(compile=mode, checkpointing="budget:0.1", micro_batch_size=4)
    # lowered first even when the plan already splits the batch
    assert adapt(Plan(compile="blocks", micro_batch_size=2), 8, model)[0].checkpointing == "budget:0.5"
    plan, _ = adapt(Plan(compile="blocks", checkpointing="budget:0.1", micro_batch_size=1), 8, model)
    assert plan.offload == ("activations",)
    for mode in ("blocks", "selective"):
        assert adapt(Plan(compile="full", checkpointing=mode), 8, model)[0] == \
            Plan(compile="full", checkpointing=mode, micro_batch_size=4)


def test_predictions_pick_the_largest_budget_predicted_to_fit():
    model = load_workload(SPEC, seq_len=64).model()
    asked = []

    def fits(p):
        asked.append(p.checkpointing)
        return p.checkpointing == "budget:0.1"
    plan, change = adapt(Plan(compile="blocks"), 8, model, fits=fits)
    assert plan.checkpointing == "budget:0.1" and "the largest predicted to fit" in change
    assert asked[:2] == ["budget:0.5", "budget:0.1"]
    plan, change = adapt(Plan(compile="blocks"), 8, model, fits=lambda p: False)  # none fits: the lowest
    assert plan.checkpointing == "budget:0.1" and "predicted" not in change
