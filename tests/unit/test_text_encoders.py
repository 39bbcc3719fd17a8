"""Text encoders in the step (memfit.workloads.text_encoders): an SD or SDXL UNet with its CLIP encoders,
FLUX.1 with CLIP-L and T5-XXL, SD3 with CLIP-L, CLIP-G and T5-XXL, Lumina 2 with Gemma-2, and Z-Image with Qwen3, frozen or trained, predicted within 1% of the profiler on a real CPU step; what
trains in each mode; the encoders' weights counted where they are on the device; the denoiser's blocks last
(what block swap streams); bad values in one line."""

import pytest
import torch

from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.step import build_step
from memfit.target import Target
from memfit.workloads import text_encoders as te

pytest.importorskip("diffusers")

SDXL = ("unet-sdxl:block_out_channels=32/64/64,attention_head_dim=2,transformer_layers_per_block=1,"
        "cross_attention_dim=32,addition_time_embed_dim=8,projection_class_embeddings_input_dim=80")
FLUX = ("dit-flux:num_layers=2,num_single_layers=3,attention_head_dim=16,num_attention_heads=2,"
        "joint_attention_dim=32,pooled_projection_dim=24,axes_dims_rope=4/6/6")
SD3 = ("dit-sd3:num_layers=2,num_attention_heads=2,attention_head_dim=16,joint_attention_dim=32,"
       "caption_projection_dim=32,pooled_projection_dim=16,pos_embed_max_size=16")
LUMINA = ("dit-lumina2:num_layers=2,num_refiner_layers=1,hidden_size=64,num_attention_heads=4,num_kv_heads=2,"
          "cap_feat_dim=32,axes_dim_rope=8/4/4,multiple_of=16")
ZIMAGE = ("dit-zimage:dim=64,n_layers=2,n_refiner_layers=1,n_heads=4,n_kv_heads=4,cap_feat_dim=32,axes_dims=8/4/4,"
          "caption_tokens=40")
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
    pytest.param(FLUX, "trained", dict(adapter="lora:r=4", precision="bf16-base", checkpointing="blocks",
                                       swap_blocks=3), id="flux-trained"),
    pytest.param(FLUX, "trained,t5=cached", dict(adapter="lora:r=4", precision="bf16"), id="flux-t5-cached"),
    pytest.param(FLUX, "frozen", dict(adapter="lora:r=4", base_weights="fp8", precision="bf16-base"),
                 id="flux-frozen-fp8", marks=pytest.mark.slow),
    pytest.param(SD3, "trained", dict(adapter="lora:r=4", precision="bf16-base", checkpointing="blocks"),
                 id="sd3-trained"),
    pytest.param(SD3, "trained,t5=cached", dict(adapter="lora:r=4"), id="sd3-t5-cached", marks=pytest.mark.slow),
    pytest.param(LUMINA, "trained", dict(adapter="lora:r=4", precision="bf16-base", checkpointing="blocks"),
                 id="lumina-trained"),
    pytest.param(LUMINA, "frozen", dict(adapter="lora:r=4"), id="lumina-frozen", marks=pytest.mark.slow),
    pytest.param(ZIMAGE, "frozen", dict(adapter="lora:r=4,targets=in-blocks:layers", base_weights="fp8",
                                        precision="bf16-base-noautocast", checkpointing="blocks"), id="zimage-frozen-fp8"),
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
    (f"{FLUX},t5=cache", "t5=cache is not one of cached, frozen"),
    (f"{FLUX},t5=frozen", "t5=frozen needs text_encoders=frozen or trained"),
    (f"{SD15},text_encoders=frozen,t5=cached", "t5= and t5_tokens= apply to the models with a T5-XXL"),
    (f"{LUMINA},t5_tokens=77", "t5= and t5_tokens= apply to the models with a T5-XXL"),
    ("unet-sdxl:block_out_channels=32/64/64,attention_head_dim=2,transformer_layers_per_block=1,cross_attention_dim=1,"
     "addition_time_embed_dim=8,projection_class_embeddings_input_dim=80,text_encoders=frozen",
     "cross_attention_dim=1 cannot hold two text encoders side by side"),
])
def test_bad_text_encoder_values_are_one_line(spec, message):
    with pytest.raises(UserError, match=message) as e:
        estimate(spec, Plan(), batch_size=1, resolution=128)
    assert "\n" not in str(e.value)


def test_fluxs_clip_l_trains_its_t5_runs_frozen_and_its_blocks_are_the_last():
    """FLUX.1 trained as kohya and diffusers train it: CLIP-L's projections take the LoRA and get gradients, T5
    takes none (all-linear included) and its weights are what a frozen run adds; the DiT gets CLIP-L's pooled
    output and T5's states (32 wide, FLUX.1-dev's 512 tokens); its blocks are the model's last, so the blocks
    swap_blocks streams are the DiT's, as kohya's blocks_to_swap."""
    from memfit.techniques.swap_blocks import model_blocks
    names, model = _trained(_with(FLUX, "trained"), Plan(adapter="lora:r=4,targets=all-linear"))
    clip, t5 = model.text_encoders
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names if n.startswith("text_encoders.0")} == set(
        ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"))
    assert not [n for n in names if n.startswith("text_encoders.1")] and not any(p.requires_grad for p in t5.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in clip.named_parameters() if "lora_B" in n)
    ids = Target.resolve(_with(FLUX, "trained"), Plan(), 1, "cpu", resolution=128).workload.batch(1)["ids"]
    with torch.no_grad():
        states, pooled = model.encode(ids)
        assert torch.equal(pooled, clip(ids[0]).pooler_output)  # (FluxPipeline: CLIP's pooled output, T5's last states)
        assert torch.equal(states, t5(ids[1]).last_hidden_state)
    assert tuple(states.shape) == (1, 512, 32) and tuple(pooled.shape) == (1, 24)
    assert model_blocks(model)[-5:] == [*model.denoiser.transformer_blocks, *model.denoiser.single_transformer_blocks]
    frozen = estimate(_with(FLUX, "frozen"), Plan(adapter="lora:r=4"), batch_size=1, resolution=128)
    cached = estimate(FLUX, Plan(adapter="lora:r=4"), batch_size=1, resolution=128)
    step = build_step(Target.resolve(_with(FLUX, "frozen"), Plan(adapter="lora:r=4"), 1, "cpu", resolution=128))
    encoders = sum(p.numel() * p.element_size() for p in step.model.text_encoders.parameters())
    assert frozen.breakdown["parameters"] - cached.breakdown["parameters"] == encoders
    assert step.target.workload.name == "dit-flux 128px, text encoders frozen"


def test_sd3_trains_both_clips_and_attends_to_their_states_padded_then_t5s():
    """SD3 as StableDiffusion3Pipeline encodes a prompt: CLIP-L's and CLIP-G's penultimate states side by side
    (16 = 6 + 10 wide here), zero-padded to T5's 32, then T5's 256 tokens; their projected pooled outputs side
    by side. Both CLIPs take the LoRA (kohya's sd3_train_network), T5 none; with t5=cached its states are an
    input of the step."""
    names, model = _trained(_with(SD3, "trained"), Plan(adapter="lora:r=4,targets=all-linear"))
    assert {n.split(".")[1] for n in names if n.startswith("text_encoders")} == {"0", "1"}
    assert [e.config.hidden_size for e in model.text_encoders[:2]] == [6, 10]
    ids = Target.resolve(_with(SD3, "trained"), Plan(), 1, "cpu", resolution=128).workload.batch(1)["ids"]
    with torch.no_grad():
        states, pooled = model.encode(ids)
        outs = [e(i, output_hidden_states=True) for e, i in zip(model.text_encoders, ids)]
    assert tuple(states.shape) == (1, 77 + 256, 32) and tuple(pooled.shape) == (1, 16)
    assert torch.equal(states[:, :77, :16], torch.cat([o.hidden_states[-2] for o in outs[:2]], dim=-1))
    assert not states[:, :77, 16:].any() and torch.equal(states[:, 77:], outs[2].last_hidden_state)
    assert torch.equal(pooled, torch.cat([o.text_embeds for o in outs[:2]], dim=-1))
    batch = Target.resolve(_with(SD3, "trained,t5=cached"), Plan(), 1, "cpu", resolution=128).workload.batch(1)
    assert len(batch["ids"]) == 2 and tuple(batch["t5_states"].shape) == (1, 256, 32)
    with pytest.raises(UserError, match="pooled_projection_dim=48 cannot hold CLIP-L and CLIP-G side by side"):
        estimate(SD3.replace("pooled_projection_dim=16", "pooled_projection_dim=48") + ",text_encoders=frozen",
                 Plan(), batch_size=1, resolution=128)


def test_luminas_gemma_takes_the_adapter_where_it_trains_and_gives_its_penultimate_states():
    """Lumina 2 attends to Gemma-2's penultimate states (256 tokens, its caption mask an input of both); trained,
    Gemma's attention and MLP projections take the LoRA (kohya's train_gemma2) and get gradients; frozen, none."""
    names, model = _trained(_with(LUMINA, "trained"), Plan(adapter="lora:r=4"))
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names if n.startswith("text_encoders")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if n.startswith("text_encoders") and "lora_B" in n)
    batch = Target.resolve(_with(LUMINA, "trained"), Plan(), 1, "cpu", resolution=128).workload.batch(1)
    with torch.no_grad():
        states = model.encode(batch["ids"], batch["encoder_attention_mask"])
        own = model.text_encoders[0](batch["ids"][0], attention_mask=batch["encoder_attention_mask"],
                                     output_hidden_states=True)
    assert tuple(states.shape) == (1, 256, 32) and "encoder_hidden_states" not in batch
    assert torch.equal(states, own.hidden_states[-2]) and not torch.equal(states, own.last_hidden_state)
    names, _ = _trained(_with(LUMINA, "frozen"), Plan(adapter="lora:r=4,targets=all-linear"))
    assert names and not [n for n in names if n.startswith("text_encoders")]
    # (a pipeline's own config, saved in bf16: the encoder is built in the plan's dtype)
    saved = te.lumina_configs(32, 1)[0].__class__(**{**te.lumina_configs(32, 1)[0].to_dict(), "torch_dtype": "bfloat16"})
    (config,) = te.chosen((saved,), te.lumina_configs(32, 1), None)
    with torch.device("meta"):
        assert {p.dtype for p in te.LuminaWithTextEncoders(torch.nn.Linear(1, 1), [config], False).parameters()} == \
            {torch.float32}


def test_z_images_qwen3_gives_each_captions_own_penultimate_states_and_trains_never():
    """Z-Image attends to Qwen3's penultimate states, each caption cut to its own tokens of the 512 the pipeline pads
    it to (ZImagePipeline._encode_prompt); Qwen3 is never trained (ai-toolkit's Z-Image LoRA never does), and never
    adapted."""
    names, model = _trained(_with(ZIMAGE, "frozen"), Plan(adapter="lora:r=4,targets=all-linear"))
    assert names and not [n for n in names if n.startswith("text_encoders")]
    batch = Target.resolve(_with(ZIMAGE, "frozen"), Plan(), 2, "cpu", resolution=128).workload.batch(2)
    with torch.no_grad():
        states = model.encode(batch["ids"], batch["mask"])
        own = model.text_encoders[0](batch["ids"][0], attention_mask=batch["mask"], output_hidden_states=True)
    assert tuple(batch["ids"][0].shape) == (2, 512) and [tuple(s.shape) for s in states] == [(40, 32)] * 2
    assert torch.equal(states[1], own.hidden_states[-2][1, :40]) and "cap_feats" not in batch
    with pytest.raises(UserError, match="dit-zimage: text_encoders=trained: memfit trains no Qwen3-4B"):
        estimate(_with(ZIMAGE, "trained"), Plan(), batch_size=1, resolution=128)
    config = te.zimage_configs(2560, None)[0]  # (Qwen3-4B, as Z-Image-Turbo's text_encoder/config.json)
    with torch.device("meta"):
        assert sum(p.numel() for p in te._encoder(config, False).parameters()) == 4_022_468_096


def test_fp8_base_weights_store_fluxs_text_encoders_in_fp8_too():
    """kohya's fp8_base casts the text encoders' linear weights to fp8 as the DiT's (its fp8_base_unet does not:
    the mapping says so)."""
    step = build_step(Target.resolve(_with(FLUX, "frozen"), Plan(adapter="lora:r=4", base_weights="fp8",
                                                                 precision="bf16-base"), 1, "cpu", resolution=128))
    linear = [m.weight.dtype for m in step.model.text_encoders.modules() if isinstance(m, torch.nn.Linear)]
    assert linear == [torch.float8_e4m3fn] * (6 * 2 + 7 * 2)  # (CLIP: 6 a layer; T5: q k v o wi_0 wi_1 wo; 2 layers)
    fp16 = build_step(Target.resolve(_with(FLUX, "frozen"), Plan(adapter="lora:r=4", precision="fp16-base"), 1, "cpu",
                                     resolution=128))  # (cast whole, as kohya's .to(dtype): T5's wo is not kept fp32)
    assert {p.dtype for p in fp16.model.text_encoders.parameters()} == {torch.float16}
