"""Exports that say what runs: ``TrainingArguments(**kwargs)`` / ``Trainer(**kwargs)`` take them unchanged.

Each plan's Hugging Face arguments are given to the installed transformers' ``TrainingArguments``,
and what runs is read back from the object it built (batch per device, accumulation, precision,
checkpointing, optimizer, clipping, compile, CPU), not from the dict memfit wrote. Where accelerate
is missing (``TrainingArguments`` needs it only to pick a device) and where the plan is for a GPU
this machine lacks (its bf16 check looks at the local GPU), those two machine checks are stood in
for; every argument is still parsed and validated by transformers itself.

Lightning's ``Trainer`` is checked against its 2.x signature, pinned below from lightning's source;
where lightning is installed the pin is checked against the real signature and CPU plans build a
real ``Trainer``. What neither carries is listed as plan keys, with memfit's callback named.
"""

import copy
import importlib.util
import inspect

import pytest

from memfit.devices import get_device
from memfit.integrations.export import HF_CALLBACK, HF_TRAINER, LIGHTNING_CALLBACK, to_hf, to_lightning
from memfit.plans import Plan

HF_OPTIM = {"adamw": "adamw_torch", "adamw8bit": "adamw_bnb_8bit", "adafactor": "adafactor", "sgd": "sgd",
            "adamw8bit-paged": "paged_adamw_8bit", "adamw-paged": "paged_adamw_32bit"}
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-pure": "bf16-true"}

# (id, plan, global batch, device, plan keys TrainingArguments cannot carry, ... Lightning's Trainer cannot)
PLANS = [
    ("fp32 cpu", Plan(), 8, "cpu", set(), set()),
    ("bf16 h100", Plan(precision="bf16"), 8, "h100-80gb", set(), set()),
    ("fp16 t4", Plan(precision="fp16"), 8, "t4", set(), set()),
    ("auto resolves to fp16 on a t4", Plan(precision="auto"), 8, "t4", set(), set()),
    ("auto without a device", Plan(precision="auto"), 8, None, {"precision"}, {"precision"}),
    ("bf16-pure kahan", Plan(precision="bf16-pure", bf16_update="kahan"), 8, "h100-80gb", {"bf16_update"},
     {"bf16_update"}),
    ("blocks", Plan(checkpointing="blocks"), 8, "cpu", set(), {"checkpointing"}),
    ("every 2nd block", Plan(checkpointing="blocks:every=2"), 8, "a100-40gb", {"checkpointing"}, {"checkpointing"}),
    ("selective bf16", Plan(checkpointing="selective", precision="bf16"), 8, "h100-80gb", {"checkpointing"},
     {"checkpointing"}),
    ("micro-batches", Plan(micro_batch_size=2), 8, "cpu", set(), set()),
    ("accumulation", Plan(grad_accum_steps=4), 16, "rtx4090", set(), set()),
    ("adafactor", Plan(optimizer="adafactor"), 8, "cpu", set(), {"optimizer"}),
    ("adamw8bit bf16", Plan(optimizer="adamw8bit", precision="bf16"), 8, "h100-80gb", set(), {"optimizer"}),
    ("sgd clipped", Plan(optimizer="sgd", max_grad_norm=0.5), 8, "cpu", set(), {"optimizer"}),
    ("paged 8-bit bf16", Plan(optimizer="adamw8bit-paged", precision="bf16"), 8, "h100-80gb", set(), {"optimizer"}),
    ("paged fp32 states", Plan(optimizer="adamw-paged"), 8, "rtx4090", set(), {"optimizer"}),
    ("compile full", Plan(compile="full"), 8, "h100-80gb", set(), {"compile"}),
    ("compile blocks", Plan(compile="blocks", checkpointing="blocks"), 8, "h100-80gb", {"compile"},
     {"compile", "checkpointing"}),
    ("memfit's own techniques", Plan(precision="bf16", optimizer_in_backward=True, loss_chunks=4,
                                      ema={"decay": 0.999}, offload=["activations"], attention="chunked"),
     8, "h100-80gb", {"optimizer_in_backward", "loss_chunks", "ema", "offload", "attention"},
     {"optimizer_in_backward", "loss_chunks", "ema", "offload", "attention"}),
    ("offloaded optimizer states", Plan(offload=["optimizer_states"], attention="math"), 8, "h100-80gb",
     {"offload", "attention"}, {"offload", "attention"}),
    ("sdpa", Plan(attention="sdpa"), 8, "cpu", set(), set()),
]
IDS = [p[0] for p in PLANS]


def _keys(unmapped) -> set[str]:
    return {line.split(":")[0] for line in unmapped}


def _precision(plan: Plan, device) -> str:
    return plan.config("precision").resolve(get_device(device)).name if device else plan.precision


@pytest.mark.parametrize("name,plan,batch,device,hf_unmapped,_", PLANS, ids=IDS)
def test_training_arguments_take_the_export_unchanged_and_run_the_plan(target_machine, name, plan, batch, device,
                                                                       hf_unmapped, _):
    export = to_hf(plan, batch, device)
    args = target_machine(device, **copy.deepcopy(export.kwargs))
    micro, n = plan.micro_batches(batch)
    precision = _precision(plan, device)
    # what changes the step itself runs in MemfitTrainer, whose own step does accumulation, precision,
    # checkpointing and compile: the arguments leave those off
    in_trainer = bool(hf_unmapped - {"checkpointing", "attention"})
    assert export.callback == (HF_TRAINER if in_trainer else HF_CALLBACK)
    if in_trainer:
        assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (micro * n, 1)
        assert not (args.bf16 or args.fp16 or args.gradient_checkpointing or args.torch_compile)
        assert _keys(export.unmapped) >= hf_unmapped and all(": " in line for line in export.unmapped)
        return
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (micro, n)
    assert args.bf16 == (precision in ("bf16", "bf16-pure")) and args.fp16 == (precision == "fp16")
    assert args.gradient_checkpointing == (plan.checkpointing == "blocks")
    if args.gradient_checkpointing:
        assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.optim.value == HF_OPTIM[plan.optimizer]
    assert args.optim_args == ("momentum=0.9" if plan.optimizer == "sgd" else None)
    assert args.max_grad_norm == (plan.max_grad_norm or 0.0)  # the Trainer's own default would clip at 1.0
    assert args.torch_compile == (plan.compile == "full")
    assert args.use_cpu == (device == "cpu")
    assert args.output_dir == "trainer_output"
    assert _keys(export.unmapped) == hf_unmapped
    assert all(": " in line for line in export.unmapped)  # as plan keys: `loss_chunks: 4`
    assert (export.callback_line() is not None) == bool(hf_unmapped) and export.callback == HF_CALLBACK
    if precision == "bf16-pure":
        assert any("dtype=torch.bfloat16" in note for note in export.notes)
    if plan.attention == "sdpa":
        assert any("attn_implementation='sdpa'" in note for note in export.notes)


def test_the_printed_line_is_python_that_builds_the_arguments(target_machine):
    plan = Plan(precision="bf16", micro_batch_size=2, checkpointing="blocks", optimizer="sgd", attention="chunked")
    export = to_hf(plan, 8, "h100-80gb")
    line = export.python()
    assert line.startswith("TrainingArguments(**{") and '"gradient_checkpointing": True' in line
    args = eval(line, {"TrainingArguments": lambda **kw: target_machine("h100-80gb", **kw)})  # noqa: S307
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.optim.value) == (2, 4, "sgd")
    assert export.callback_line("my plan.yaml") == (f"{HF_CALLBACK}(plan='my plan.yaml') in the Trainer's callbacks "
                                                    "applies these")
    assert "--out plan.yaml" in export.callback_line()
    lightning = to_lightning(plan, 8, "h100-80gb")
    assert eval(lightning.python(), {"Trainer": dict}) == lightning.kwargs  # noqa: S307


# Lightning 2.x ``Trainer.__init__`` (src/lightning/pytorch/trainer/trainer.py, and the precision
# values of lightning/fabric/connector.py's _PRECISION_INPUT_STR): the arguments memfit writes.
LIGHTNING_TRAINER = {
    "accelerator": lambda v: v in ("cpu", "gpu", "cuda", "mps", "tpu", "auto"),
    "devices": lambda v: (isinstance(v, int) and not isinstance(v, bool) and v >= 1) or v == "auto",
    "strategy": lambda v: v in ("auto", "ddp", "fsdp", "deepspeed", "single_device"),
    "precision": lambda v: v in ("64-true", "32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"),
    "accumulate_grad_batches": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    "gradient_clip_val": lambda v: isinstance(v, (int, float)) and v > 0,
    "gradient_clip_algorithm": lambda v: v in ("norm", "value"),
}


@pytest.mark.parametrize("name,plan,batch,device,_,lightning_unmapped", PLANS, ids=IDS)
def test_lightning_trainer_takes_the_export_and_runs_the_plan(name, plan, batch, device, _, lightning_unmapped):
    export = to_lightning(plan, batch, device)
    for key, value in export.kwargs.items():
        assert key in LIGHTNING_TRAINER and LIGHTNING_TRAINER[key](value), (key, value)
    micro, n = plan.micro_batches(batch)
    precision = _precision(plan, device)
    assert export.kwargs["accumulate_grad_batches"] == n
    assert any(f"DataLoader(batch_size={micro})" in note for note in export.notes)
    if precision != "auto":
        assert export.kwargs["precision"] == LIGHTNING_PRECISION[precision]
    assert export.kwargs.get("gradient_clip_val") == plan.max_grad_norm
    if device:
        assert export.kwargs["accelerator"] == ("gpu" if get_device(device).is_gpu else "cpu")
    assert _keys(export.unmapped) == lightning_unmapped
    assert (export.callback_line() is not None) == bool(lightning_unmapped) and export.callback == LIGHTNING_CALLBACK
    _check_with_lightning_if_installed(export.kwargs, device)


def _check_with_lightning_if_installed(kwargs: dict, device) -> None:
    """With lightning installed, the pin above must still be its signature, and a CPU plan builds a
    real Trainer (a GPU plan's cannot be built on this machine: its arguments are bound instead)."""
    if importlib.util.find_spec("lightning") is None:
        return
    import lightning
    params = inspect.signature(lightning.Trainer.__init__).parameters
    assert set(LIGHTNING_TRAINER) <= set(params)
    if device == "cpu" and kwargs.get("precision") != "16-mixed":
        trainer = lightning.Trainer(**kwargs, logger=False, enable_checkpointing=False, enable_progress_bar=False)
        assert trainer.accumulate_grad_batches == kwargs["accumulate_grad_batches"]
    else:
        inspect.signature(lightning.Trainer).bind(**kwargs)


def test_a_lightning_export_that_names_the_callback_leaves_the_micro_batches_to_it():
    """With the callback, memfit's step splits the whole batch (Lightning's manual optimization
    does not accumulate, and the callback refuses accumulate_grad_batches > 1); without it,
    Lightning accumulates micro-batches the DataLoader makes."""
    from memfit.integrations.export import to_lightning
    with_callback = to_lightning(Plan(micro_batch_size=2, checkpointing="selective"), 8, "cpu")
    assert "accumulate_grad_batches" not in with_callback.kwargs
    assert "micro_batch_size: 2" in with_callback.unmapped
    assert any(n.startswith("DataLoader(batch_size=8)") for n in with_callback.notes)
    plain = to_lightning(Plan(micro_batch_size=2), 8, "cpu")
    assert plain.kwargs["accumulate_grad_batches"] == 4 and not plain.unmapped
    assert any(n.startswith("DataLoader(batch_size=2)") for n in plain.notes)


def test_an_hf_export_of_a_plan_that_changes_the_step_is_for_memfit_trainer():
    """In-backward or a chunked loss change the Trainer's step: the export names MemfitTrainer, and
    leaves off what memfit's own step does (accumulation, precision, checkpointing): the arguments
    are ones MemfitTrainer accepts. Checkpointing alone stays with the callback."""
    step_side = to_hf(Plan(precision="bf16", micro_batch_size=2, checkpointing="blocks", loss_chunks=4), 8,
                      "h100-80gb")
    assert step_side.callback == HF_TRAINER
    assert not {"gradient_accumulation_steps", "bf16", "gradient_checkpointing"} & set(step_side.kwargs)
    assert step_side.kwargs["per_device_train_batch_size"] == 8
    assert {"loss_chunks: 4", "micro_batch_size: 2", "precision: bf16", "checkpointing: blocks"} <= set(
        step_side.unmapped)
    model_side = to_hf(Plan(precision="bf16", checkpointing="selective"), 8, "h100-80gb")
    assert model_side.callback == HF_CALLBACK and model_side.kwargs["bf16"] is True
