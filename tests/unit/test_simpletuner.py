"""SimpleTuner configs (memfit.integrations.simpletuner): its own examples read as the runs SimpleTuner makes of
them (FLUX.1's int8-quanto LoRA under AdamWBF16, SDXL's LyCORIS LoKr in bypass mode, SD3.5's LoRA), each option
that changes memory mapped or said in one line, the config.toml and config.env forms, and what memfit does not run
refused in one line; a tiny FLUX named beside the FLUX example estimates its plan end to end."""

import copy
import json
from pathlib import Path

import pytest

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.simpletuner import is_simpletuner, map_config, read_config
from memfit.plans import Plan

DATA = Path(__file__).resolve().parents[1] / "data" / "simpletuner" / "examples"
FLUX = DATA / "flux.peft-lora" / "config.json"
CARD = get_device("rtx4090")
TINY = ("dit-flux:num_layers=1,num_single_layers=2,attention_head_dim=16,num_attention_heads=2,"
        "joint_attention_dim=32,pooled_projection_dim=16,in_channels=16,axes_dims_rope=4/6/6")
FLUX_ALL = "to_k+to_q+to_v+add_k_proj+add_q_proj+add_v_proj+to_out.0+to_add_out"
"""flux_lora_target ``all`` (its default) but the fused projections, which exist only under fuse_qkv_projections."""
FLUX_PLAN = Plan(adapter=f"lora:r=16,alpha=16,dropout=0.1,targets={FLUX_ALL}", base_weights="fp8",
                 precision="bf16-pure", checkpointing="blocks", optimizer="adamw", bf16_update="kahan")
"""The FLUX example's run: int8-quanto (one byte), a bf16 LoRA (made in the bf16 model), AdamWBF16 (bf16 states
and a bf16 Kahan shift), value clipping (nothing held)."""
IMAGE = {"id": "img", "type": "local", "resolution": 1024, "resolution_type": "pixel_area"}
EMBEDS = {"id": "text", "dataset_type": "text_embeds", "type": "local", "default": True}


def _flux(**changes) -> dict:
    """The FLUX example's options with ``changes`` (None: removed), its data backend inline."""
    data = copy.deepcopy(json.loads(FLUX.read_text()))
    data["data_backend_config"] = [IMAGE, EMBEDS]
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return data


def _said(config) -> list[str]:
    return [w.split(": ", 1)[1] for w in config.warnings]


def test_the_flux_example_is_the_run_simpletuner_makes_of_it():
    c = read_config(FLUX, CARD)
    assert (c.workload, c.batch_size, c.micro_batch_size, c.resolution) == ("dit-flux", 1, 1, 512)  # (its 512 px set)
    assert c.plan == FLUX_PLAN and c.warnings == ()


def test_the_other_examples_are_their_runs():
    sdxl = read_config(DATA / "sdxl.lycoris-lokr" / "config.json", CARD)  # (bypass_mode LoKr on Attention, factor 12)
    assert (sdxl.workload, sdxl.batch_size, sdxl.resolution) == ("unet-sdxl", 1, 1024)
    assert sdxl.plan == Plan(adapter="lokr:r=10000,alpha=1,factor=12,factored=1,targets=to_k+to_q+to_v+to_out.0+"
                                     "add_q_proj+add_k_proj+add_v_proj+to_add_out",
                             precision="bf16-pure", checkpointing="blocks", optimizer="adamw", bf16_update="kahan")
    assert _said(sdxl) == ["LyCORIS's bypass LoKr is estimated as memfit's factored LoKr (the update never built as a "
                           "matrix) on the linear layers of Attention"]
    sd3 = read_config(DATA / "sd3.peft-lora" / "config.json", CARD)  # (SD3.5 medium: no built-in, its hub id)
    assert (sd3.workload, sd3.batch_size, sd3.resolution) == ("stabilityai/stable-diffusion-3.5-medium", 3, 1024)
    assert sd3.plan == Plan(adapter="lora:r=128,alpha=128,dropout=0.1,targets=to_k+to_q+to_v+to_out.0",
                            precision="bf16-pure", checkpointing="blocks", optimizer="adamw", bf16_update="kahan")
    assert sd3.warnings == ()


@pytest.mark.parametrize("changes,workload,fields", [
    ({"model_flavour": "schnell"}, "dit-flux:guidance_embeds=false", {}),
    ({"model_flavour": "dev", "text_cache_ondemand": True}, "dit-flux:text_encoders=frozen", {}),
    ({"base_model_precision": "nf4-bnb"}, "dit-flux", {"base_weights": "nf4"}),
    ({"base_model_precision": "no_change", "lora_rank": 64, "lora_alpha": None, "lora_dropout": 0},
     "dit-flux", {"base_weights": "as-is", "adapter": f"lora:r=64,alpha=64,targets={FLUX_ALL}"}),
    ({"flux_lora_target": "context", "use_dora": True, "base_model_precision": None}, "dit-flux",
     {"adapter": "dora:r=16,alpha=16,dropout=0.1,targets=add_k_proj+add_q_proj+add_v_proj+to_add_out",
      "base_weights": "as-is"}),
    ({"use_dora": True}, "dit-flux", {}),  # (SimpleTuner turns DoRA off over quanto's weights)
    ({"base_model_precision": "fp8-torchao"}, "dit-flux", {}),
    ({"peft_lora_target_modules": ["to_q", "to_v"]}, "dit-flux", {"adapter": "lora:r=16,alpha=16,dropout=0.1,"
                                                                          "targets=to_q+to_v"}),
    ({"model_type": "full", "base_model_precision": None}, "dit-flux", {"adapter": "none", "base_weights": "as-is"}),
    ({"mixed_precision": "no", "optimizer": "torch-adamw", "base_model_precision": None}, "dit-flux",
     {"precision": "fp32", "bf16_update": "nearest", "base_weights": "as-is"}),
    ({"optimizer": "bnb-adamw8bit", "grad_clip_method": "norm"}, "dit-flux",
     {"optimizer": "adamw8bit", "bf16_update": "nearest", "max_grad_norm": 2.0}),
    ({"optimizer": "optimi-adamw", "grad_clip_method": "norm", "max_grad_norm": 0.5}, "dit-flux", {"max_grad_norm": 0.5}),
    ({"use_ema": True, "ema_update_interval": 2}, "dit-flux", {"ema": {"decay": 0.995, "device": "cpu", "every": 2}}),
    ({"musubi_blocks_to_swap": 20, "gradient_checkpointing_interval": 3}, "dit-flux",
     {"swap_blocks": 20, "checkpointing": "blocks:every=3"}),  # (a swap turns the segments off: one block in 3)
    ({"gradient_checkpointing_backend": "unsloth", "optimizer_cpu_offload_method": "torchao"}, "dit-flux",
     {"offload": ["optimizer_states", "activations"]}),
    ({"gradient_checkpointing": False}, "dit-flux", {"checkpointing": "none"}),
])
def test_each_option_that_changes_memory_is_mapped(changes, workload, fields):
    c = map_config(_flux(**changes), "c.json", CARD)
    assert c.workload == workload and c.plan == FLUX_PLAN.replace(**fields), c.plan


def test_keys_with_dashes_strings_and_defaults_read_as_simpletuner_reads_them():
    """``--option`` keys, argparse's strings ("16", "true"), and the string "false" dropped as its
    ``mapping_to_cli_args`` drops it (the default then runs: gradient checkpointing on)."""
    data = {"--model_family": "flux", "--model_type": "lora", "--lora_rank": "8", "--use_ema": "true",
            "--ema_device": "accelerator", "--gradient_checkpointing": "false", "--resolution": "768"}
    c = map_config(data, "c.json", CARD)
    assert (c.workload, c.batch_size, c.resolution) == ("dit-flux", 4, 768)  # (train_batch_size 4; 768 px areas)
    assert c.plan == Plan(adapter=f"lora:r=8,alpha=8,dropout=0.1,targets={FLUX_ALL}", precision="bf16-pure",
                          checkpointing="blocks", bf16_update="kahan", ema={"decay": 0.995, "device": "device"})
    assert _said(c) == ["SimpleTuner's EMA is bf16 (weight_dtype); memfit's is fp32 (a bound: 2 bytes a trained "
                        "weight high)"]


def test_batches_and_buckets_are_the_largest_step_accumulated():
    sets = [dict(IMAGE, train_batch_size=2), dict(IMAGE, id="big", resolution=1.5, resolution_type="area"), EMBEDS,
            dict(IMAGE, id="off", resolution=4096, disabled=True)]
    c = map_config(_flux(data_backend_config=sets, train_batch_size=1, gradient_accumulation_steps=4), "c.json", CARD)
    assert (c.batch_size, c.micro_batch_size, c.resolution, c.plan.micro_batch_size) == (8, 2, 1024, 2)
    assert _said(c) == ["2 datasets; memfit's step is dataset 'img''s, the largest (2 x 1024 px)"]
    area = map_config(_flux(data_backend_config=[sets[1]]), "c.json", CARD)  # (1.5 MP: 1225 px, to 64s: 1216)
    assert (area.batch_size, area.resolution) == (1, 1216)
    pixel = map_config(_flux(data_backend_config=[dict(IMAGE, resolution=1000, resolution_type="pixel")]), "c.json",
                       CARD)
    assert pixel.resolution == 1024 and _said(pixel)[0].startswith("resolution_type pixel sizes an image's shorter")
    missing = map_config(_flux(data_backend_config="nowhere/multidatabackend.json", resolution=640), "c.json", CARD)
    assert missing.resolution == 640 and _said(missing)[0].startswith("data_backend_config nowhere/multidatabackend"
                                                                      ".json is not found here")


def test_a_wan_clip_is_its_frames_at_the_buckets_side():
    video = {"id": "clips", "dataset_type": "video", "type": "local", "resolution": 480, "video": {"num_frames": 50}}
    data = {"model_family": "wan", "model_type": "lora", "data_backend_config": [video, EMBEDS], "train_batch_size": 1,
            "base_model_precision": "int8-quanto"}
    c = map_config(data, "w.json", CARD)
    assert (c.workload, c.batch_size, c.resolution) == ("dit-wan-1.3b:frames=49", 1, (512, 512))  # (480 to 64s: 512)
    assert c.plan.base_weights == "fp8"
    assert _said(c) == ["quanto leaves Wan's feed-forward layers (*ffn*) in bf16; memfit quantizes them too (low by "
                        "a byte or more a feed-forward weight)", "num_frames 50: SimpleTuner trains 49 (8k + 1 frames)"]
    hidream = map_config({"model_family": "hidream", "model_type": "lora", "train_batch_size": 1}, "h.json", CARD)
    assert hidream.workload == "dit-hidream:force_inference_output=false"  # (its experts' training path)


def test_what_is_approximated_is_said_in_one_line():
    c = map_config(_flux(gradient_checkpointing_interval=2, optimizer="prodigy", tread_config={"routes": []},
                         fuse_qkv_projections=True, base_model_precision="int2-quanto", vae_cache_ondemand=True),
                   "c.json", CARD)
    assert c.plan == FLUX_PLAN.replace(base_weights="nf4", optimizer="prodigy", bf16_update="nearest",
                                       checkpointing="blocks:every=2")  # (TREAD's routes: one block in 2, no segments)
    said = [w[:40] for w in _said(c)]
    assert said == ["tread_config: TREAD routes a share of th", "base_model_precision int2-quanto: memfit",
                    "fuse_qkv_projections: memfit's model kee", "prodigy is prodigy-plus-schedule-free (f",
                    "vae_cache_ondemand or vae_cache_disable:"], said
    flux = map_config(_flux(gradient_checkpointing_interval=2), "c.json", CARD)
    assert flux.plan == FLUX_PLAN and _said(flux)[0].startswith("gradient_checkpointing_interval 2 checkpoints segments")
    qwen = map_config({"model_family": "qwen_image", "model_flavour": "v1.0", "model_type": "lora",
                       "gradient_checkpointing_interval": 2, "text_cache_disable": True}, "q.json", CARD)
    assert qwen.workload == "dit-qwenimage" and qwen.plan.checkpointing == "blocks:every=2"
    assert _said(qwen) == ["the text encoders run in the step (text_cache_ondemand or text_cache_disable); memfit "
                           "does not hold qwen_image's, so they are not in the estimate"]
    zimage = map_config({"model_family": "z_image", "model_type": "lora", "base_model_precision": "int8-quanto",
                         "text_cache_ondemand": True}, "z.json", CARD)
    assert zimage.workload == "dit-zimage:text_encoders=frozen" and zimage.plan.base_weights == "fp8"
    assert [w[:60] for w in _said(zimage)] == ["memfit stores the text encoders' linear weights as the trans"]
    assert all("\n" not in w for w in c.warnings + qwen.warnings + zimage.warnings)


def test_a_lycoris_network_without_bypass_is_lycoris_own(tmp_path):
    (tmp_path / "lycoris.json").write_text(json.dumps({"algo": "lokr", "multiplier": 1, "linear_dim": 32,
                                                      "linear_alpha": 2, "factor": 8,
                                                      "apply_preset": {"target_module": ["Attention", "FeedForward"]}}))
    c = map_config(_flux(lora_type="lycoris", lycoris_config="lycoris.json", base_model_precision="no_change"), "c.json",
                   CARD, base=tmp_path)
    assert c.plan.adapter == "lycoris:algo=lokr,dim=32,alpha=2,factor=8,modules=Attention+FeedForward"
    assert c.warnings == ()


def test_config_toml_and_config_env_are_read_as_json(tmp_path):
    toml = tmp_path / "config.toml"
    toml.write_text('"--model_family" = "flux"\nmodel_type = "lora"\nbase_model_precision = "int8-quanto"\n'
                    'lora_alpha = 16\nresolution = 512\ntrain_batch_size = 1\n')
    c = read_config(toml, CARD)
    assert (c.workload, c.batch_size, c.resolution, c.plan) == ("dit-flux", 1, 512, FLUX_PLAN)
    env = tmp_path / "config.env"
    env.write_text("export MODEL_FAMILY='flux'\nMODEL_TYPE=\"lora\"\nBASE_MODEL_PRECISION=int8-quanto\n"
                   "TRAIN_BATCH_SIZE=1\nRESOLUTION=512\nUSE_EMA=false\n# a comment\n"
                   'TRAINER_EXTRA_ARGS="--lora_alpha=16 --lora_rank 16"\nTRAINER_EXTRA_ARGS+="--flux_lora_target=all"\n')
    c = read_config(env, CARD)
    assert (c.workload, c.batch_size, c.resolution, c.plan) == ("dit-flux", 1, 512, FLUX_PLAN)


def test_simpletuner_configs_are_told_by_their_model_family():
    assert is_simpletuner({"--model_family": "flux"}) and is_simpletuner({"model_family": "sdxl", "lora_rank": 4})
    assert not is_simpletuner({"pretrained_model_name_or_path": "x", "network_dim": 4}) and not is_simpletuner([1])


@pytest.mark.parametrize("changes,message", [
    ({"model_family": "kolors"}, r"memfit reads SimpleTuner's flux, flux2, .* configs, not model_family 'kolors'; name "
                                 r"the model as the workload: memfit estimate ORG/NAME --from c.json"),
    ({"model_family": None}, "model_family is not set"),
    ({"model_flavour": "pro"}, "model_flavour 'pro' is not one of SimpleTuner's flux flavours"),
    ({"model_family": "qwen_image", "model_flavour": "edit-v1"}, "memfit estimate dit-qwenimage:control_images=1"),
    ({"optimizer": "soap"}, "optimizer 'soap' is not one memfit runs"),
    ({"mixed_precision": "fp8"}, "mixed_precision 'fp8': memfit runs bf16, fp16 and no"),
    ({"mixed_precision": "no", "base_model_precision": None}, "optimizer adamw_bf16 needs bf16 weights"),
    ({"model_type": "full"}, "base_model_precision int8-quanto with model_type full"),
    ({"base_model_precision": "int3-magic"}, "base_model_precision 'int3-magic' is not one"),
    ({"lora_type": "loha"}, "lora_type 'loha' is not one of standard, lycoris"),
    ({"peft_lora_mode": "singlora"}, "peft_lora_mode 'singlora'"),
    ({"gradient_checkpointing_backend": "torch-ffn"}, "gradient_checkpointing_backend 'torch-ffn'"),
    ({"flux_lora_target": "everything"}, "flux_lora_target 'everything' is not one memfit reads"),
    ({"deepspeed_config": "ds.json"}, "deepspeed_config: memfit does not model DeepSpeed"),
    ({"fsdp_enable": True}, "fsdp_enable: memfit does not read SimpleTuner's FSDP settings"),
    ({"controlnet": True}, "controlnet: memfit builds no ControlNet"),
    ({"train_text_encoder": True}, "train_text_encoder: memfit does not model"),
    ({"lora_rank": "sixteen"}, "lora_rank must be a whole number, got 'sixteen'"),
    ({"data_backend_config": [EMBEDS]}, "data_backend_config holds no image or video dataset"),
    ({"data_backend_config": [dict(IMAGE, train_batch_size=0)]}, "dataset 'img' train_batch_size must be a whole"),
    ({"data_backend_config": [dict(IMAGE, resolution_type="megapixel")]}, "resolution_type 'megapixel' is not one"),
])
def test_what_memfit_does_not_run_is_one_line(changes, message):
    with pytest.raises(UserError, match=message) as e:
        map_config(_flux(**changes), "c.json", CARD)
    assert "\n" not in str(e.value)


def test_a_lycoris_over_quantized_weights_of_another_algo_is_one_line(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps({"algo": "loha", "linear_dim": 8, "linear_alpha": 1}))
    with pytest.raises(UserError, match="LyCORIS loha over quantized base weights .* set base_model_precision no_change"):
        map_config(_flux(lora_type="lycoris", lycoris_config="l.json"), "c.json", CARD, base=tmp_path)
    with pytest.raises(UserError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        read_config(tmp_path / "bad.json", CARD)


def test_a_tiny_flux_beside_the_example_estimates_its_plan():
    """The FLUX example's plan (fp8 base, a bf16 LoRA with dropout, AdamW's bf16 states and Kahan buffer) on a tiny
    FLUX named beside it: memfit builds and traces the step it maps."""
    from memfit.memory.estimate import estimate
    c = read_config(FLUX, CARD, workload=TINY)
    assert c.workload == TINY and c.plan == FLUX_PLAN
    report = estimate(c.workload, c.plan, batch_size=c.batch_size, resolution=128, device="rtx4090")
    adapted = next(f for f in report.facts if f.startswith("adapter:"))
    assert report.peak_bytes > 0 and adapted.startswith("adapter: 14 layers adapted"), report.facts


def test_from_file_tells_a_simpletuner_config_by_its_model_family(tmp_path, monkeypatch):
    """``--from``: a .json or .env is SimpleTuner's; a .toml is SimpleTuner's where it names a model_family, else
    kohya's."""
    from memfit.integrations import kohya
    from memfit.integrations.from_file import read_training_config
    as_json = read_training_config(FLUX, CARD)
    toml = tmp_path / "config.toml"
    options = {k: v for k, v in json.loads(FLUX.read_text()).items() if k != "data_backend_config"}
    toml.write_text("\n".join(f'"{k}" = {json.dumps(v, ensure_ascii=False)}' for k, v in options.items()))
    assert read_training_config(toml, CARD).plan == as_json.plan
    env = tmp_path / "config.env"
    env.write_text('export MODEL_FAMILY=flux\nexport MODEL_TYPE=lora\nexport TRAINER_EXTRA_ARGS="--lora_rank=8"\n')
    assert read_training_config(env, CARD).plan.config("adapter").r == 8
    sd_scripts = tmp_path / "kohya.toml"
    sd_scripts.write_text('pretrained_model_name_or_path = "x"\n')
    monkeypatch.setattr(kohya, "read_config", lambda path, device, workload=None: ("kohya", path))
    assert read_training_config(sd_scripts, CARD) == ("kohya", sd_scripts)
    assert read_training_config(toml, CARD).plan == as_json.plan


def test_optimis_lion_is_adamws_bound_said_in_a_line():
    """optimi-lion (SimpleTuner's Z-Image, Qwen-Image and Kontext examples): one bf16 state and a Kahan buffer; memfit
    has no bf16 Lion, so AdamW's two states with the buffer stand above it, said."""
    c = map_config(_flux(optimizer="optimi-lion"), "c.json", CARD)
    assert c.plan == FLUX_PLAN
    assert _said(c) == ["optimi-lion keeps one state a weight, in its dtype, beside its Kahan buffer; memfit's AdamW "
                        "keeps two (a bound: one state a trained weight high)"]


def test_ltx2s_example_is_dit_ltx2_with_its_clip_and_swapped_blocks():
    """SimpleTuner's ltxvideo2-19b-t2v.peft-lora example (its dev flavour, Lightricks/LTX-2: memfit's dit-ltx2, which
    runs the audio stream on zero latents and the text connectors frozen as SimpleTuner does): 2 s at 24 fps is 48
    frames, trained as 41 (8k + 1); 45 of its 48 blocks swapped; int8-torchao as one byte a weight."""
    video = {"id": "v", "dataset_type": "video", "type": "local", "resolution": 480, "resolution_type": "pixel_area",
             "video": {"num_frames": 48}}
    c = map_config({"model_family": "ltxvideo2", "model_type": "lora", "lora_rank": 16, "lora_type": "standard",
                    "base_model_precision": "int8-torchao", "musubi_blocks_to_swap": 45, "gradient_checkpointing": True,
                    "mixed_precision": "bf16", "optimizer": "adamw_bf16", "max_grad_norm": 0.1, "train_batch_size": 2,
                    "resolution": 480, "resolution_type": "pixel_area", "data_backend_config": [video, EMBEDS]},
                   "ltx2.json", CARD)
    assert (c.workload, c.batch_size, c.resolution) == ("dit-ltx2:frames=41", 2, (512, 512))  # (480 to 64s: 512)
    assert c.plan == Plan(adapter="lora:r=16,alpha=16,dropout=0.1,targets=to_k+to_q+to_v+to_out.0", base_weights="fp8",
                          precision="bf16-pure", checkpointing="blocks", swap_blocks=45, optimizer="adamw",
                          bf16_update="kahan")
    assert _said(c) == ["num_frames 48: SimpleTuner trains 41 (8k + 1 frames)"]
    fp8 = map_config({"model_family": "ltxvideo2", "model_flavour": "dev-fp8", "model_type": "lora"}, "f.json", CARD)
    assert fp8.workload == "dit-ltx2:frames=145"  # (no data backend: a video dataset's default, 5 s at 30 fps)
    assert "dev-fp8 loads LTX-2's fp8 checkpoint file" in _said(fp8)[0]
    later = map_config({"model_family": "ltxvideo2", "model_flavour": "2.3-dev", "model_type": "lora"}, "l.json", CARD)
    assert later.workload.startswith("dg845/LTX-2.3-Diffusers")


def test_the_shipped_ltx2_example_reads_as_its_inline_twin():
    c = read_config(DATA / "ltxvideo2-19b-t2v.peft-lora" / "config.json", CARD)
    assert (c.workload, c.batch_size, c.resolution) == ("dit-ltx2:frames=41", 2, (512, 512))
    assert (c.plan.swap_blocks, c.plan.base_weights, c.plan.bf16_update) == (45, "fp8", "kahan")
