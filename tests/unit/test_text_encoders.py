"""Text encoders in the step (memfit.workloads.text_encoders): an SD or SDXL UNet with its CLIP encoders frozen
or trained, predicted within 1% of the profiler on a real CPU step; what trains in each mode; the encoders'
weights counted where they are on the device; bad values in one line."""

import pytest
import torch

from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.step import build_step
from memfit.target import Target

pytest.importorskip("diffusers")

SDXL = ("unet-sdxl:block_out_channels=32/64/64,attention_head_dim=2,transformer_layers_per_block=1,"
        "cross_attention_dim=32,addition_time_embed_dim=8,projection_class_embeddings_input_dim=80")
SD15 = ("unet-sd15:block_out_channels=32/64,down_block_types=CrossAttnDownBlock2D/DownBlock2D,"
        "up_block_types=UpBlock2D/CrossAttnUpBlock2D,attention_head_dim=2,cross_attention_dim=32,layers_per_block=1")


def _with(spec: str, mode: str) -> str:
    return f"{spec},text_encoders={mode},text_layers=2"


@pytest.mark.parametrize("spec,mode,fields", [
    pytest.param(SDXL, "trained", dict(adapter="lora:r=4", precision="bf16", checkpointing="blocks"), id="sdxl-trained"),
    pytest.param(SD15, "frozen", dict(adapter="lora:r=4"), id="sd15-frozen", marks=pytest.mark.slow),
    pytest.param(SDXL, "frozen", dict(adapter="lora:r=4", precision="bf16", checkpointing="blocks"), id="sdxl-frozen",
                 marks=pytest.mark.slow),
    pytest.param(SD15, "trained", dict(precision="bf16-pure"), id="sd15-trained-full", marks=pytest.mark.slow),
])
def test_a_unet_with_its_text_encoders_is_predicted_within_1pct(spec, mode, fields):
    r = profile(_with(spec, mode), Plan(**fields), batch_size=2, resolution=128, repeats=0)
    assert abs(r.error_percent) <= 1.0, (mode, fields, r.error_percent)


def _trained(spec: str, plan: Plan) -> tuple[list[str], torch.nn.Module]:
    step = build_step(Target.resolve(spec, plan, 2, "cpu", resolution=128))
    step(step.target.workload.batch(2))
    return [n for n, p in step.model.named_parameters() if p.requires_grad], step.model


def test_frozen_encoders_take_no_adapter_and_trained_ones_take_the_clip_projections():
    """Frozen: no encoder weight trains, and no adapter layer goes into them, all-linear included. Trained
    with a LoRA: the encoders' attention and MLP projections are adapted beside the UNet's attention
    (kohya's text-encoder LoRA), and they get gradients; trained without one: every encoder weight trains."""
    for targets in ("", ",targets=all-linear"):
        names, _ = _trained(_with(SD15, "frozen"), Plan(adapter=f"lora:r=4{targets}"))
        assert names and not [n for n in names if n.startswith("text_encoders")]
    names, model = _trained(_with(SDXL, "trained"), Plan(adapter="lora:r=4"))
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names if n.startswith("text_encoders")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if n.startswith("text_encoders") and "lora_B" in n)
    names, model = _trained(_with(SD15, "trained"), Plan())
    encoder = [n for n, _ in model.text_encoders.named_parameters()]
    assert {f"text_encoders.{n}" for n in encoder} <= set(names)


def test_frozen_encoders_weights_are_on_the_device_and_sdxl_conditions_on_both():
    """The encoders' weights are what a frozen run adds to the cached one's parameters; SDXL attends to CLIP-L's
    and bigG's penultimate states side by side (the UNet's 32-wide context here: 12 + 20) and takes bigG's
    projected pooled output."""
    cached = estimate(SDXL, Plan(adapter="lora:r=4"), batch_size=1, resolution=128)
    frozen = estimate(_with(SDXL, "frozen"), Plan(adapter="lora:r=4"), batch_size=1, resolution=128)
    step = build_step(Target.resolve(_with(SDXL, "frozen"), Plan(adapter="lora:r=4"), 1, "cpu", resolution=128))
    encoders = sum(p.numel() * p.element_size() for p in step.model.text_encoders.parameters())
    assert frozen.breakdown["parameters"] - cached.breakdown["parameters"] == encoders
    assert [e.config.hidden_size for e in step.model.text_encoders] == [12, 20]
    hidden, pooled = step.model.encode(step.target.workload.batch(1)["ids"])
    assert tuple(hidden.shape) == (1, 77, 32) and tuple(pooled.shape) == (1, 32)
    assert step.target.workload.name == "unet-sdxl 128px, text encoders frozen"


@pytest.mark.parametrize("spec,message", [
    (f"{SD15},text_encoders=cache", "text_encoders=cache is not one of cached, frozen, trained"),
    (f"{SD15},text_layers=2", "text_layers=2 needs text_encoders=frozen or trained"),
    ("unet-sdxl:block_out_channels=32/64/64,attention_head_dim=2,transformer_layers_per_block=1,cross_attention_dim=1,"
     "addition_time_embed_dim=8,projection_class_embeddings_input_dim=80,text_encoders=frozen",
     "cross_attention_dim=1 cannot hold two text encoders side by side"),
])
def test_bad_text_encoder_values_are_one_line(spec, message):
    with pytest.raises(UserError, match=message) as e:
        estimate(spec, Plan(), batch_size=1, resolution=128)
    assert "\n" not in str(e.value)
