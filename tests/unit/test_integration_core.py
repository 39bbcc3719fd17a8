"""integrations.core: each technique maps a trainer's arguments back to its config (the reverse of
its export), the trainer's hyperparameters go into a plan where it leaves them open, and a true
conflict is one line naming the argument."""

import pytest

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.core import take_arguments, trainer_configs
from memfit.integrations.export import export
from memfit.plans import Plan
from memfit.techniques.base import Export

CPU = get_device("cpu")


@pytest.mark.parametrize("plan", [Plan(precision="bf16", max_grad_norm=0.5), Plan(precision="fp16"),
                                  Plan(checkpointing="blocks", compile="full", micro_batch_size=2),
                                  Plan(optimizer="adafactor", precision="bf16-pure"),
                                  Plan(adapter="lora:r=4", precision="bf16-base")])
@pytest.mark.parametrize("trainer", ["hf", "lightning"])
def test_what_a_plan_exports_maps_back_to_its_configs(plan, trainer):
    exported = export(plan, 8, CPU)
    given = Export(exported.batch_size, **{trainer: getattr(exported, trainer)})
    back = trainer_configs(given)
    assert back or (trainer == "lightning" and plan.compile == "full"), plan  # (Lightning: none of those)
    for name, config in back.items():
        ours = plan.config(name)
        # (bf16-pure and bf16-base export bf16=True to TrainingArguments, bf16-base bf16-mixed to Lightning; the
        # model's dtypes say which: the HF adapter)
        same = config == ours or (name == "precision" and (trainer == "hf" and ours.text == "bf16-pure"
                                                           or ours.text == "bf16-base"))
        assert same or (name == "accumulation" and config.micro_batches(8) == ours.micro_batches(8)), (name, config, ours)


def test_the_trainers_clipping_and_precision_fill_what_the_plan_leaves_open():
    given = Export(8, hf={"max_grad_norm": 1.0, "bf16": True})
    assert take_arguments(Plan(loss_chunks=4), given, "hf", who="T", device=CPU) == Plan(
        loss_chunks=4, max_grad_norm=1.0, precision="bf16")
    fp16 = Export(8, hf={"fp16": True})
    assert take_arguments(Plan(precision="auto"), fp16, "hf", who="T", device=CPU).precision == "fp16"
    assert take_arguments(Plan(max_grad_norm=1.0), given, "hf", who="T", device=CPU).max_grad_norm == 1.0


@pytest.mark.parametrize("plan, given, needles", [
    (Plan(optimizer_in_backward=True), Export(8, hf={"max_grad_norm": 1.0}),
     ("T: TrainingArguments(max_grad_norm=1.0) cannot run", "optimizer_in_backward", "set max_grad_norm=0.0")),
    (Plan(max_grad_norm=0.5), Export(8, lightning={"gradient_clip_val": 2.0}),
     ("Trainer(gradient_clip_val=2.0", "the plan runs max_grad_norm: 0.5", "set Trainer(gradient_clip_val=0.5")),
    (Plan(precision="fp16"), Export(8, lightning={"precision": "bf16-mixed"}),
     ("Trainer(precision='bf16-mixed') but the plan runs precision: fp16", "set Trainer(precision='16-mixed')")),
])
def test_a_true_conflict_is_one_line(plan, given, needles):
    with pytest.raises(UserError) as info:
        take_arguments(plan, given, "lightning" if given.lightning else "hf", who="T", device=CPU)
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message
