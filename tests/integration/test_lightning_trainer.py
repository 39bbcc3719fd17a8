"""memfit in a Lightning Trainer: MemfitCallback applies a plan through memfit's one step, the
module trains with manual optimization, and the callback logs predicted vs measured peak.

A tiny GPT-2 (config-built) trains 3 steps on CPU with in-backward updates and a chunked loss:
its measured steady-state peak is memfit's prediction within 1%, and its losses and parameters
equal memfit.apply's own loop on the same batches bit for bit (the same step, the same ops in the
same order). Trainer arguments the plan contradicts are one line before the first step."""

import csv
import dataclasses
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")
L = pytest.importorskip("lightning.pytorch")

import memfit  # noqa: E402
from memfit.errors import UserError  # noqa: E402
from memfit.integrations import core  # noqa: E402
from memfit.integrations import lightning as integration  # noqa: E402
from memfit.integrations.lightning import MemfitCallback, MemfitModule  # noqa: E402

BATCH, STEPS = 8, 3
PLAN = {"optimizer_in_backward": True, "loss_chunks": 4}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def loader():
    return torch.utils.data.DataLoader(Tokens(), batch_size=BATCH)


class LitGPT(MemfitModule, L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = gpt2()
        self.losses, self.batches = [], []

    def memfit_optimizer(self, params):
        return adamw(params)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss))
        self.batches.append(batch)
        return loss


def trainer(callbacks, **kw):
    args = dict(max_steps=STEPS, max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(callbacks=callbacks, **{**args, **kw})


class Hooks(L.Callback):
    """The user's own callbacks still see each optimizer step."""

    def __init__(self):
        self.before_optimizer_step = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before_optimizer_step += 1


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 3-step fit with the plan, logging to a CSV file as a user's logger would."""
    from lightning.pytorch.loggers import CSVLogger
    logger = CSVLogger(tmp_path_factory.mktemp("logs"), name="run")
    torch.manual_seed(1)
    module, callback, hooks = LitGPT(), MemfitCallback(plan=PLAN), Hooks()
    fit = trainer([callback, hooks], logger=logger, log_every_n_steps=1)
    fit.fit(module, loader())
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert hooks.before_optimizer_step == STEPS
    return fit, module, callback, rows


def test_the_plan_trains_three_steps_and_logs_predicted_vs_measured_within_1_percent(run):
    fit, module, callback, rows = run
    assert fit.global_step == STEPS and len(module.losses) == STEPS
    step = module.memfit_step
    assert step.plan.optimizer_in_backward and step.plan.loss_chunks == 4 and step.updates_in_backward
    logged = [r for r in rows if r.get("memfit/measured_peak_bytes")]
    assert logged[0]["step"] == "1"  # measured over the steady-state step, the second, on a CPU (Lightning's
    assert len({(r["memfit/measured_peak_bytes"], r["memfit/predicted_peak_bytes"]) for r in logged}) == 1  # rows
    measured, predicted = (float(logged[0][k]) for k in ("memfit/measured_peak_bytes", "memfit/predicted_peak_bytes"))
    assert predicted == callback.predicted_peak_bytes == callback.report.measurable_peak_bytes
    assert measured == callback.measured_peak_bytes
    assert abs(measured - predicted) <= 0.01 * measured, (measured, predicted)


def test_the_run_equals_memfit_apply_s_own_loop_bit_for_bit(run):
    _, module, _, _ = run
    torch.manual_seed(1)
    step = memfit.apply(gpt2(), PLAN, batch_size=BATCH, optimizer_factory=adamw, device="cpu")
    losses = []
    for _, batch in zip(range(STEPS), loader()):
        step.zero_grad()
        losses.append(float(step.forward_backward(batch)))
        step.update()
    assert module.losses == losses
    for (name, a), b in zip(module.model.named_parameters(), step.model.parameters()):
        assert torch.equal(a, b), name


def test_a_checkpoint_resumes_memfit_s_optimizer(tmp_path):
    """Lightning saves and restores the step's optimizer (here in-backward's per-parameter AdamWs)
    through StepOptimizer: 3 steps, a checkpoint, 2 more equal memfit.apply's loop over the same 5
    batches (Lightning restarts a DataLoader it cannot resume: the batches are the ones it gave)."""
    torch.manual_seed(1)
    first = trainer([MemfitCallback(plan=PLAN)], enable_checkpointing=True, default_root_dir=tmp_path)
    before = LitGPT()
    first.fit(before, loader())
    (checkpoint,) = tmp_path.rglob("*.ckpt")
    torch.manual_seed(2)  # (other weights: the checkpoint's must replace them)
    module = LitGPT()
    trainer([MemfitCallback(plan=PLAN)], max_steps=5, max_epochs=2).fit(module, loader(), ckpt_path=checkpoint)
    torch.manual_seed(1)
    step = memfit.apply(gpt2(), PLAN, batch_size=BATCH, optimizer_factory=adamw, device="cpu")
    assert len(before.batches) == 3 and len(module.batches) == 2
    for batch in before.batches + module.batches:
        step(batch)
    for (name, a), b in zip(module.model.named_parameters(), step.model.parameters()):
        assert torch.equal(a, b), name


def test_the_measurement_counts_the_model_and_optimizer_states(run):
    """The profiler starts after the network exists: without its bytes as a baseline the
    measurement would miss the parameters (NOTE [ What the window sees ])."""
    _, module, callback, _ = run
    params = core.storage_bytes(module.model)
    assert callback.measured_peak_bytes > 4 * params  # parameters, two Adam moments, activations
    assert callback.report.breakdown["optimizer_states"] >= 2 * params


def test_the_plan_export_s_trainer_arguments_run_with_the_callback():
    """``memfit plan --format lightning`` writes Trainer kwargs and names the callback for the rest:
    the two together train. Here Trainer(precision='bf16-mixed') with a bf16 plan: memfit's step
    autocasts, Lightning's plugin is replaced by the plain one, and the peak is still the prediction."""
    from memfit.integrations.export import to_lightning
    plan = memfit.Plan(precision="bf16", checkpointing="blocks")
    exported = to_lightning(plan, BATCH, "cpu")
    assert exported.kwargs["precision"] == "bf16-mixed" and exported.unmapped == ("checkpointing: blocks",)
    torch.manual_seed(1)
    callback = MemfitCallback(plan=plan)
    fit = trainer([callback], **exported.kwargs)
    fit.fit(LitGPT(), loader())
    assert fit.global_step == STEPS and fit.precision == "32-true"
    assert abs(callback.measured_peak_bytes - callback.predicted_peak_bytes) <= 0.01 * callback.measured_peak_bytes


def test_a_run_above_the_prediction_warns(monkeypatch):
    def low(*args, **kw):
        report = estimate(*args, **kw)
        half = report.measurable_peak_bytes // 2
        return dataclasses.replace(report, peak_bytes=half, process_peak_bytes=half)
    estimate = core.estimate_applied
    monkeypatch.setattr(core, "estimate_applied", low)
    with pytest.warns(UserWarning, match=r"measured peak of step 2, .* exceeds the predicted"):
        trainer([MemfitCallback(plan=PLAN)], max_steps=2).fit(LitGPT(), loader())


class LitMLP(MemfitModule, L.LightningModule):
    """A network that is no language model: its own loss on (x, y) batches."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                                               torch.nn.Linear(64, 32)) for _ in range(2)],
                                         torch.nn.Linear(32, 4))

    def memfit_loss(self, model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)


def test_a_budget_is_planned_on_the_module_and_first_batch(monkeypatch):
    """With a fixed time model (the CPU planner's calibration times real steps: slow): the plan fits the
    budget, keeps the Trainer's precision, and the step runs it."""
    from memfit.planner import cost

    def fixed(target, space, steps=2, progress=None):
        return cost.TimeModel("fixed", target.batch_size, base_seconds={m: 1.0 for m in space.micro_batches})
    monkeypatch.setattr(cost, "calibrate", fixed)
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=generator),
                                          torch.randint(0, 4, (64,), generator=generator))
    budget = 200 * 2**10
    callback, module = MemfitCallback(budget=budget), LitMLP()
    fit = trainer([callback], precision="bf16-mixed")
    fit.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    assert callback.plan.precision == "bf16" and module.memfit_step.plan == callback.plan
    assert callback.predicted_peak_bytes <= budget and fit.global_step == STEPS
    assert abs(callback.measured_peak_bytes - callback.predicted_peak_bytes) <= 0.01 * callback.measured_peak_bytes


def _fit_fails(message, callback=None, module=None, **kw):
    module = module or LitGPT()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(UserError, match=message) as info:
        trainer([callback or MemfitCallback(plan=PLAN)], **kw).fit(module, loader())
    assert "\n" not in str(info.value)
    for n, p in module.named_parameters():  # nothing of the user's run is lost: no step ran
        assert torch.equal(p, before[n]), n
    return str(info.value)


def test_in_backward_with_gradient_accumulation_is_one_line():
    text = _fit_fails(r"optimizer_in_backward.*remove Trainer\(accumulate_grad_batches=4\)", accumulate_grad_batches=4)
    assert "cannot accumulate" in text


@pytest.mark.parametrize("kw, plan, message", [
    (dict(precision="bf16-mixed"), {**PLAN, "precision": "bf16-pure"},
     r"Trainer\(precision='bf16-mixed'\) but the plan runs precision: bf16-pure; set Trainer\(precision='bf16-true'\)"),
    (dict(precision="64-true"), PLAN, r"not Trainer\(precision='64-true'\)"),
    (dict(gradient_clip_val=0.5), PLAN,
     r"gradient_clip_val=0.5.*optimizer_in_backward frees each.*remove Trainer\(gradient_clip_val=0.5"),
])
def test_trainer_arguments_the_plan_contradicts_are_one_line(kw, plan, message):
    _fit_fails(message, MemfitCallback(plan=plan), **kw)


def test_a_module_without_the_mixin_or_callback_is_one_line():
    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gpt2()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return adamw(self.parameters())

    class Reversed(Plain, MemfitModule):  # (Plain's training_step would run)
        pass

    _fit_fails("must subclass MemfitModule before LightningModule", module=Plain())
    _fit_fails("must subclass MemfitModule before LightningModule", module=Reversed())
    module = LitGPT()
    with pytest.raises(UserError, match="needs one MemfitCallback"):
        trainer([]).fit(module, loader())


def test_plan_or_budget_one_of_them():
    for kw in ({}, {"plan": PLAN, "budget": "1GiB"}):
        with pytest.raises(UserError, match="one of them"):
            MemfitCallback(**kw)
    with pytest.raises(UserError, match="unknown key"):
        MemfitCallback(plan={"optimiser": "sgd"})


def test_lightning_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)  # import lightning.pytorch raises ImportError
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setattr(integration, "_CLASS", [])
    with pytest.raises(UserError) as info:
        MemfitCallback(plan=PLAN)
    assert str(info.value) == "lightning is not installed; pip install lightning (or memfit[lightning])"


def test_importing_the_integration_does_not_import_lightning():
    code = "import sys, memfit.integrations.lightning; assert 'lightning' not in sys.modules, 'imported'"
    with warnings.catch_warnings():
        subprocess.run([sys.executable, "-c", code], check=True)


def test_the_trainers_own_clipping_and_precision_are_taken_into_the_plan():
    """Issue 32: Trainer(gradient_clip_val=1.0, precision='bf16-mixed') with a plan that leaves clipping
    and precision open: the plan takes them, the prediction includes them (measured within 1%), and
    the run equals memfit.apply's loop with that plan bit for bit."""
    torch.manual_seed(1)
    callback, module = MemfitCallback(plan={"loss_chunks": 4}), LitGPT()
    trainer([callback], gradient_clip_val=1.0, precision="bf16-mixed").fit(module, loader())
    taken = memfit.Plan(loss_chunks=4, max_grad_norm=1.0, precision="bf16")
    assert callback.plan == taken and module.memfit_step.plan == taken
    assert abs(callback.measured_peak_bytes - callback.predicted_peak_bytes) <= 0.01 * callback.measured_peak_bytes
    torch.manual_seed(1)
    step = memfit.apply(gpt2(), taken, batch_size=BATCH, optimizer_factory=adamw, device="cpu")
    for _, batch in zip(range(STEPS), loader()):
        step(batch)
    for (name, a), b in zip(module.model.named_parameters(), step.model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_the_cpu_planner_times_copies_and_leaves_the_network_untrained():
    """The CPU planner times real steps: on copies of the network, so the fit that follows starts from
    the user's weights (and equals memfit.apply's loop from the same weights)."""
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=generator),
                                          torch.randint(0, 4, (64,), generator=generator))
    torch.manual_seed(1)
    callback, module = MemfitCallback(budget=200 * 2**10), LitMLP()
    trainer([callback]).fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    torch.manual_seed(1)
    reference = LitMLP()
    step = memfit.apply(reference.model, callback.plan, batch_size=16, loss_fn=reference.memfit_loss, device="cpu")
    for _, batch in zip(range(STEPS), torch.utils.data.DataLoader(data, batch_size=16)):
        step(batch)
    for a, b in zip(module.model.parameters(), step.model.parameters()):
        assert torch.equal(a, b)
