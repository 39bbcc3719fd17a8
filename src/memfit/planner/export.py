"""Export a plan to Hugging Face TrainingArguments or Lightning Trainer arguments.

What maps is returned as keyword arguments; what has no equivalent there is listed, so nothing
is silently dropped (memfit's TrainStep applies all of it).
"""

from __future__ import annotations

from memfit.plans import Plan

HF_OPTIM = {"adamw": "adamw_torch", "adamw8bit": "adamw_bnb_8bit", "adafactor": "adafactor", "sgd": "sgd"}
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-pure": "bf16-true"}


def to_hf(plan: Plan, batch_size: int) -> tuple[dict, list[str]]:
    micro, n = plan.micro_batches(batch_size)
    kwargs = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": n,
              "optim": HF_OPTIM[plan.optimizer]}
    unmapped = []
    if plan.precision in ("bf16", "bf16-pure"):
        kwargs["bf16"] = True
    elif plan.precision == "fp16":
        kwargs["fp16"] = True
    if plan.precision == "bf16-pure":
        unmapped.append("precision: bf16-pure -> load the model with torch_dtype=torch.bfloat16 "
                        f"(bf16_update: {plan.bf16_update} has no TrainingArguments equivalent)")
    if plan.checkpointing == "blocks":
        kwargs["gradient_checkpointing"] = True
        kwargs["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    elif plan.checkpointing != "none":
        unmapped.append(f"checkpointing: {plan.checkpointing} (TrainingArguments checkpoints every layer only)")
    if plan.optimizer_in_backward:
        unmapped.append("optimizer_in_backward")
    if plan.offload:
        unmapped.append(f"offload: {list(plan.offload)} (needs a DeepSpeed or FSDP offload config)")
    if plan.ema:
        unmapped.append("ema")
    if plan.loss_chunks:
        unmapped.append(f"loss_chunks: {plan.loss_chunks}")
    if plan.attention == "chunked":
        unmapped.append("attention: chunked")
    elif plan.attention == "sdpa":
        unmapped.append("attention: sdpa -> pass attn_implementation='sdpa' to from_pretrained")
    return kwargs, unmapped


def to_lightning(plan: Plan, batch_size: int) -> tuple[dict, list[str]]:
    micro, n = plan.micro_batches(batch_size)
    kwargs = {"precision": LIGHTNING_PRECISION[plan.precision], "accumulate_grad_batches": n}
    unmapped = [f"micro-batch size {micro}: set it as the DataLoader's batch_size"]
    for name, value in (("checkpointing", plan.checkpointing != "none"), ("optimizer", plan.optimizer != "adamw"),
                        ("optimizer_in_backward", plan.optimizer_in_backward), ("offload", bool(plan.offload)),
                        ("ema", bool(plan.ema)), ("loss_chunks", bool(plan.loss_chunks)),
                        ("attention", plan.attention == "chunked")):
        if value:
            unmapped.append(f"{name}: {getattr(plan, name)} (configure it in the LightningModule)")
    return kwargs, unmapped
