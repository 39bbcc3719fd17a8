"""The diffusers image workloads (memfit.workloads.diffusion): predicted peak vs the profiler's.

Tiny configs of the released architectures (every code path, a fraction of the size): the
prediction on fake tensors is compared with the peak the profiler's allocator events measure on
the same step (``profile``), in fp32 and bf16, with and without ``checkpointing: blocks``.
Lumina2 reads its caption lengths from the attention mask (``mask.sum().tolist()``): on fake
tensors the tracker assumes the mask full (NOTE [ Assumed scalars ]), as the synthetic batch is.
"""

import pytest
import torch

from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.planner.stacks import stacks_of
from memfit.plans import Plan
from memfit.step import build_step
from memfit.techniques.checkpointing import find_blocks
from memfit.workload import split_batch
from memfit.workloads import load_workload
from tests.helpers import assert_same_training, run_steps

pytest.importorskip("diffusers")

TINY = {
    "dit-lumina2": "dit-lumina2:num_layers=2,num_refiner_layers=1,hidden_size=64,num_attention_heads=4,num_kv_heads=2,"
                   "cap_feat_dim=32,axes_dim_rope=8/4/4,multiple_of=16",
    "dit-sd3": "dit-sd3:num_layers=2,num_attention_heads=2,attention_head_dim=16,joint_attention_dim=32,"
               "caption_projection_dim=32,pooled_projection_dim=16,pos_embed_max_size=16",
    "unet-sdxl": "unet-sdxl:block_out_channels=32/64/64,attention_head_dim=2,transformer_layers_per_block=1,"
                 "cross_attention_dim=32,addition_time_embed_dim=8,projection_class_embeddings_input_dim=80",
    "unet-sd15": "unet-sd15:block_out_channels=32/32/64/64,attention_head_dim=2,cross_attention_dim=32,"
                 "layers_per_block=1",
}
TINY["dit-flux"] = ("dit-flux:num_layers=2,num_single_layers=3,attention_head_dim=16,num_attention_heads=2,"
                    "joint_attention_dim=32,pooled_projection_dim=16,in_channels=16,axes_dims_rope=4/6/6")
TINY["dit-flux-kontext"] = TINY["dit-flux"] + ",control_images=1"  # (FLUX.1 Kontext: a reference image's tokens)
TINY["dit-qwenimage"] = ("dit-qwenimage:num_layers=2,attention_head_dim=16,num_attention_heads=2,joint_attention_dim=32,"
                         "axes_dims_rope=4/6/6")
TINY["dit-qwenimage-edit"] = TINY["dit-qwenimage"] + ",control_images=1,caption_tokens=40"  # (Qwen-Image-Edit)
TINY["dit-qwenimage-edit-2509"] = TINY["dit-qwenimage"] + ",control_images=2,control_px=96,caption_tokens=40"
TINY["dit-flux2"] = ("dit-flux2:num_layers=1,num_single_layers=2,attention_head_dim=16,num_attention_heads=2,"
                     "joint_attention_dim=32,in_channels=16,axes_dims_rope=4/4/4/4")
TINY["dit-wan"] = ("dit-wan:num_layers=2,attention_head_dim=16,num_attention_heads=2,ffn_dim=64,text_dim=32,"
                   "freq_dim=32,frames=5")
TINY["dit-wan-i2v"] = ("dit-wan-i2v:num_layers=2,attention_head_dim=16,num_attention_heads=2,ffn_dim=64,text_dim=32,"
                       "freq_dim=32,frames=5,image_dim=24,added_kv_proj_dim=32,width=96")  # (Wan 2.1's CLIP path too)
TINY["dit-wan-flf2v"] = TINY["dit-wan-i2v"] + ",pos_embed_seq_len=514"  # (Wan 2.1 FLF2V: two frames' image states)
TINY["dit-wan-5b"] = ("dit-wan-5b:num_layers=2,attention_head_dim=16,num_attention_heads=2,ffn_dim=64,text_dim=32,"
                      "freq_dim=32,frames=5,in_channels=8,out_channels=8,width=128")
TINY["dit-chroma"] = ("dit-chroma:num_layers=2,num_single_layers=3,attention_head_dim=16,num_attention_heads=2,"
                      "joint_attention_dim=32,in_channels=16,axes_dims_rope=4/6/6,approximator_hidden_dim=32,"
                      "approximator_num_channels=16,approximator_layers=2")
TINY["dit-zimage"] = ("dit-zimage:dim=64,n_layers=2,n_refiner_layers=1,n_heads=4,n_kv_heads=4,cap_feat_dim=32,"
                      "axes_dims=8/4/4,caption_tokens=40")
TINY["dit-hunyuan-video"] = ("dit-hunyuan-video:num_layers=1,num_single_layers=2,num_refiner_layers=1,attention_head_dim=16,"
                             "num_attention_heads=2,text_embed_dim=32,pooled_projection_dim=16,rope_axes_dim=4/6/6,"
                             "frames=5,width=64")
TINY["dit-sana"] = ("dit-sana:num_layers=2,num_attention_heads=4,attention_head_dim=16,num_cross_attention_heads=2,"
                    "cross_attention_head_dim=32,cross_attention_dim=64,caption_channels=32,in_channels=8,out_channels=8")
TINY["dit-pixart-sigma"] = ("dit-pixart-sigma:num_layers=2,num_attention_heads=2,attention_head_dim=16,cross_attention_dim=32,"
                            "caption_channels=32,norm_num_groups=2")
TINY["dit-auraflow"] = ("dit-auraflow:num_mmdit_layers=1,num_single_dit_layers=2,num_attention_heads=2,attention_head_dim=16,"
                        "joint_attention_dim=32,caption_projection_dim=32")
TINY["dit-cogvideox"] = ("dit-cogvideox:num_layers=2,num_attention_heads=2,attention_head_dim=16,text_embed_dim=32,"
                         "time_embed_dim=16,frames=5,width=64")
TINY["dit-cogvideox-2b"] = TINY["dit-cogvideox"].replace("dit-cogvideox", "dit-cogvideox-2b")
TINY["dit-ltx-video"] = ("dit-ltx-video:num_layers=2,num_attention_heads=2,attention_head_dim=16,cross_attention_dim=32,"
                         "caption_channels=32,in_channels=16,out_channels=16,frames=9,width=128")
RESOLUTION = {"dit-ltx-video": 64, "dit-cogvideox": 64, "dit-cogvideox-2b": 64, "dit-sana": 256, "dit-pixart-sigma": 128, "dit-auraflow": 128, "dit-flux-kontext": 128, "dit-qwenimage-edit": 128, "dit-qwenimage-edit-2509": 64, "dit-hunyuan-video": 64, "dit-chroma": 128, "dit-zimage": 128, "dit-wan-i2v": 64, "dit-wan-flf2v": 64, "dit-wan-5b": 64, "dit-wan": 64, "dit-flux2": 128, "dit-lumina2": 128, "dit-sd3": 128, "unet-sdxl": 128, "unet-sd15": 64, "dit-flux": 128, "dit-qwenimage": 128}

# unet-sdxl in fp32 is profiled by test_block_checkpointing_keeps_fewer_activations (same bound; slow tier)
CASES = [(arch, precision, ckpt) for arch in ("dit-lumina2", "unet-sdxl") for precision in ("fp32", "bf16")
         for ckpt in ("none", "blocks") if (arch, precision) != ("unet-sdxl", "fp32")] + [
    ("dit-sd3", "fp32", "none"), ("dit-sd3", "bf16", "blocks"), ("unet-sd15", "fp32", "none"),
    ("dit-flux", "fp32", "none"), ("dit-flux", "bf16", "blocks"), ("dit-flux-kontext", "bf16", "blocks"),
    ("dit-qwenimage-edit", "bf16", "blocks"), ("dit-qwenimage-edit-2509", "bf16", "blocks"),
    ("dit-qwenimage", "fp32", "none"),
    ("dit-qwenimage", "bf16", "blocks"), ("dit-flux2", "fp32", "none"), ("dit-flux2", "bf16", "blocks"),
    ("dit-wan", "fp32", "none"), ("dit-wan", "bf16", "blocks"), ("dit-wan-i2v", "bf16", "blocks"),
    ("dit-wan-flf2v", "bf16", "blocks"), ("dit-wan-5b", "fp32", "none"), ("dit-chroma", "fp32", "none"),
    ("dit-chroma", "bf16", "blocks"), ("dit-zimage", "fp32", "none"), ("dit-zimage", "bf16", "blocks"),
    ("dit-hunyuan-video", "fp32", "none"), ("dit-hunyuan-video", "bf16", "blocks"), ("dit-sana", "fp32", "none"),
    ("dit-sana", "bf16", "blocks"), ("dit-pixart-sigma", "fp32", "none"), ("dit-pixart-sigma", "bf16", "blocks"),
    ("dit-auraflow", "fp32", "none"), ("dit-auraflow", "bf16", "blocks"), ("dit-cogvideox", "fp32", "none"),
    ("dit-cogvideox", "bf16", "blocks"), ("dit-cogvideox-2b", "fp32", "none"), ("dit-cogvideox-2b", "bf16", "blocks"),
    ("dit-ltx-video", "fp32", "none"), ("dit-ltx-video", "bf16", "blocks")]
SLOW = {("unet-sdxl", "bf16", "none"), ("unet-sdxl", "bf16", "blocks"),  # (keeps the default suite under 10 minutes:
        ("dit-lumina2", "bf16", "none"), ("dit-lumina2", "fp32", "blocks"),  # lumina2 fp32-none stays, and its
        ("dit-lumina2", "bf16", "blocks"), ("dit-flux", "fp32", "none"),  # bf16-blocks LoRA in test_adapter; flux bf16-blocks;
        ("unet-sd15", "fp32", "none"), ("dit-qwenimage", "fp32", "none"),
        ("dit-flux2", "fp32", "none"), ("dit-wan", "fp32", "none"),  # diffusers' UNet2DConditionModel stays in test_adapter's unet-sdxl LoRA)
        ("dit-sd3", "fp32", "none"), ("dit-chroma", "fp32", "none"), ("dit-zimage", "fp32", "none"),  # (each model's
        ("dit-hunyuan-video", "fp32", "none"), ("dit-sana", "fp32", "none"), ("dit-pixart-sigma", "fp32", "none"),
        ("dit-auraflow", "fp32", "none"), ("dit-cogvideox-2b", "fp32", "none"), ("dit-cogvideox-2b", "bf16", "blocks"),
        ("dit-ltx-video", "fp32", "none")}  # bf16-blocks, what its LoRA users run, stays)


def _profile(arch: str, precision: str, ckpt: str):
    return profile(TINY[arch], Plan(precision=precision, checkpointing=ckpt), batch_size=2,
                   resolution=RESOLUTION[arch], repeats=0)


@pytest.mark.parametrize("arch,precision,ckpt", [pytest.param(*c, marks=pytest.mark.slow) if c in SLOW else c
                                                 for c in CASES], ids=["-".join(c) for c in CASES])
def test_prediction_within_1pct_of_the_profiler(arch, precision, ckpt):
    r = _profile(arch, precision, ckpt)
    assert r.predicted.method == "fake"  # traced, not a real-run fallback
    assert abs(r.error_percent) <= 1.0, (arch, precision, ckpt, r.predicted.peak_bytes, r.peak_bytes)


@pytest.mark.parametrize("arch", ["dit-lumina2", pytest.param("unet-sdxl", marks=pytest.mark.slow)])  # (slow: 25 s)
def test_block_checkpointing_keeps_fewer_activations(arch):
    """Blocks are found (Lumina2's transformer blocks; the UNet's resnets and attentions inside its
    down/up blocks) and checkpointing them lowers the measured activations, as predicted."""
    plain, ckpt = _profile(arch, "fp32", "none"), _profile(arch, "fp32", "blocks")
    for r in (plain, ckpt):
        assert abs(r.error_percent) <= 1.0
    assert ckpt.measured.breakdown["activations"] < 0.8 * plain.measured.breakdown["activations"]
    assert ckpt.predicted.breakdown["activations"] < 0.8 * plain.predicted.breakdown["activations"]


@pytest.mark.slow  # (48 s: the suite under 10 minutes; test_blocks_found_at_full_size keeps the rule's units in the default suite)
def test_a_unets_blocks_are_what_diffusers_own_checkpointing_checkpoints(tmp_workload_file):
    """NOTE [ A model within the model ]: with four BasicTransformerBlocks in each Transformer2DModel, memfit's
    ``checkpointing: blocks`` of a LoRA is measured as predicted (within 1%), and as much as diffusers' own
    ``enable_gradient_checkpointing`` (each BasicTransformerBlock and resnet checkpointed) is predicted to hold,
    within 1% (0.5% less: diffusers leaves its mid-block's first resnet unchecked); checkpointing each
    Transformer2DModel whole (before) held 2.4% more. The LoRA adapts the attention projections, diffusers'
    targets."""
    unet = ("unet-sdxl:block_out_channels=32/64/64,attention_head_dim=2,transformer_layers_per_block=4,"
            "cross_attention_dim=32,addition_time_embed_dim=8,projection_class_embeddings_input_dim=80")
    body = f"""
from memfit.workload import Workload
from memfit.workloads import load_workload
base = load_workload({unet!r}, resolution=64)
def model():
    m = base.model()
    m.enable_gradient_checkpointing()
    return m
wl = Workload(model=model, batch=base.batch, loss=lambda m, b: base.loss(m, b))
"""
    plan = dict(adapter="lora:r=8", precision="bf16")
    ours = profile(unet, Plan(checkpointing="blocks", **plan), batch_size=2, resolution=64, repeats=0)
    assert abs(ours.error_percent) <= 1.0, ours.error_percent
    theirs = estimate(f"{tmp_workload_file(body)}:wl", Plan(**plan), batch_size=2, device="cpu").peak_bytes
    assert abs(ours.measured.peak_bytes - theirs) <= 0.01 * theirs, (ours.measured.peak_bytes, theirs)
    trained = [n for n, p in build_step(load_workload(unet, resolution=64), Plan(**plan), 2, "cpu").model
               .named_parameters() if p.requires_grad]
    assert trained and all(any(f".{t}.lora_" in n for t in ("to_q", "to_k", "to_v", "to_out.0")) for n in trained)


def test_blocks_found_at_full_size():
    """Detection on the released sizes (built on the meta device: no memory)."""
    def blocks(spec):
        with torch.device("meta"):
            model = load_workload(spec).model()
        return {name: (len(children), type(children[0]).__name__) for name, children in find_blocks(model)}
    lumina = blocks("dit-lumina2")
    assert lumina["layers"] == (26, "Lumina2TransformerBlock")
    assert lumina["noise_refiner"] == lumina["context_refiner"] == (2, "Lumina2TransformerBlock")
    unet = blocks("unet-sdxl")  # (NOTE [ A model within the model ]: each BasicTransformerBlock, as diffusers and kohya)
    for level, n in (("down_blocks.1", 2), ("down_blocks.2", 10), ("up_blocks.0", 10), ("up_blocks.1", 2)):
        assert f"{level}.attentions" not in unet
        assert unet[f"{level}.attentions.1.transformer_blocks"] == (n, "BasicTransformerBlock")
        assert unet[f"{level}.resnets"][1] == "ResnetBlock2D"
    assert unet["mid_block.attentions.0.transformer_blocks"] == (10, "BasicTransformerBlock")
    sd15 = blocks("unet-sd15")  # (one BasicTransformerBlock in each Transformer2DModel: those are the blocks)
    assert sd15["down_blocks.0.attentions"] == (2, "Transformer2DModel")
    assert unet["mid_block.attentions.0.transformer_blocks"] == (10, "BasicTransformerBlock")
    assert blocks("dit-sana") == {"transformer_blocks": (20, "SanaTransformerBlock")}
    assert blocks("dit-pixart-sigma") == {"transformer_blocks": (28, "BasicTransformerBlock")}
    assert blocks("dit-ltx-video") == {"transformer_blocks": (28, "LTXVideoTransformerBlock")}
    assert blocks("dit-cogvideox") == {"transformer_blocks": (42, "CogVideoXBlock")}
    assert blocks("dit-auraflow") == {"joint_transformer_blocks": (4, "AuraFlowJointTransformerBlock"),
                                      "single_transformer_blocks": (32, "AuraFlowSingleTransformerBlock")}


def test_checkpointed_training_equals_plain():
    """Checkpointing the Lumina2 blocks recomputes the same ops: every parameter equal after 2 steps."""
    wl = load_workload(TINY["dit-lumina2"], resolution=64)
    plain = run_steps(wl, Plan(), steps=2, batch_size=2, seq_len=None)
    ckpt = run_steps(wl, Plan(checkpointing="blocks"), steps=2, batch_size=2, seq_len=None)
    assert_same_training(plain, ckpt)


def test_released_sizes_and_resolution_shape_the_batch():
    """Parameter counts of the released models, and the latent/caption shapes of one sample."""
    sizes = {"dit-lumina2": 2.61e9, "dit-sd3": 2.03e9, "unet-sdxl": 2.57e9, "unet-sd15": 0.86e9, "dit-flux": 11.90e9,
             "dit-qwenimage": 20.43e9, "dit-flux2": 32.22e9, "dit-wan": 14.29e9, "dit-wan-1.3b": 1.42e9, "dit-wan-i2v": 14.29e9, "dit-wan-5b": 5.00e9,
             "dit-wan-i2v:image_dim=1280,added_kv_proj_dim=5120": 16.39e9, "dit-chroma": 8.90e9, "dit-zimage": 6.15e9,
             "dit-hunyuan-video": 12.82e9, "dit-sana": 1.60e9, "dit-pixart-sigma": 0.61e9, "dit-auraflow": 6.86e9,
             "dit-cogvideox": 5.57e9, "dit-cogvideox-2b": 1.69e9, "dit-ltx-video": 1.92e9}
    for spec, want in sizes.items():
        with torch.device("meta"):
            n = sum(p.numel() for p in load_workload(spec).model().parameters())
        assert abs(n - want) / want < 0.01, (spec, n)
    wl = load_workload("dit-lumina2", resolution=512)
    batch = wl.batch(3)
    assert batch["hidden_states"].shape == (3, 16, 64, 64) and batch["target"].shape == (3, 16, 64, 64)
    assert batch["encoder_hidden_states"].shape == (3, 256, 2304) and batch["timestep"].shape == (3,)
    assert wl.info.resolution == 512 and wl.name == "dit-lumina2 512px"
    assert load_workload("unet-sd15").info.resolution == 512
    sdxl = load_workload("unet-sdxl").batch(1)
    assert sdxl["sample"].shape == (1, 4, 128, 128) and sdxl["text_embeds"].shape == (1, 1280)


def test_flux_is_flux1_dev_trained_on_cached_latents_and_text():
    """FLUX.1-dev's shapes: 19 double- and 38 single-stream blocks of 3072 (24 heads x 128), the
    guidance embedding; one sample at 1024 px is 64 x 64 tokens of 2x2-packed 16-channel latents
    (128 x 128 latents), 512 T5 tokens of 4096 and a pooled CLIP vector of 768; the model loads as a
    checkpoint (each weight made in its final form)."""
    wl = load_workload("dit-flux")
    with torch.device("meta"):
        model = wl.model()
    blocks = {name: (len(children), type(children[0]).__name__) for name, children in find_blocks(model)}
    assert blocks == {"transformer_blocks": (19, "FluxTransformerBlock"),
                      "single_transformer_blocks": (38, "FluxSingleTransformerBlock")}
    assert model.config.guidance_embeds and model.inner_dim == 3072 and wl.from_checkpoint
    batch = wl.batch(2)
    assert batch["hidden_states"].shape == batch["target"].shape == (2, 64 * 64, 64)
    assert batch["encoder_hidden_states"].shape == (2, 512, 4096) and batch["pooled_projections"].shape == (2, 768)
    assert batch["img_ids"].shape == (64 * 64, 3) and batch["txt_ids"].shape == (512, 3)
    assert batch["guidance"].shape == batch["timestep"].shape == (2,) and wl.info.resolution == 1024
    assert batch["img_ids"][65].tolist() == [0, 1, 1]  # (row, column) of the token
    assert load_workload("dit-flux", resolution=512).batch(1)["hidden_states"].shape == (1, 32 * 32, 64)


def test_flux_target_is_the_velocity_of_the_packed_latents():
    """Rectified flow (t = 1 is noise): the noisy input is (1 - t) x0 + t noise and the target
    noise - x0, both packed 2x2 into tokens; checked by unpacking with the pipeline's inverse."""
    wl = load_workload(TINY["dit-flux"], resolution=64)
    torch.manual_seed(0)
    b = wl.batch(2)
    torch.manual_seed(0)
    x0, noise, t = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8), torch.rand(2)

    def unpack(tokens):  # diffusers' FluxPipeline._unpack_latents
        return tokens.view(2, 4, 4, 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(2, 4, 8, 8)
    s = t.view(-1, 1, 1, 1)
    torch.testing.assert_close(unpack(b["hidden_states"]), (1 - s) * x0 + s * noise)
    torch.testing.assert_close(unpack(b["target"]), noise - x0)


def test_kontexts_reference_image_joins_the_noisy_tokens_and_the_loss_takes_the_noisy_ones():
    """NOTE [ Kontext's reference image ]: the noisy tokens, then as many reference tokens; their position ids the
    noisy ones' with the first axis 1; the target and the loss on the first half of the output."""
    plain, kontext = (load_workload(TINY[k], resolution=64) for k in ("dit-flux", "dit-flux-kontext"))
    torch.manual_seed(0)
    a = plain.batch(2)
    torch.manual_seed(0)
    b = kontext.batch(2)
    n = a["hidden_states"].shape[1]
    torch.testing.assert_close(b["hidden_states"][:, :n], a["hidden_states"])
    assert b["hidden_states"].shape[1] == 2 * n and b["target"].shape == a["target"].shape
    torch.testing.assert_close(b["img_ids"][n:, 1:], a["img_ids"][:, 1:])
    assert (b["img_ids"][:n, 0] == 0).all() and (b["img_ids"][n:, 0] == 1).all()
    from memfit.step import build_step
    step = build_step(kontext, Plan(), 2, "cpu")
    inputs = {k: v for k, v in b.items() if k != "target"}
    with torch.no_grad():
        out = step.model(**inputs, return_dict=False)[0]
        expected = torch.nn.functional.mse_loss(out[:, :n].float(), b["target"].float())
        torch.testing.assert_close(kontext.loss(step.model, b), expected)


def test_qwen_image_edits_reference_image_is_a_second_grid_of_tokens_and_its_states_as_long_as_given():
    plain, edit = (load_workload(TINY[k], resolution=64) for k in ("dit-qwenimage", "dit-qwenimage-edit"))
    a, b = plain.batch(2), edit.batch(2)
    n = a["hidden_states"].shape[1]
    assert b["hidden_states"].shape[1] == 2 * n and b["target"].shape == a["target"].shape
    assert b["img_shapes"] == [[a["img_shapes"][0][0]] * 2] * 2
    assert b["encoder_hidden_states"].shape[1] == b["encoder_hidden_states_mask"].shape[1] == 40
    two = load_workload(TINY["dit-qwenimage-edit-2509"], resolution=64).batch(2)  # (two references of 96 px, the target 64)
    assert two["img_shapes"] == [[a["img_shapes"][0][0], (1, 6, 6), (1, 6, 6)]] * 2
    assert two["hidden_states"].shape[1] == n + 2 * 36 and two["target"].shape == a["target"].shape


def test_fluxs_captions_are_512_t5_tokens_schnells_256_or_as_given():
    """T5 tokens a caption: FLUX.1-dev's 512, schnell's 256 (its pipeline's and kohya's limit), or
    ``t5_tokens=N`` (kohya's t5xxl_max_token_length); the text positions follow."""
    from memfit.errors import UserError
    for spec, tokens in ((TINY["dit-flux"], 512), (f"{TINY['dit-flux']},guidance_embeds=false", 256),
                         (f"{TINY['dit-flux']},t5_tokens=77", 77)):
        batch = load_workload(spec, resolution=64).batch(1)
        assert batch["encoder_hidden_states"].shape[1] == batch["txt_ids"].shape[0] == tokens, spec
    with pytest.raises(UserError, match="t5_tokens=0 must be a whole number of T5 tokens a caption >= 1"):
        load_workload("dit-flux:t5_tokens=0")


def test_kohyas_t5_attention_mask_is_predicted_within_1pct_and_costs_what_its_expanded_masks_take():
    """NOTE [ kohya's T5 attention mask ]: ``t5_mask=true`` gives FLUX's attention sd-scripts' [B, heads, L, L] mask;
    a full mask trains as no mask (the same outputs); on this CPU within 1% of the profiler; on the RTX 4090 preset
    it adds at least the bf16 mask SDPA makes of it (memfit.memory.cuda.sdpa)."""
    from memfit.errors import UserError
    from memfit.memory.estimate import estimate
    spec, masked = TINY["dit-flux"], TINY["dit-flux"] + ",t5_mask=true"
    plan = Plan(adapter="lora:r=4,targets=all-linear", precision="bf16-base", checkpointing="blocks")
    r = profile(masked, plan, batch_size=2, resolution=128, repeats=0)
    assert abs(r.error_percent) <= 1.0, r.error_percent
    torch.manual_seed(0)
    plain, with_mask = load_workload(spec, resolution=64), load_workload(masked, resolution=64)
    batch = with_mask.batch(2)
    assert batch["t5_attention_mask"].shape == (2, 512) and batch["t5_attention_mask"].all()
    torch.manual_seed(1)
    model = plain.model().eval()
    torch.manual_seed(1)
    same = with_mask.model().eval()
    inputs = {k: v for k, v in batch.items() if k != "target"}
    out = same(**inputs, return_dict=False)[0]
    torch.testing.assert_close(out, model(**{k: v for k, v in inputs.items() if k != "t5_attention_mask"},
                                          return_dict=False)[0], rtol=1e-4, atol=1e-5)
    inputs["t5_attention_mask"] = inputs["t5_attention_mask"].clone()
    inputs["t5_attention_mask"][:, 77:] = False  # (a 77-token caption: the mask is real)
    assert not torch.allclose(same(**inputs, return_dict=False)[0], out)
    card = [estimate(s, plan, batch_size=2, device="rtx4090", resolution=512).peak_bytes for s in (spec, masked)]
    tokens = 512 + (512 // 16) ** 2  # (T5's and the image's: 32 x 32 packed latents)
    assert card[1] - card[0] >= 2 * 2 * tokens ** 2 * 2  # (batch 2 x 2 heads x L x L, bf16)
    with pytest.raises(UserError, match="t5_mask=3 must be true or false"):
        load_workload(f"{spec},t5_mask=3")


def test_flux_resolution_must_divide_into_packed_latents():
    from memfit.errors import UserError
    with pytest.raises(UserError, match=r"--resolution 1000 is not a multiple of 16 .* use --resolution 992 or 1008"):
        load_workload("dit-flux", resolution=1000)


def test_qwen_image_is_trained_on_packed_latents_and_masked_captions():
    """Qwen-Image's batch as diffusers' LoRA script feeds it: FLUX's 2x2 packing of 16 latent channels, 512
    caption states 3584 wide (Qwen2.5-VL-7B's) with their mask, each sample's latent grid, the timestep a
    fraction; the target the velocity of the packed latents."""
    wl = load_workload("dit-qwenimage", resolution=512)
    batch = wl.batch(2)
    assert batch["hidden_states"].shape == batch["target"].shape == (2, 32 * 32, 64)
    assert batch["encoder_hidden_states"].shape == (2, 512, 3584) and batch["encoder_hidden_states_mask"].all()
    assert batch["img_shapes"] == [[(1, 32, 32)]] * 2 and float(batch["timestep"].max()) <= 1.0
    assert wl.from_checkpoint and wl.info.resolution == 512 and wl.name == "dit-qwenimage 512px"


def test_qwen_image_rotary_table_is_made_on_the_host_as_diffusers_makes_it():
    """The rotary table is a plain attribute (no parameter, no buffer): loaded as a checkpoint is, it is made
    again on the host with the values diffusers' own build gives it (NOTE [ Plain tensors of a meta build ]);
    on the meta device alone the first forward failed ("Cannot copy out of meta tensor")."""
    from memfit.step import build_step
    wl = load_workload(TINY["dit-qwenimage"], resolution=64)
    loaded = build_step(wl, Plan(), 1, "cpu").model.pos_embed
    with torch.device("cpu"):
        built = wl.model().pos_embed
    for name in ("pos_freqs", "neg_freqs"):
        ours, theirs = getattr(loaded, name), getattr(built, name)
        assert ours.device.type == "cpu" and ours.dtype == torch.complex64 and torch.equal(ours, theirs), name


def test_flux2_is_fed_its_pipelines_patchified_tokens_and_4_axis_positions():
    """FLUX.2-dev's batch: 32 latent channels patchified 2x2 into 128 and flattened to tokens exactly as
    ``Flux2Pipeline`` does it, 512 caption states 15360 wide, the guidance value, and (time, row, column,
    layer) ids for image and caption tokens; the target is the velocity in the same layout."""
    from diffusers import Flux2Pipeline

    from memfit.workloads.packed_dits import _patchify
    latents = torch.randn(2, 32, 8, 8)
    want = Flux2Pipeline._pack_latents(Flux2Pipeline._patchify_latents(latents))
    assert torch.equal(_patchify(latents), want)
    batch = load_workload("dit-flux2", resolution=512).batch(2)
    assert batch["hidden_states"].shape == batch["target"].shape == (2, 32 * 32, 128)
    assert batch["encoder_hidden_states"].shape == (2, 512, 15360) and batch["guidance"].shape == (2,)
    assert batch["img_ids"].shape == (2, 1024, 4) and batch["img_ids"][0, 33].tolist() == [0, 1, 1, 0]
    assert batch["txt_ids"].shape == (2, 512, 4) and batch["txt_ids"][0, 7].tolist() == [0, 0, 0, 7]


def test_wan_is_trained_on_cached_video_latents_frames_in_steps_of_four():
    """Wan 2.1 T2V: latents [B, 16, (frames - 1) / 4 + 1, R / 8, R / 8], UMT5 captions padded to 512, the
    timestep on the 0-1000 scale, and per sample the rectified-flow mix and its velocity; its 40 blocks are
    found; frames not 4k + 1 are refused in one line naming the two nearest."""
    from memfit.errors import UserError
    wl = load_workload("dit-wan:frames=33", resolution=832)
    assert wl.from_checkpoint and wl.name == "dit-wan 832px 33 frames"
    assert wl.info.config["latent_frames"] == 9
    torch.manual_seed(0)
    batch = wl.batch(2)
    assert batch["hidden_states"].shape == batch["target"].shape == (2, 16, 9, 104, 104)
    assert batch["encoder_hidden_states"].shape == (2, 512, 4096) and batch["timestep"].shape == (2,)
    assert 0 <= batch["timestep"].min() and batch["timestep"].max() <= 1000
    # noisy = (1 - t) x + t n and target = n - x, so noisy + (1 - t) target = n for each sample's own t
    t = (batch["timestep"] / 1000).view(-1, 1, 1, 1, 1)
    noise = batch["hidden_states"] + (1 - t) * batch["target"]
    latents = noise - batch["target"]
    assert torch.allclose((1 - t) * latents + t * noise, batch["hidden_states"], atol=1e-5)
    with torch.device("meta"):
        model = load_workload("dit-wan").model()
    assert {n: len(c) for n, c in find_blocks(model)} == {"blocks": 40}
    with pytest.raises(UserError, match="frames=32 is not 4k [+] 1.*use frames=29 or frames=33"):
        load_workload("dit-wan:frames=32")


def test_wan_flf2v_micro_batches_keep_each_samples_pair_of_image_states():
    """FLF2V's image states hold two rows a sample (first and last frame): a micro-batch takes its samples'
    pairs (a review found every micro-batch given all of them, and the step failing), predicted within 1%."""
    wl = load_workload(TINY["dit-wan-flf2v"], resolution=RESOLUTION["dit-wan-flf2v"])
    batch = wl.batch(2)
    parts = (wl.split or split_batch)(batch, 2, 2)
    assert [p["encoder_hidden_states_image"].shape[0] for p in parts] == [2, 2]
    assert torch.equal(torch.cat([p["encoder_hidden_states_image"] for p in parts]), batch["encoder_hidden_states_image"])
    r = profile(TINY["dit-wan-flf2v"], Plan(precision="bf16", micro_batch_size=1), batch_size=2,
                resolution=RESOLUTION["dit-wan-flf2v"], repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) <= 1.0, r.error_percent


def test_wan_clips_wider_than_high_image_to_video_and_the_5b_with_a_timestep_per_token():
    """Wan's 480p is 832 x 480 (32,760 tokens at 81 frames, Wan's own seq_len); Wan 2.2 I2V takes the first
    frame's mask and latents as 20 more channels (and Wan 2.1's CLIP image states, 257 tokens, where the config
    has image_dim); Wan 2.2 TI2V 5B's 16x VAE makes 48-channel latents of 1280 x 704 x 121 frames into 27,280
    tokens (Wan 2.2's seq_len), each with its own timestep; sizes that do not divide are refused in one line."""
    from memfit.errors import UserError
    wide = load_workload("dit-wan:width=832", resolution=480)
    assert wide.name == "dit-wan 832x480px" and wide.info.config["tokens"] == 32760
    assert wide.batch(1)["hidden_states"].shape == (1, 16, 21, 60, 104)
    i2v = load_workload("dit-wan-i2v:image_dim=1280,added_kv_proj_dim=5120").batch(2)
    assert i2v["hidden_states"].shape == (2, 36, 21, 60, 60) and i2v["target"].shape == (2, 16, 21, 60, 60)
    assert i2v["encoder_hidden_states_image"].shape == (2, 257, 1280)
    assert "encoder_hidden_states_image" not in load_workload("dit-wan-i2v").batch(1)
    # Wan 2.1 FLF2V: the first and the last frame's states in pairs, as its pipeline hands them ([2B, 257, 1280])
    flf2v = load_workload("dit-wan-i2v:image_dim=1280,added_kv_proj_dim=5120,pos_embed_seq_len=514").batch(2)
    assert flf2v["encoder_hidden_states_image"].shape == (4, 257, 1280)
    five = load_workload("dit-wan-5b")
    assert five.name == "dit-wan-5b" and five.info.config["tokens"] == 27280 and five.info.resolution_step == 32
    batch = five.batch(2)
    assert batch["hidden_states"].shape == batch["target"].shape == (2, 48, 31, 44, 80)
    assert batch["timestep"].shape == (2, 27280) and (batch["timestep"] == batch["timestep"][:, :1]).all()
    assert load_workload("dit-wan-5b:width=704").name == "dit-wan-5b 704x704px"
    with pytest.raises(UserError, match=r"--resolution 700 is not a multiple of 32 \(the VAE's factor 16 x patch size 2\); "
                                        r"use --resolution 672 or 704"):
        load_workload("dit-wan-5b", resolution=700)
    with pytest.raises(UserError, match=r"width=1000 is not a multiple of 32 .*use width=992 or 1024"):
        load_workload("dit-wan-5b:width=1000")


WIDE = {"dit-lumina2": (192, 128), "dit-sd3": (192, 128), "unet-sdxl": (192, 128), "unet-sd15": (192, 64),
        "dit-flux": (192, 128), "dit-qwenimage": (192, 128), "dit-flux2": (192, 128)}
"""(width, height) of an image wider than high, for each image model (NOTE [ A resolution's width ])."""
WIDE_SLOW = {"unet-sdxl", "unet-sd15"}  # (keeps the default suite under 10 minutes)


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a in WIDE_SLOW else a for a in WIDE])
def test_an_image_wider_than_high_is_its_models_input_and_predicted_within_1pct(arch):
    """``--resolution WIDTHxHEIGHT`` (kohya's buckets: 1216x832): latents H/8 x W/8 (packed models: their
    tokens row by row, with their positions), the same workload as a ``width=`` override; the real step takes
    it (a model whose positions assumed a square would fail or mismatch) and is predicted within 1%."""
    width, height = WIDE[arch]
    wl = load_workload(TINY[arch], resolution=(width, height))
    assert wl.info.resolution == height and wl.info.config["width"] == width and wl.info.config["fixed_width"]
    assert wl.name == f"{arch} {width}x{height}px"
    assert load_workload(f"{TINY[arch]},width={width}", resolution=height).name == wl.name
    batch = wl.batch(2)
    latents = batch["sample"] if "sample" in batch else batch["hidden_states"]
    if latents.dim() == 4:  # (B, C, H/8, W/8)
        assert latents.shape[2:] == (height // 8, width // 8)
    else:  # (B, tokens, C): 2x2 latent pixels a token
        assert latents.shape[1] == (height // 16) * (width // 16)
    if arch == "dit-flux":
        assert batch["img_ids"][width // 16].tolist() == [0, 1, 0]  # (the second row's first token)
    if arch == "dit-qwenimage":
        assert batch["img_shapes"] == [[(1, height // 16, width // 16)]] * 2
    r = profile(TINY[arch], Plan(), batch_size=2, resolution=(width, height), repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) <= 1.0, (arch, r.error_percent)


def test_a_resolutions_width_is_given_once_and_within_the_models_sizes():
    from memfit.errors import UserError
    with pytest.raises(UserError, match=r"dit-flux: width=1024 and --resolution 1216x832 give two widths; give one"):
        load_workload("dit-flux:width=1024", resolution=(1216, 832))
    with pytest.raises(UserError, match=r"dit-flux: --resolution 1000x832's width 1000 is not a multiple of 16 .*use --resolution "
                                        r"992x832 or 1008x832$"):  # (the width as the user gave it)
        load_workload("dit-flux", resolution=(1000, 832))
    with pytest.raises(UserError, match=r"dit-flux: width=1000 is not a multiple of 16 .*use width=992 or 1008"):
        load_workload("dit-flux:width=1000", resolution=832)
    with pytest.raises(UserError, match=r"dit-sd3: --resolution 4096x1024's width 4096 exceeds the position table .*use "
                                        r"--resolution <= 3072x1024"):
        load_workload("dit-sd3", resolution=(4096, 1024))
    with pytest.raises(UserError, match=r"gpt2: --resolution applies to the image- and video-generation built-ins"):
        load_workload("gpt2", resolution=(512, 512))
    assert load_workload("dit-flux", resolution=(1024, 1024)).name == "dit-flux"
    assert load_workload("dit-flux", resolution=(512, 512)).name == "dit-flux 512px"


def test_chroma_is_flux_schnell_fed_t5_alone_with_its_mask():
    """Chroma1-HD: FLUX.1-schnell's 19 + 38 blocks, no guidance and no pooled CLIP vector; the caption's T5 mask
    extended over the image tokens, as ``ChromaPipeline._prepare_attention_mask`` extends it."""
    wl = load_workload("dit-chroma")
    model, blocks = _full_size_blocks(wl)
    assert blocks["transformer_blocks"] == (19, "ChromaTransformerBlock")
    assert blocks["single_transformer_blocks"] == (38, "ChromaSingleTransformerBlock")
    # (the approximator's five layers and norms repeat too: shallow traces keep them whole, and a swapped share is
    # of the 57 blocks behind them: NOTE [ Stacks of unrelated depths ])
    assert blocks["distilled_guidance_layer.layers"] == (5, "PixArtAlphaTextProjection")
    assert stacks_of(model).tail == (19, 38)
    batch = wl.batch(2)
    assert batch["hidden_states"].shape == batch["target"].shape == (2, 64 * 64, 64)
    assert batch["encoder_hidden_states"].shape == (2, 512, 4096) and batch["txt_ids"].shape == (512, 3)
    assert batch["attention_mask"].shape == (2, 512 + 64 * 64) and batch["attention_mask"].dtype == torch.bool
    assert "guidance" not in batch and "pooled_projections" not in batch and wl.from_checkpoint


def test_zimage_is_called_with_lists_as_its_pipeline_calls_it():
    """Z-Image: 30 layers and 2 + 2 refiner layers found as blocks; each sample's latents [C, 1, H, W] and caption
    states [L, 2560] reach the model as lists (``unbind``), its list of outputs stacked against the target
    ``latents - noise`` with t = 1 the image; ``caption_tokens=`` sizes the caption."""
    wl = load_workload("dit-zimage")
    model, blocks = _full_size_blocks(wl)
    assert blocks["layers"] == (30, "ZImageTransformerBlock")
    assert blocks["noise_refiner"] == blocks["context_refiner"] == (2, "ZImageTransformerBlock")
    batch = wl.batch(2)
    assert batch["x"].shape == (2, 16, 1, 128, 128) and batch["target"].shape == (2, 16, 128, 128)
    assert batch["cap_feats"].shape == (2, 512, 2560) and wl.info.resolution == 1024
    assert load_workload("dit-zimage:caption_tokens=77").batch(1)["cap_feats"].shape == (1, 77, 2560)
    tiny = load_workload(TINY["dit-zimage"], resolution=64)
    torch.manual_seed(0)
    b = tiny.batch(2)
    torch.manual_seed(0)
    x0, noise, t = torch.randn(2, 16, 8, 8), torch.randn(2, 16, 8, 8), torch.rand(2)
    s = t.view(-1, 1, 1, 1)
    torch.testing.assert_close(b["x"].squeeze(2), s * x0 + (1 - s) * noise)
    torch.testing.assert_close(b["target"], x0 - noise)
    torch.manual_seed(1)
    m = tiny.model()
    out = m([x for x in b["x"]], b["t"], [c for c in b["cap_feats"]], return_dict=False)[0]
    want = torch.nn.functional.mse_loss(torch.stack([o.float() for o in out]).squeeze(2), b["target"])
    torch.testing.assert_close(tiny.loss(m, b), want)


def test_hunyuan_video_is_musubi_tuners_clip_with_its_caption_mask_and_guidance():
    """HunyuanVideo T2V: 20 double- and 40 single-stream blocks; 33 frames at 960 x 544 are 9 latent frames of
    68 x 120 latents (1x2x2 patches: 18,360 tokens), 256 caption tokens of 4096 with their mask, CLIP-L's pooled
    768, the guidance times 1000; ``frames=`` and ``width=`` size the clip as ``dit-wan``'s."""
    wl = load_workload("dit-hunyuan-video")
    model, blocks = _full_size_blocks(wl)
    assert blocks["transformer_blocks"] == (20, "HunyuanVideoTransformerBlock")
    assert blocks["single_transformer_blocks"] == (40, "HunyuanVideoSingleTransformerBlock")
    batch = wl.batch(1)
    assert batch["hidden_states"].shape == batch["target"].shape == (1, 16, 9, 68, 120)
    assert batch["encoder_hidden_states"].shape == (1, 256, 4096) and batch["encoder_attention_mask"].shape == (1, 256)
    assert batch["pooled_projections"].shape == (1, 768) and batch["guidance"].tolist() == [1000.0]
    assert wl.info.config["tokens"] == 18360 and wl.name == "dit-hunyuan-video"
    small = load_workload("dit-hunyuan-video:frames=17,width=512", resolution=512)
    assert small.batch(1)["hidden_states"].shape == (1, 16, 5, 64, 64) and small.name == "dit-hunyuan-video 512x512px 17 frames"


def _full_size_blocks(wl):
    """The workload's model built on the meta device, and its repeated blocks: {name: (count, class name)}."""
    with torch.device("meta"):
        model = wl.model()
    return model, {name: (len(children), type(children[0]).__name__) for name, children in find_blocks(model)}


def test_sana_pixart_and_auraflow_are_fed_as_their_lora_scripts_feed_them():
    """SANA: DC-AE's 32x latents of 32 channels in 1x1 patches (1,024 tokens at 1024 px) and 300 Gemma-2 states
    with their mask; PixArt-Sigma: 4-channel latents, 300 T5 states with their mask, epsilon prediction whose
    loss leaves the learned variance (the output's second half of channels) out; AuraFlow: 256 Pile-T5 states,
    a fractional timestep, and no side past its position table."""
    sana = load_workload("dit-sana").batch(2)
    assert sana["hidden_states"].shape == (2, 32, 32, 32) and sana["encoder_hidden_states"].shape == (2, 300, 2304)
    assert sana["encoder_attention_mask"].shape == (2, 300) and float(sana["timestep"].max()) > 1
    with pytest.raises(UserError, match="not a multiple of 32"):
        load_workload("dit-sana", resolution=1000)
    pixart = load_workload("dit-pixart-sigma", resolution=512).batch(2)
    assert pixart["hidden_states"].shape == (2, 4, 64, 64) and pixart["encoder_hidden_states"].shape == (2, 300, 4096)
    assert pixart["timestep"].dtype == torch.int64 and "resolution" not in pixart

    class Halves(torch.nn.Module):  # (a denoiser whose first half of channels is the noise, the second anything)
        def forward(self, hidden_states, **_):
            return (torch.cat([hidden_states * 0 + self.noise, hidden_states * 7], dim=1),)

    wl = load_workload(TINY["dit-pixart-sigma"], resolution=128)
    batch, model = wl.batch(2), Halves()
    model.noise = batch["target"]
    assert float(wl.loss(model, batch)) == 0.0
    aura = load_workload("dit-auraflow").batch(1)
    assert aura["encoder_hidden_states"].shape == (1, 256, 2048) and float(aura["timestep"].max()) <= 1
    assert load_workload("dit-auraflow", resolution=1536).info.resolution == 1536
    with pytest.raises(UserError, match=r"exceeds the position table \(pos_embed_max_size=9216: 96 x 96 patches, 1536px\)"):
        load_workload("dit-auraflow", resolution=1600)


def test_cogvideox_is_fed_frames_before_channels_and_the_5bs_rotary_table_made_each_step():
    """49 frames at 720 x 480: 13 latent frames laid out [B, F', C, H', W'] as the pipeline permutes them (17,550
    tokens), 226 T5 states; the 5B's rotary table is made in the loss (it is no sample's, so no micro-batch splits
    it) and the 2B has none; CogVideoX 1.5's frame patches are refused in one line."""
    wl = load_workload("dit-cogvideox")
    batch = wl.batch(2)
    assert batch["hidden_states"].shape == (2, 13, 16, 60, 90) and batch["encoder_hidden_states"].shape == (2, 226, 4096)
    assert wl.info.config["tokens"] == 17550 and wl.name == "dit-cogvideox"
    assert load_workload("dit-cogvideox:frames=17,width=480", resolution=320).name == "dit-cogvideox 480x320px 17 frames"
    seen = {}

    class Spy(torch.nn.Module):
        def forward(self, hidden_states, image_rotary_emb=None, **_):
            seen["rotary"] = image_rotary_emb
            return (hidden_states * 0,)

    small = load_workload(TINY["dit-cogvideox"], resolution=64)
    small.loss(Spy(), small.batch(2))
    cos, sin = seen["rotary"]
    assert cos.shape == sin.shape == (2 * 4 * 4, 16)  # (2 latent frames of 4 x 4 patches, one row a token)
    two = load_workload(TINY["dit-cogvideox-2b"], resolution=64)
    two.loss(Spy(), two.batch(2))
    assert seen["rotary"] is None
    with pytest.raises(UserError, match="patch_size_t=2 is CogVideoX 1.5's"):
        load_workload("dit-cogvideox:patch_size_t=2")


def test_ltx_video_is_fed_one_packed_token_a_latent_and_its_grid_with_the_pipelines_rotary_scale():
    """49 frames at 768 x 512: 7 latent frames of 16 x 24 (the 32x VAE, 8 frames a latent after the first), one
    token each, packed [B, 2688, 128]; 128 T5 states with their mask; the loss hands the model the grid and the
    pipeline's rotary scale (8 / 25 fps, 32, 32). Frames not 8k + 1 are one line."""
    wl = load_workload("dit-ltx-video")
    batch = wl.batch(2)
    assert batch["hidden_states"].shape == (2, 7 * 16 * 24, 128) and batch["encoder_attention_mask"].shape == (2, 128)
    seen = {}

    class Spy(torch.nn.Module):
        def forward(self, hidden_states, num_frames, height, width, rope_interpolation_scale, **_):
            seen.update(grid=(num_frames, height, width), scale=rope_interpolation_scale)
            return (hidden_states * 0,)

    small = load_workload(TINY["dit-ltx-video"], resolution=64)
    small.loss(Spy(), small.batch(1))
    assert seen == {"grid": (2, 2, 4), "scale": (8 / 25, 32, 32)}
    with pytest.raises(UserError, match="frames=50 is not 8k \\+ 1.*use frames=49 or frames=57"):
        load_workload("dit-ltx-video:frames=50")
