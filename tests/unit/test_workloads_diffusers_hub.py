"""diffusers repositories as workloads (NOTE [ diffusers repositories ]): a pipeline's hub id or folder
reads model_index.json and its denoiser's config.json, builds that denoiser with the built-in batch of
its class at the config's own resolution, and runs for real within 1% of its prediction; a class memfit
has no batch for is refused in one line."""

import json

import pytest

from memfit.cli.main import main
from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads import load_workload

UNET = {"_class_name": "UNet2DConditionModel", "_diffusers_version": "0.30.0", "sample_size": 16,
        "in_channels": 4, "out_channels": 4, "block_out_channels": [32, 64], "layers_per_block": 1,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "cross_attention_dim": 32, "attention_head_dim": 8, "norm_num_groups": 8, "upcast_attention": None}
FLUX_SCHNELL = {"_class_name": "FluxTransformer2DModel", "attention_head_dim": 16, "num_attention_heads": 2,
                "num_layers": 1, "num_single_layers": 1, "in_channels": 16, "joint_attention_dim": 32,
                "pooled_projection_dim": 16, "axes_dims_rope": [4, 6, 6], "guidance_embeds": False}
ID = "acme/toy-diffusion"


def pipeline(denoiser: str, config: dict, kind: str = "StableDiffusionPipeline") -> dict:
    return {"model_index.json": {"_class_name": kind, denoiser: ["diffusers", config["_class_name"]],
                                 "vae": ["diffusers", "AutoencoderKL"]}, f"{denoiser}/config.json": config}


def shapes(wl, n=2):
    return {k: tuple(v.shape) for k, v in wl.batch(n).items()}


def test_a_pipelines_hub_id_builds_its_denoiser_at_the_configs_resolution(hub_cache, no_network):
    hub_cache(ID, None, files=pipeline("unet", UNET))
    wl = load_workload(ID)
    assert wl.name == ID and wl.from_checkpoint and wl.info.config["model_class"] == "UNet2DConditionModel"
    assert wl.info.resolution == 128  # sample_size 16 latents x the VAE's 8
    assert shapes(wl) == {"sample": (2, 4, 16, 16), "timestep": (2,), "encoder_hidden_states": (2, 77, 32),
                          "target": (2, 4, 16, 16)}
    assert shapes(load_workload(ID, resolution=64))["sample"] == (2, 4, 8, 8)


def test_a_pipeline_folder_predicts_as_its_hub_id_and_runs_within_one_percent(hub_cache, no_network, tmp_path):
    hub_cache(ID, None, files=pipeline("unet", UNET))
    for name, data in pipeline("unet", UNET).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(data))
    hub = estimate(ID, Plan(), batch_size=2)
    assert hub.method == "fake" and estimate(str(tmp_path), Plan(), batch_size=2).peak_bytes == hub.peak_bytes
    r = profile(str(tmp_path), Plan(), batch_size=2, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_flux_schnell_gets_no_guidance_input_and_runs_within_one_percent(hub_cache, no_network):
    """FLUX.1-schnell embeds no guidance: fed one, its forward fails (dev's batch has it)."""
    hub_cache(ID, None, files=pipeline("transformer", FLUX_SCHNELL, "FluxPipeline"))
    wl = load_workload(ID, resolution=64)
    assert "guidance" not in wl.batch(1) and wl.info.resolution == 64
    r = profile(ID, Plan(), batch_size=1, resolution=64, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


QWEN_IMAGE = {"_class_name": "QwenImageTransformer2DModel", "attention_head_dim": 16, "num_attention_heads": 2,
              "num_layers": 1, "in_channels": 64, "out_channels": 16, "joint_attention_dim": 32,
              "axes_dims_rope": [4, 6, 6], "guidance_embeds": False}
WAN = {"_class_name": "WanTransformer3DModel", "attention_head_dim": 16, "num_attention_heads": 2, "num_layers": 1,
       "ffn_dim": 64, "text_dim": 32, "freq_dim": 32, "patch_size": [1, 2, 2]}


def test_a_qwen_image_pipeline_builds_dit_qwenimages_batch_and_runs_within_one_percent(hub_cache, no_network):
    hub_cache(ID, None, files=pipeline("transformer", QWEN_IMAGE, "QwenImagePipeline"))
    wl = load_workload(ID, resolution=64)
    assert wl.info.config["model_class"] == "QwenImageTransformer2DModel" and wl.from_checkpoint
    assert wl.batch(1)["encoder_hidden_states"].shape == (1, 512, 32) and wl.batch(1)["img_shapes"] == [[(1, 4, 4)]]
    r = profile(ID, Plan(), batch_size=1, resolution=64, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_a_wan_pipeline_builds_dit_wans_video_batch_and_runs_within_one_percent(hub_cache, no_network):
    hub_cache(ID, None, files=pipeline("transformer", WAN, "WanPipeline"))
    wl = load_workload(ID, resolution=64)
    assert wl.info.config["model_class"] == "WanTransformer3DModel" and wl.from_checkpoint
    assert wl.batch(1)["hidden_states"].shape == (1, 16, 21, 8, 8)  # Wan's 81 frames: 21 latent frames
    r = profile(ID, Plan(), batch_size=1, resolution=64, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


CHROMA = {"_class_name": "ChromaTransformer2DModel", "attention_head_dim": 16, "num_attention_heads": 2,
          "num_layers": 1, "num_single_layers": 2, "in_channels": 16, "joint_attention_dim": 32,
          "axes_dims_rope": [4, 6, 6], "approximator_hidden_dim": 32, "approximator_num_channels": 16,
          "approximator_layers": 2}
ZIMAGE = {"_class_name": "ZImageTransformer2DModel", "dim": 64, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 4,
          "n_kv_heads": 4, "cap_feat_dim": 32, "axes_dims": [8, 4, 4]}


HUNYUAN_VIDEO = {"_class_name": "HunyuanVideoTransformer3DModel", "num_layers": 1, "num_single_layers": 1,
                 "num_refiner_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2, "text_embed_dim": 32,
                 "pooled_projection_dim": 16, "rope_axes_dim": [4, 6, 6]}


SANA = {"_class_name": "SanaTransformer2DModel", "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16,
        "num_cross_attention_heads": 2, "cross_attention_head_dim": 16, "cross_attention_dim": 32, "caption_channels": 32,
        "in_channels": 8, "out_channels": 8, "sample_size": 4}
PIXART_ALPHA = {"_class_name": "PixArtTransformer2DModel", "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 24,
                "cross_attention_dim": 48, "caption_channels": 32, "norm_num_groups": 2, "sample_size": 128}
"""(48 wide: its micro-conditions' embeddings take a third of the width each.)"""
COGVIDEOX = {"_class_name": "CogVideoXTransformer3DModel", "num_layers": 1, "num_attention_heads": 2,
             "attention_head_dim": 16, "text_embed_dim": 32, "time_embed_dim": 16, "use_rotary_positional_embeddings": True}
LTX = {"_class_name": "LTXVideoTransformer3DModel", "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16,
       "cross_attention_dim": 32, "caption_channels": 32, "in_channels": 16, "out_channels": 16}
AURAFLOW = {"_class_name": "AuraFlowTransformer2DModel", "num_mmdit_layers": 1, "num_single_dit_layers": 1,
            "num_attention_heads": 2, "attention_head_dim": 16, "joint_attention_dim": 32, "caption_projection_dim": 32,
            "pos_embed_max_size": 9216, "sample_size": 64}


@pytest.mark.parametrize("config,kind,native,batch", [
    (SANA, "SanaPipeline", 128, {"hidden_states": (2, 8, 2, 2), "encoder_attention_mask": (2, 300)}),
    (PIXART_ALPHA, "PixArtAlphaPipeline", 1024, {"hidden_states": (2, 4, 8, 8), "resolution": (2, 2)}),
    (AURAFLOW, "AuraFlowPipeline", 1024, {"hidden_states": (2, 4, 8, 8), "encoder_hidden_states": (2, 256, 32)}),
    (COGVIDEOX, "CogVideoXPipeline", 480, {"hidden_states": (2, 13, 16, 8, 90), "encoder_hidden_states": (2, 226, 32)}),
    (LTX, "LTXPipeline", 512, {"hidden_states": (2, 7 * 2 * 24, 16), "encoder_attention_mask": (2, 128)})],
    ids=["sana", "pixart-alpha", "auraflow", "cogvideox", "ltx-video"])
def test_sana_pixart_auraflow_cogvideox_and_ltx_pipelines_build_their_built_ins_batch_and_run_within_one_percent(
        hub_cache, no_network, config, kind, native, batch):
    """Each at its native size (SANA's 4 latents of DC-AE's 32 px; AuraFlow's pipeline makes 1024 px whatever its
    config's sample_size says); PixArt-alpha's config (128 latents, micro-conditions unset) gets diffusers' rule:
    its image's size and aspect ratio in the batch."""
    hub_cache(ID, None, files=pipeline("transformer", config, kind))
    assert load_workload(ID).info.resolution == native
    wl = load_workload(ID, resolution=64)
    assert wl.info.config["model_class"] == config["_class_name"] and wl.from_checkpoint
    assert {k: tuple(wl.batch(2)[k].shape) for k in batch} == batch
    r = profile(ID, Plan(), batch_size=2, resolution=64, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


@pytest.mark.parametrize("config,kind,sizes,target", [
    (CHROMA, "ChromaPipeline", "", (2, 16, 16)),
    (ZIMAGE, "ZImagePipeline", ":caption_tokens=24", (2, 16, 8, 8)),  # (no config.json field: it sizes the batch)
    (HUNYUAN_VIDEO, "HunyuanVideoPipeline", ":frames=5,width=64", (2, 16, 2, 8, 8))], ids=["chroma", "zimage", "hunyuan"])
def test_chroma_zimage_and_hunyuan_pipelines_build_their_built_ins_batch_and_run_within_one_percent(
        hub_cache, no_network, config, kind, sizes, target):
    hub_cache(ID, None, files=pipeline("transformer", config, kind))
    wl = load_workload(ID + sizes, resolution=64)
    assert wl.info.config["model_class"] == config["_class_name"] and wl.from_checkpoint
    assert wl.batch(2)["target"].shape == target
    r = profile(ID + sizes, Plan(), batch_size=2, resolution=64, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_a_wan_hub_ids_clip_takes_frames_and_width_as_dit_wan_does_and_other_fields_stay_the_configs(hub_cache, no_network):
    """``frames=`` and ``width=`` size a Wan hub id's clip as they size ``dit-wan``'s (they are no config.json
    fields: before, they were refused as such); the config's own fields are overridden as before, and a
    model without a clip still refuses them."""
    hub_cache(ID, None, files=pipeline("transformer", WAN, "WanPipeline"))
    wl = load_workload(f"{ID}:frames=5,width=96,num_layers=2", resolution=64)
    assert wl.batch(1)["hidden_states"].shape == (1, 16, 2, 8, 12)  # (5 frames: 2 latent; 96 x 64 px: 12 x 8)
    assert wl.info.config["num_layers"] == 2 and wl.info.config["frames"] == 5
    assert wl.name == f"{ID}:num_layers=2 96x64px 5 frames"  # (the sizes said once, after the name)
    hub_cache("org/qwen-image", None, files=pipeline("transformer", QWEN_IMAGE, "QwenImagePipeline"))
    with pytest.raises(UserError, match="its config has no field 'frames'"):
        load_workload("org/qwen-image:frames=5", resolution=64)


def test_a_pipelines_hub_id_takes_a_width_as_the_built_ins_do(hub_cache, no_network):
    """``--resolution 96x64`` (width by height) or ``:width=96`` sizes a hub pipeline's image as it sizes a
    built-in's (NOTE [ A resolution's width ]): 12 x 8 latents of a UNet, 6 x 4 tokens of a FLUX, the latter
    run for real within 1%; the width is no config.json field, so it is not refused as one."""
    hub_cache(ID, None, files=pipeline("unet", UNET))
    assert shapes(load_workload(ID, resolution=(96, 64)))["sample"] == (2, 4, 8, 12)
    assert shapes(load_workload(f"{ID}:width=96", resolution=64))["sample"] == (2, 4, 8, 12)
    assert load_workload(f"{ID}:width=96", resolution=64).name == f"{ID} 96x64px"
    hub_cache("org/flux", None, files=pipeline("transformer", FLUX_SCHNELL, "FluxPipeline"))
    wl = load_workload("org/flux", resolution=(96, 64))
    assert wl.batch(1)["hidden_states"].shape == (1, 4 * 6, 16) and wl.name == "org/flux 96x64px"
    r = profile("org/flux", Plan(), batch_size=1, resolution=(96, 64), repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_a_wan_2_2_5b_pipeline_takes_its_16x_vae_and_a_timestep_per_token(hub_cache, no_network):
    hub_cache(ID, None, files=pipeline("transformer", {**WAN, "in_channels": 48, "out_channels": 48}, "WanPipeline"))
    batch = load_workload(ID, resolution=64).batch(1)  # (121 frames: 31 latent; 1280 wide: 80 latents)
    assert batch["hidden_states"].shape == (1, 48, 31, 4, 80) and batch["timestep"].shape == (1, 31 * 2 * 40)


@pytest.mark.parametrize("files,error", [
    (pipeline("transformer", {"_class_name": "MochiTransformer3DModel", "num_layers": 1}, "MochiPipeline"),
     "memfit builds the diffusers denoisers UNet2DConditionModel, FluxTransformer2DModel, SD3Transformer2DModel, "
     "Lumina2Transformer2DModel, QwenImageTransformer2DModel, Flux2Transformer2DModel, WanTransformer3DModel, "
     "ChromaTransformer2DModel, ZImageTransformer2DModel, HunyuanVideoTransformer3DModel, SanaTransformer2DModel, "
     "PixArtTransformer2DModel, AuraFlowTransformer2DModel, CogVideoXTransformer3DModel, LTXVideoTransformer3DModel, "
     "LTX2VideoTransformer3DModel, HiDreamImageTransformer2DModel, not MochiTransformer3DModel"),
    ({"model_index.json": {"_class_name": "AudioLDMPipeline", "vocoder": ["transformers", "SpeechT5HifiGan"]}},
     "AudioLDMPipeline's model_index.json names no unet or transformer"),
], ids=["unmodelled-class", "no-denoiser"])
def test_what_cannot_be_built_is_one_line(hub_cache, no_network, capsys, files, error):
    hub_cache(ID, None, files=files)
    assert main(["estimate", ID]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and error in err


def test_resolution_on_a_transformers_folder_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2}))
    with pytest.raises(UserError, match="--resolution applies to image models"):
        load_workload(str(tmp_path), resolution=256)
    with pytest.raises(UserError, match="--resolution applies to image models"):
        load_workload(str(tmp_path), resolution=(256, 128))


CLIP_TEXT = {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2, "hidden_act": "gelu",
             "vocab_size": 49408, "max_position_embeddings": 77, "projection_dim": 32}
T5_TEXT = {"architectures": ["T5EncoderModel"], "model_type": "t5", "d_model": 32, "d_kv": 16, "d_ff": 80,
           "torch_dtype": "bfloat16",
           "num_layers": 2, "num_heads": 2, "feed_forward_proj": "gated-gelu", "dropout_rate": 0.1,
           "vocab_size": 32128, "is_encoder_decoder": True}


def test_a_pipelines_own_text_encoders_are_built_from_its_configs(hub_cache, no_network):
    """With its text encoders in the step (``text_encoders=``, as for the built-ins) a pipeline builds them from
    its own text_encoder*/config.json (here an SD 2.x-like 3-layer GELU CLIP, and FLUX's CLIP-L and a T5 with
    dropout, which runs in eval mode as the frozen encoder it is), within 1% of a real step; a snapshot without
    them builds them from the denoiser's widths."""
    files = pipeline("unet", UNET)
    hub_cache(ID, None, files={**files, "text_encoder/config.json": CLIP_TEXT,
                               "model_index.json": {**files["model_index.json"],
                                                    "text_encoder": ["transformers", "CLIPTextModel"]}})
    wl = load_workload(f"{ID}:text_encoders=frozen")
    with __import__("torch").device("meta"):
        encoder = wl.model().text_encoders[0]
    assert (encoder.config.num_hidden_layers, encoder.config.hidden_act) == (3, "gelu")
    assert wl.name == f"{ID}, text encoders frozen"
    flux = pipeline("transformer", FLUX_SCHNELL, "FluxPipeline")
    hub_cache("acme/toy-flux", None, files={
        **flux, "text_encoder/config.json": {**CLIP_TEXT, "hidden_size": 16, "projection_dim": 16},
        "text_encoder_2/config.json": T5_TEXT,
        "model_index.json": {**flux["model_index.json"], "text_encoder": ["transformers", "CLIPTextModel"],
                             "text_encoder_2": ["transformers", "T5EncoderModel"]}})
    r = profile("acme/toy-flux:text_encoders=trained", Plan(adapter="lora:r=4"), batch_size=2, resolution=64,
                repeats=0)
    assert abs(r.error_percent) < 1.0, r.error_percent
    from memfit.step import build_step
    from memfit.target import Target
    step = build_step(Target.resolve("acme/toy-flux:text_encoders=trained", Plan(adapter="lora:r=4"), 1, "cpu",
                                     resolution=64))
    clip, t5 = step.model.text_encoders
    assert t5.config.num_layers == 2 and not t5.training and clip.training and step.model.denoiser.training
    with __import__("torch").device("meta"):  # (a config's dtype is not the plan's; other widths are not its)
        dtypes = {p.dtype for p in load_workload("acme/toy-flux:text_encoders=frozen").model().parameters()}
        wider = load_workload("acme/toy-flux:text_encoders=frozen,joint_attention_dim=48").model().text_encoders
    assert dtypes == {__import__("torch").float32} and wider[1].config.d_model == 48
    hub_cache("acme/bare", None, files=files)  # (no text_encoder/config.json in the snapshot)
    with __import__("torch").device("meta"):
        encoder = load_workload("acme/bare:text_encoders=frozen,text_layers=2").model().text_encoders[0]
    assert (encoder.config.num_hidden_layers, encoder.config.hidden_size) == (2, 32)
    zimage = pipeline("transformer", ZIMAGE, "ZImagePipeline")  # (Z-Image's Qwen3, from its own config: 3 layers)
    qwen3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
             "vocab_size": 1000, "tie_word_embeddings": True}
    hub_cache("acme/toy-zimage", None, files={**zimage, "text_encoder/config.json": qwen3,
                                              "model_index.json": {**zimage["model_index.json"],
                                                                   "text_encoder": ["transformers", "Qwen3Model"]}})
    with __import__("torch").device("meta"):
        encoder = load_workload("acme/toy-zimage:text_encoders=frozen").model().text_encoders[0]
    assert (type(encoder).__name__, encoder.config.num_hidden_layers, encoder.config.vocab_size) == ("Qwen3Model", 3, 1000)
    r = profile("acme/toy-zimage:text_encoders=frozen,caption_tokens=24", Plan(adapter="lora:r=4"), batch_size=2,
                resolution=64, repeats=0)  # (its token ids within its own vocabulary)
    assert abs(r.error_percent) < 1.0, r.error_percent
