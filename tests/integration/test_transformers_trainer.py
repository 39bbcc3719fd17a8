"""memfit in a Hugging Face Trainer: a tiny config-built GPT-2 trains 3 steps on CPU with a plan
that steps the optimizer in backward and chunks the loss (MemfitTrainer runs memfit's own step),
or with a plan a callback applies; each logs memfit's prediction and the measured peak of the
steps that log (the second step on: the optimizer's states appear in the first), within 1%.
MemfitTrainer trains as memfit.apply's loop exactly and as a plain loop to the float order the
chunked loss changes. Plans the Trainer cannot run are refused in one line before a step runs."""

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.data.data_collator import default_data_collator  # noqa: E402

import memfit  # noqa: E402
from memfit.errors import UserError  # noqa: E402
from memfit.integrations.apply import estimate_applied, workload_of  # noqa: E402
from memfit.integrations.transformers import MEASURED, PREDICTED, MemfitCallback, MemfitTrainer  # noqa: E402
from memfit.memory.budget import Budget  # noqa: E402
from memfit.planner import cost  # noqa: E402

CONFIG = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
BATCH, STEPS, LR = 4, 3, 1e-3
PLAN = {"optimizer_in_backward": True, "loss_chunks": 4}


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, each its own labels (a causal LM's batch)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, CONFIG["vocab_size"], (CONFIG["n_positions"],), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _model():
    torch.manual_seed(1)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def _args(tmp_path, **changes):
    args = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, logging_steps=1,
                report_to=[], use_cpu=True, save_strategy="no", train_sampling_strategy="sequential", learning_rate=LR,
                lr_scheduler_type="constant", max_grad_norm=0.0, disable_tqdm=True)
    return TrainingArguments(**{**args, **changes})


def _peaks(trainer) -> dict[int, tuple[int, int]]:
    """step -> (predicted, measured) from the Trainer's log history."""
    return {h["step"]: (h[PREDICTED], h[MEASURED]) for h in trainer.state.log_history if MEASURED in h}


def _assert_measured_as_predicted(trainer) -> int:
    peaks = _peaks(trainer)
    assert sorted(peaks) == [2, 3]  # every logging step but the first (not steady yet)
    for step, (predicted, measured) in peaks.items():
        assert abs(measured - predicted) <= 0.01 * measured, (step, predicted, measured)
    return peaks[3][1]


class InBackwardProbe(MemfitTrainer):
    """Records, for each training_step, whether backward left no gradient and changed a parameter
    (the optimizer stepped in backward, before the Trainer's optimizer.step()). It copies one small
    parameter only: the copy is in the measured step."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        watched = model.transformer.ln_f.weight
        before = watched.detach().clone()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.probe.append((all(p.grad is None for p in model.parameters()), not torch.equal(before, watched)))
        return loss


def _count_real(calls, module, inputs, out):
    if type(out) is torch.Tensor:
        calls.append(1)


def test_memfit_trainer_runs_in_backward_and_chunked_loss_and_logs_its_predicted_peak(tmp_path):
    runs = {}
    for name, plan in (("plan", PLAN), ("plain", {})):
        model = _model()
        head_calls = []  # (the prediction's fake copy has the hook too: real outputs only)
        model.lm_head.register_forward_hook(functools.partial(_count_real, head_calls))
        trainer = InBackwardProbe(model=model, args=_args(tmp_path), train_dataset=Tokens(), plan=plan)
        trainer.probe = []
        trainer.train()
        _assert_measured_as_predicted(trainer)
        runs[name] = trainer, head_calls
    trainer, head_calls = runs["plan"]
    assert trainer.probe == [(True, True)] * STEPS  # updated in backward, no gradient left
    assert not head_calls  # the chunked loss applies the head's weight itself; the full logits never exist
    assert runs["plain"][0].probe == [(False, False)] * STEPS and len(runs["plain"][1]) == STEPS
    (planned, saved), (planned_plain, saved_plain) = _peaks(runs["plan"][0])[3], _peaks(runs["plain"][0])[3]
    assert saved < saved_plain  # what the plan saves, measured, is what memfit predicted it saves
    assert abs((saved_plain - saved) - (planned_plain - planned)) <= 0.01 * saved_plain


@pytest.mark.parametrize("plan", [PLAN, {"micro_batch_size": 2, "max_grad_norm": 1.0}], ids=["in-backward", "micro-batches"])
def test_memfit_trainer_trains_as_memfit_apply_and_a_plain_loop(tmp_path, plan):
    clip = plan.get("max_grad_norm") or 0.0
    trainer = MemfitTrainer(model=_model(), args=_args(tmp_path, max_grad_norm=clip), train_dataset=Tokens(), plan=plan)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    ds = Tokens()
    batches = [default_data_collator([ds[i] for i in range(s * BATCH, (s + 1) * BATCH)]) for s in range(STEPS)]
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(trainer.args)

    def optimizer(params):  # the Trainer's: its optim (fused AdamW), lr and betas, no weight decay (the default)
        return cls(params, weight_decay=0.0, **kwargs)

    model = _model()
    step = memfit.apply(model, plan, batch_size=BATCH, optimizer_factory=_as_the_trainer(trainer, model), device="cpu")
    applied = []
    for b in batches:
        step.zero_grad()
        applied.append(float(step.forward_backward(b)))
        step.update()
    plain, opt, plain_losses = _model(), None, []
    opt = optimizer(plain.parameters())
    for b in batches:
        opt.zero_grad()
        loss = plain(**b).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
        opt.step()
        plain_losses.append(loss.item())
    # the same step on the same batches: equal; a plain loop: to the float order of the chunked loss's or
    # the micro-batches' sums
    assert losses == pytest.approx(applied, rel=1e-6)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for (name, p), q, r in zip(trainer.model.named_parameters(), step.model.parameters(), plain.parameters()):
        assert torch.equal(p, q), name
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5, msg=name)


def _as_the_trainer(trainer, model):
    """The Trainer's optimizer (its optim, lr and betas, no weight decay: the default) over ``model``'s
    parameters, in the Trainer's groups: decayed, then not. Clipping sums the gradients' norms in the
    optimizer's order, so one group of the same parameters clips by a norm an ulp apart."""
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(trainer.args)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = set(trainer.get_decay_parameter_names(model))

    def build(params):
        params = list(params)
        return cls([{"params": [p for p in params if names[id(p)] in decay], "weight_decay": 0.0},
                    {"params": [p for p in params if names[id(p)] not in decay], "weight_decay": 0.0}], **kwargs)
    return build


class Recorder(TrainerCallback):
    """A reporting integration's stand-in, listed before MemfitCallback: what its on_log is given."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_the_callback_alone_measures_a_plain_trainers_step_and_applies_checkpointing(tmp_path):
    peaks = {}
    for plan in ({}, {"checkpointing": "blocks"}):
        model, recorder = _model(), Recorder()
        trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=Tokens(), callbacks=[recorder])
        MemfitCallback(plan=plan).attach(trainer)
        trainer.train()
        peaks[plan.get("checkpointing", "none")] = _assert_measured_as_predicted(trainer)
        checkpointed = ["forward" in vars(block) for block in model.transformer.h]
        assert checkpointed == [bool(plan)] * CONFIG["n_layer"]  # memfit's checkpointing, applied in place
        # the reporters (report_to's callbacks) see memfit's values: attach put it ahead of them
        assert [MEASURED in logs for logs in recorder.logs[:STEPS]] == [False, True, True]
    assert peaks["blocks"] < peaks["none"]


def test_a_budget_is_planned_on_the_trainers_model_and_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "MIN_TIMED_SECONDS", 0.0)  # (the planner's CPU timings: a few steps are enough here)
    default = estimate_applied(
        _model(), {}, batch_size=BATCH, device="cpu",
        example_batch=lambda n: default_data_collator([Tokens()[i] for i in range(n)])).measurable_peak_bytes
    budget = int(default * 0.8)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    seen = []

    class BeforeTheFirstStep(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):  # planned by now
            seen.extend(torch.equal(p, b.to(p.dtype)) for p, b in zip(model.parameters(), before))

    trainer = MemfitTrainer(model=model, args=_args(tmp_path), train_dataset=Tokens(), budget=budget,
                            callbacks=[BeforeTheFirstStep()])
    trainer.train()
    assert seen and all(seen)  # planning timed and traced copies: the model is as it was (in the plan's dtype)
    assert trainer.memfit.plan != memfit.Plan() and trainer.memfit.predicted_peak_bytes <= Budget.resolve(
        budget, memfit.get_device("cpu")).bytes
    _assert_measured_as_predicted(trainer)


class Hog(TrainerCallback):
    """Holds 4 MiB (more than the whole step) from before the optimizer step to the step's end."""

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.held = torch.ones(2**20)

    def on_step_end(self, args, state, control, **kwargs):
        self.held = None


def test_a_run_above_its_prediction_is_warned_about(tmp_path):
    trainer = Trainer(model=_model(), args=_args(tmp_path), train_dataset=Tokens(),
                      callbacks=[MemfitCallback(plan={}), Hog()])
    with pytest.warns(UserWarning, match="measured peak of step 2, .* exceeds the predicted"):
        trainer.train()
    predicted, measured = _peaks(trainer)[3]
    assert measured > 4 * 2**20 > predicted


def test_trainer_checkpoints_carry_memfits_optimizer(tmp_path):
    """Saved at step 2 and resumed (the per-parameter optimizers' states and the EMA included): the
    run ends where an uninterrupted one does."""
    plan = {**PLAN, "ema": {"decay": 0.5, "device": "cpu"}}
    whole = MemfitTrainer(model=_model(), args=_args(tmp_path, save_strategy="steps", save_steps=2),
                          train_dataset=Tokens(), plan=plan)
    whole.train()
    resumed = MemfitTrainer(model=_model(), args=_args(tmp_path, save_strategy="steps", save_steps=2),
                            train_dataset=Tokens(), plan=plan)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    a, b = (t.memfit_step.ema.state_dict() for t in (whole, resumed))
    assert a["updates"] == b["updates"] > 2 and a["shadow"].keys() == b["shadow"].keys()
    for name in a["shadow"]:
        assert torch.equal(a["shadow"][name], b["shadow"][name]), name


def test_the_planners_look_at_the_model_is_a_meta_copy():
    """The planner builds the workload's model under the meta device to see its structure: a copy
    holding no memory, never the user's model moved there (which would lose its weights)."""
    model = _model()
    with torch.device("meta"):
        seen = workload_of(model, batch_size=BATCH).model()
    assert seen is not model and all(p.is_meta for p in seen.parameters())
    assert not any(p.is_meta for p in model.parameters())


def _refused(call, *needles):
    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message


@pytest.mark.parametrize("changes, plan, needles", [
    ({"gradient_accumulation_steps": 2}, PLAN, ("gradient_accumulation_steps=2", "in backward")),
    ({"max_grad_norm": 1.0}, PLAN, ("max_grad_norm=1.0", "set max_grad_norm=0.0")),
    ({"bf16": True}, {"precision": "fp16"}, ("bf16=True", "precision: fp16")),
    ({"torch_compile": True}, {}, ("torch_compile=True",)),
    ({"gradient_checkpointing": True}, {}, ("gradient_checkpointing=True",)),
])
def test_memfit_trainer_refuses_trainer_settings_that_double_up_when_made(tmp_path, changes, plan, needles):
    _refused(lambda: MemfitTrainer(model=_model(), args=_args(tmp_path, **changes), train_dataset=Tokens(), plan=plan),
             "MemfitTrainer", *needles)


def test_memfit_trainer_refuses_an_optimizer_of_its_own_and_a_second_plan(tmp_path):
    model = _model()
    _refused(lambda: MemfitTrainer(model=model, args=_args(tmp_path), train_dataset=Tokens(), plan={},
                                   optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None)), "optim=")
    _refused(lambda: MemfitTrainer(model=model, args=_args(tmp_path), train_dataset=Tokens(), plan={},
                                   callbacks=[MemfitCallback(plan={})]), "plan once")
    _refused(lambda: MemfitCallback(), "one of the two")
    _refused(lambda: MemfitCallback(plan={}, budget="1GiB"), "one of the two")


@pytest.mark.parametrize("make", [
    pytest.param(lambda a: Trainer(model=_model(), args=a(), train_dataset=Tokens(), callbacks=[MemfitCallback(plan=PLAN)]),
                 id="in-backward-in-a-plain-trainer"),
    pytest.param(lambda a: Trainer(model=_model(), args=a(), train_dataset=Tokens(),
                                   callbacks=[MemfitCallback(plan={"precision": "bf16"})]), id="arguments-without-bf16"),
    pytest.param(lambda a: Trainer(model=_model(), args=a(gradient_accumulation_steps=2, per_device_train_batch_size=2),
                                   train_dataset=Tokens(), callbacks=[MemfitCallback(plan={})]),
                 id="accumulation-not-in-the-plan"),
    pytest.param(lambda a: MemfitTrainer(model=_model(), args=a(), train_dataset=Tokens(), budget="100KiB"),
                 id="a-budget-below-the-weights"),
])
def test_a_plan_the_trainer_cannot_run_is_one_line_before_the_first_step(tmp_path, make):
    trainer = make(functools.partial(_args, tmp_path))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(UserError) as info:
        trainer.train()
    assert "\n" not in str(info.value)
    assert trainer.state.global_step == 0
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))  # nothing of the run lost


@pytest.mark.parametrize("changes, plan, taken", [
    ({}, dict(checkpointing="blocks", loss_chunks=4), dict(max_grad_norm=1.0)),  # the issue's own example
    ({"bf16": True}, dict(checkpointing="blocks"), dict(max_grad_norm=1.0, precision="bf16")),
], ids=["default-clipping", "bf16"])
def test_the_trainers_own_clipping_and_precision_are_taken_into_the_plan(tmp_path, changes, plan, taken):
    """Issue 32: TrainingArguments' default max_grad_norm=1.0 (and bf16=True) with a plan that leaves
    clipping and precision open train with them: the plan takes them, the prediction includes them
    (measured within 1%), and the run equals memfit.apply's loop with that plan exactly."""
    args = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH, logging_steps=1,
                report_to=[], use_cpu=True, save_strategy="no", train_sampling_strategy="sequential",
                learning_rate=LR, lr_scheduler_type="constant", disable_tqdm=True, **changes)  # max_grad_norm: 1.0
    trainer = MemfitTrainer(model=_model(), args=TrainingArguments(**args), train_dataset=Tokens(),
                            plan=memfit.Plan(**plan))
    trainer.train()
    taken = memfit.Plan(**plan, **taken)
    assert trainer.memfit.plan == taken
    _assert_measured_as_predicted(trainer)
    model = _model()
    step = memfit.apply(model, taken, batch_size=BATCH, device="cpu", optimizer_factory=_as_the_trainer(trainer, model))
    ds = Tokens()
    for s in range(STEPS):
        step(default_data_collator([ds[i] for i in range(s * BATCH, (s + 1) * BATCH)]))
    for (name, p), q in zip(trainer.model.named_parameters(), step.model.parameters()):
        assert torch.equal(p, q), name


def test_memfit_trainer_trains_a_peft_model(tmp_path):
    """Issue 28: a LoRA built by the user with get_peft_model, in MemfitTrainer with checkpointing and
    the Trainer's default clipping: measured as predicted, the adapter moves, the base does not."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                          fan_in_fan_out=True))
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = MemfitTrainer(model=model, args=_args(tmp_path, max_grad_norm=1.0), train_dataset=Tokens(),
                            plan={"checkpointing": "blocks"})
    trainer.train()
    _assert_measured_as_predicted(trainer)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), base[n])}
    assert moved and all("lora_" in n for n in moved)
    assert any("lora_B" in n for n in moved)


def test_memfit_apply_runs_a_peft_model_in_the_users_loop():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model(), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    step = memfit.apply(model, {"checkpointing": "blocks"}, batch_size=BATCH)
    batch = default_data_collator([Tokens()[i] for i in range(BATCH)])
    for _ in range(2):
        step(batch)
    trained = sum(p.numel() for g in step.optimizer.param_groups for p in g["params"])
    assert trained == sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * 4 * (64 + 192)


def test_a_plain_trainers_bf16_peft_model_runs_bf16_base_as_predicted(tmp_path):
    """A model loaded in bf16 and given peft's LoRA (kept in fp32 by get_peft_model), trained by a plain
    Trainer(bf16=True): the step is bf16-base (NOTE [ The adapter users' precision ]), measured as
    predicted; a plan in bf16-pure is not what that Trainer runs, and says so in one line."""
    peft = pytest.importorskip("peft")

    def bf16_peft():
        return peft.get_peft_model(_model().to(torch.bfloat16), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))
    model = bf16_peft()
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    trainer = Trainer(model=model, args=_args(tmp_path, bf16=True), train_dataset=Tokens())
    MemfitCallback(plan={"precision": "bf16-base", "checkpointing": "blocks"}).attach(trainer)
    trainer.train()
    _assert_measured_as_predicted(trainer)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    trainer = Trainer(model=bf16_peft(), args=_args(tmp_path, bf16=True, max_steps=1), train_dataset=Tokens())
    MemfitCallback(plan={"precision": "bf16-pure"}).attach(trainer)
    with pytest.raises(UserError, match=r"the Trainer's arguments run \{'precision': 'bf16-base'\}") as e:
        trainer.train()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("half,flag,runs", [(torch.bfloat16, "bf16", "bf16-base"), (torch.float16, "fp16", "fp16-base"),
                                            (None, "bf16", "bf16-pure"), (torch.bfloat16, None, "bf16-base-noautocast")])
def test_the_trainers_precision_is_read_from_the_models_dtypes(half, flag, runs):
    """bf16=True / fp16=True over a peft model loaded in 16 bits (the adapter fp32): bf16-base / fp16-base;
    bf16=True over a model loaded in bf16 without an adapter: bf16-pure; neither flag over the peft model: the
    same loop without autocast (each adapted layer's input cast to fp32 by peft), bf16-base-noautocast."""
    from memfit.integrations.transformers import _trainer_runs
    from memfit.techniques.base import Export
    peft = pytest.importorskip("peft")
    model = _model().to(half or torch.bfloat16)
    if half is not None:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    assert _trainer_runs(Export(BATCH, hf={flag: True} if flag else {}), model)["precision"] == runs
