"""ai-toolkit job configs (memfit.integrations.ai_toolkit): its FLUX.1 LoRA example for 24 GB read as the run
ai-toolkit makes of it (fp8 base, T5 and CLIP-L in the step, the LoRA in fp32 over bf16, EMA of the LoRA),
each option that changes memory mapped or said in one line, and what memfit does not run refused in one line;
on the command line, a tiny FLUX named beside it runs the config's plan."""

import copy
import json
from pathlib import Path

import pytest
import yaml

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.ai_toolkit import SD35_LARGE, map_config
from memfit.integrations.from_file import read_training_config
from memfit.plans import Plan
from tests.integration.test_cli_errors import check, run

DATA = Path(__file__).resolve().parents[1] / "data" / "ai_toolkit"
EXAMPLE = DATA / "train_lora_flux_24gb.yaml"
CARD = get_device("rtx4090")
TINY = ("dit-flux:num_layers=1,num_single_layers=2,attention_head_dim=16,num_attention_heads=2,"
        "joint_attention_dim=32,pooled_projection_dim=16,in_channels=16,axes_dims_rope=4/6/6")


def _example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def _with(**changes) -> dict:
    """The example with ``section__key=value`` changes to its training process (``None``: removed)."""
    data = copy.deepcopy(_example())
    process = data["config"]["process"][0]
    for path, value in changes.items():
        section, key = path.split("__")
        target = process[section][0] if section == "datasets" else process.setdefault(section, {})
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    return data


def test_the_24gb_flux_example_is_the_run_ai_toolkit_makes_of_it():
    c = read_training_config(EXAMPLE, CARD)
    assert c.workload == "dit-flux:text_encoders=frozen" and (c.batch_size, c.resolution) == (1, 1024)
    assert c.plan == Plan(adapter="lora:r=16,alpha=16,targets=in-blocks", base_weights="fp8",
                          precision="bf16-base-noautocast", checkpointing="blocks", optimizer="adamw8bit",
                          ema={"decay": 0.99, "device": "device"}, max_grad_norm=1.0)
    assert c.warnings == ()  # (its LoRA's fp32 inputs are in the precision: NOTE [ ai-toolkit's LoRA: no autocast ])


@pytest.mark.parametrize("changes,workload,fields", [
    ({"train__cache_text_embeddings": True}, "dit-flux", {}),
    ({"train__unload_text_encoder": True}, "dit-flux", {}),
    ({"datasets__cache_text_embeddings": True}, "dit-flux", {}),  # (a dataset's cache unloads them too)
    ({"train__train_text_encoder": True}, "dit-flux:text_encoders=trained", {}),
    ({"network__linear": None, "network__linear_alpha": None}, "dit-flux:text_encoders=frozen",
     {"adapter": "lora:r=4,alpha=1.0,targets=in-blocks"}),  # (ai-toolkit's defaults: rank 4, alpha 1)
    ({"network__rank": 64, "network__alpha": 32, "network__linear_alpha": None}, "dit-flux:text_encoders=frozen",
     {"adapter": "lora:r=64,alpha=32,targets=in-blocks"}),  # (rank wins over linear; alpha under linear_alpha)
    ({"network__transformer_only": False}, "dit-flux:text_encoders=frozen",
     {"adapter": "lora:r=16,alpha=16,targets=all-linear"}),  # (the embedders and output layers too)
    ({"train__dtype": "half", "model__arch": "flex1", "model__is_flux": None,
      "model__name_or_path": "ostris/Flex.1-alpha"}, "ostris/Flex.1-alpha:text_encoders=frozen",
     {"precision": "fp16-base-noautocast"}),
    ({"model__quantize": None, "train__dtype": None}, "dit-flux:text_encoders=frozen",
     {"base_weights": "as-is", "precision": "fp32"}),
    ({"model__name_or_path": "black-forest-labs/FLUX.1-schnell"},
     "dit-flux:guidance_embeds=false,text_encoders=frozen", {}),
    ({"model__name_or_path": "/models/my-flux", "train__dtype": "fp16"}, "/models/my-flux:text_encoders=frozen",
     {"precision": "fp16-base-noautocast"}),
    ({"network__type": "lokr"}, "dit-flux:text_encoders=frozen",  # (ai-toolkit's LoKr: full rank by default)
     {"adapter": "lokr:r=full,targets=in-blocks,factored=1"}),
    ({"network__type": "LoKr", "network__lokr_full_rank": False, "network__lokr_factor": 8},
     "dit-flux:text_encoders=frozen", {"adapter": "lokr:r=16,alpha=16,targets=in-blocks,factor=8,factored=1"}),
    ({"train__gradient_checkpointing": False, "train__optimizer": "adafactor", "train__ema_config": None},
     "dit-flux:text_encoders=frozen", {"checkpointing": "none", "optimizer": "adafactor", "ema": None,
                                       "max_grad_norm": None}),  # (ai-toolkit clips nothing with adafactor)
])
def test_each_option_that_changes_memory_is_mapped(changes, workload, fields):
    c = map_config(_with(**changes), "c.yaml", CARD)
    assert c.workload == workload and c.plan == read_training_config(EXAMPLE, CARD).plan.replace(**fields), c.plan


def test_batches_and_buckets_are_the_largest_and_accumulated():
    c = map_config(_with(train__batch_size=2, train__gradient_accumulation_steps=4, datasets__resolution=[512, 768]),
                   "c.yaml", CARD)
    assert (c.batch_size, c.micro_batch_size, c.resolution, c.plan.micro_batch_size) == (8, 2, 768, 2)
    assert map_config(_with(datasets__resolution=None), "c.yaml", CARD).resolution == 512  # (ai-toolkit's default)
    assert map_config(_with(datasets__resolution=[632]), "c.yaml", CARD).resolution == 624  # (a side of 16s)


@pytest.mark.parametrize("name,workload,fields,said", [
    ("train_lora_lumina", "dit-lumina2:text_encoders=frozen", {"base_weights": "as-is"},
     ["quantize_te differs from quantize", "latents are not cached"]),
    ("train_lora_sd35_large_24gb", f"{SD35_LARGE},text_encoders=frozen", {}, []),
    ("train_lora_qwen_image_24gb", "dit-qwenimage", {"base_weights": "nf4", "ema": None},  # (uint3: as nf4, said)
     ["qtype's accuracy-recovery adapter", "qtype uint3 stores 3 bits a weight"]),
    ("train_lora_wan21_14b_24gb", "dit-wan:frames=1", {"adapter": "lora:r=32,alpha=32,targets=in-blocks"},
     []),  # (umT5 unloaded: its states cached; images, one frame)
    ("train_lora_wan22_14b_24gb", "dit-wan:frames=1,experts=2,switch=step,low_vram=True",
     {"adapter": "lora:r=32,alpha=32,targets=in-blocks", "base_weights": "nf4", "ema": None},  # (uint4 + ARA: as nf4)
     ["qtype's accuracy-recovery adapter", "latents are not cached"]),  # (both experts; switch every 10: steps)
    ("train_lora_wan22_14b_i2v_image_clip_24gb", "dit-wan-i2v:frames=5,experts=2,switch=step,low_vram=True",
     {"adapter": "lora:r=32,alpha=32,targets=in-blocks", "ema": None},  # (qfloat8: fp8)
     ["image_i2v_clip_training makes a share of the batches clips of 5 frames", "latents are not cached"]),
    ("train_lora_qwen_image_edit_plus2509_32gb_2controls",
     "dit-qwenimage:control_images=2,control_px=1024,caption_tokens=473", {"ema": None},  # (qfloat8: fp8)
     ["control_path: ai-toolkit encodes", "Qwen2.5-VL's caption states hold the references'", "latents are not cached"]),
    ("train_lora_flux_kontext_24gb", "dit-flux:text_encoders=frozen,control_images=1", {"ema": None},
     ["control_path: ai-toolkit encodes each reference image"]),  # (its pairs: a reference image's tokens)
    ("train_lora_qwen_image_edit_32gb", "dit-qwenimage:control_images=1,caption_tokens=1440",
     {"base_weights": "nf4", "ema": None},  # (its reference's tokens, and Qwen2.5-VL's states of it: said)
     ["qtype's accuracy-recovery adapter", "qtype uint3 stores 3 bits a weight", "control_path: ai-toolkit encodes",
      "Qwen2.5-VL's caption states hold", "latents are not cached"]),
    ("train_lora_hidream_48", "dit-hidream:text_encoders=frozen,force_inference_output=false",
     {"adapter": "lora:r=32,alpha=32,targets=in-blocks,skip=ff_i.experts+ff_i.gate", "ema": None},  # (qfloat8: fp8)
     ["ai-toolkit's HiDream router appends", "quantize_te quantizes Llama-3.1 and T5-XXL; memfit's fp8 base weights",
      "latents are not cached"]),  # (its own model's training path; all four text encoders in the step)
    ("train_lora_wan21_1b_24gb", "dit-wan-1.3b:frames=1", {"adapter": "lora:r=32,alpha=32,targets=in-blocks",
                                                           "base_weights": "as-is"},
     ["the text encoders run in the step"]),  # (umT5 in the step: said)
])
def test_ai_toolkits_other_examples_are_the_runs_it_makes_of_them(name, workload, fields, said):
    """Each of ai-toolkit's examples for another model: its published id as memfit's built-in of that model,
    the example's fields as in the FLUX one, and what memfit does not hold said in one line each."""
    c = read_training_config(DATA / f"{name}.yaml", CARD)
    assert c.workload == workload and c.plan == read_training_config(EXAMPLE, CARD).plan.replace(**fields), c.plan
    assert [w.split(": ", 1)[1][:len(s)] for w, s in zip(c.warnings, said)] == said and len(c.warnings) == len(said)


def test_hidreams_clips_are_said_only_where_ai_toolkit_quantizes_its_other_encoders():
    """ai-toolkit's ``quantize_te`` quantizes HiDream's Llama-3.1 and T5-XXL, not its CLIPs (said, as memfit's fp8 stores
    them too); with ``quantize_te: false`` the general line says that every encoder differs."""
    data = yaml.safe_load((DATA / "train_lora_hidream_48.yaml").read_text())
    data["config"]["process"][0]["model"]["quantize_te"] = False
    said = [w.split(": ", 1)[1][:40] for w in map_config(data, "h.yaml", CARD).warnings]
    assert said == ["quantize_te differs from quantize; memfi", "ai-toolkit's HiDream router appends each",
                    "latents are not cached (cache_latents_to"], said


def test_the_z_image_turbo_example_is_its_run():
    """ai-toolkit's Z-Image Turbo example: Z-Image's built-in with Qwen3-4B in the step, Prodigy, a rank-128 LoRA on the 30 ``layers`` alone (its ``get_transformer_block_names``,
    not the refiners), fp8 base, 1024 px buckets of 32 px, and what memfit does not hold said (DOP, the assistant
    LoRA)."""
    data = yaml.safe_load((DATA / "train_lora_zimage_turbo_32gb.yaml").read_text())
    data["config"]["process"][0]["datasets"][0]["resolution"] = [1000]
    c = map_config(data, "z.yaml", CARD)
    assert (c.workload, c.batch_size, c.resolution) == ("dit-zimage:text_encoders=frozen", 2, 992)
    assert c.plan == Plan(adapter="lora:r=128,alpha=128,targets=in-blocks:layers", base_weights="fp8",
                          precision="bf16-base-noautocast", checkpointing="blocks", optimizer="prodigy",
                          max_grad_norm=1.0)
    data["config"]["process"][0]["train"]["optimizer"] = "prodigy_schedulefree"  # (Prodigy there: get_optimizer)
    assert map_config(data, "z.yaml", CARD).plan.optimizer == "prodigy"
    said = ["diff_output_preservation runs a second forward", "assistant_lora_path: the training adapter is merged"]
    assert [w.split(": ", 1)[1][:len(s)] for w, s in zip(c.warnings, said)] == said and len(c.warnings) == 2


def test_a_lora_on_one_list_of_blocks_adapts_those_blocks_alone():
    """``targets=in-blocks:layers``: the linear layers of Z-Image's main layers, none of its refiners'; a name that
    is no list of blocks is one line naming those there are."""
    from memfit.memory.estimate import estimate
    tiny = ("dit-zimage:dim=64,n_layers=2,n_refiner_layers=2,n_heads=4,n_kv_heads=4,cap_feat_dim=32,axes_dims=8/4/4,"
            "caption_tokens=40")
    every = estimate(tiny, Plan(adapter="lora:r=4,targets=in-blocks"), batch_size=1, resolution=64)
    main = estimate(tiny, Plan(adapter="lora:r=4,targets=in-blocks:layers"), batch_size=1, resolution=64)
    count = [int(next(f for f in r.facts if f.startswith("adapter:")).split()[1]) for r in (every, main)]
    # (each block: to_q, to_k, to_v, to_out.0, its feed-forward's w1, w2, w3 and, but in the context refiners, its
    # adaLN modulation: 2 layers x 8, 2 noise refiners x 8, 2 context refiners x 7)
    assert count == [2 * 8 + 2 * 8 + 2 * 7, 2 * 8]
    with pytest.raises(UserError, match="blocks is not a list of the model's repeated blocks; name one of noise_refiner, "
                                         "context_refiner, layers "):
        estimate(tiny, Plan(adapter="lora:r=4,targets=in-blocks:blocks"), batch_size=1, resolution=64)


@pytest.mark.parametrize("kwargs,train,low_vram,options", [
    ({}, {}, False, "experts=2,switch=batch"),  # (ai-toolkit's defaults: both experts, a switch at every batch)
    ({}, {"switch_boundary_every": 10}, True, "experts=2,switch=step,low_vram=True"),
    ({}, {"switch_boundary_every": 3, "gradient_accumulation": 2}, False, "experts=2,switch=batch"),  # (mid-step switches)
    ({}, {"switch_boundary_every": 4, "gradient_accumulation": 2}, False, "experts=2,switch=step"),
    ({"train_low_noise": False}, {}, False, "experts=2,switch=none"),  # (both loaded, one trained)
])
def test_wan22s_two_experts_are_trained_as_ai_toolkit_switches_them(kwargs, train, low_vram, options):
    data = _with(model__arch="wan22_14b", model__name_or_path="ai-toolkit/Wan2.2-T2V-A14B-Diffusers-bf16",
                 model__low_vram=low_vram, model__model_kwargs=kwargs, **{f"train__{k}": v for k, v in train.items()})
    assert map_config(data, "c.yaml", CARD).workload == f"dit-wan:frames=1,{options}"


@pytest.mark.parametrize("arch,name,workload", [
    ("wan22_14b_i2v", "Wan-AI/Wan2.2-I2V-A14B-Diffusers", "dit-wan-i2v:frames=1,experts=2,switch=batch"),
    ("wan22_5b", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "dit-wan-5b:frames=1"),  # (one model, 16x VAE: 32 px buckets)
])
def test_wan22s_other_archs_are_their_built_ins(arch, name, workload):
    c = map_config(_with(model__arch=arch, model__name_or_path=name, datasets__resolution=[1008]), "c.yaml", CARD)
    assert (c.workload, c.resolution) == (workload, 992 if arch == "wan22_5b" else 1008)


def test_kontext_without_pairs_trains_as_flux():
    """ai-toolkit's Kontext with no ``control_path`` trains on the images alone: no reference tokens."""
    c = map_config(_with(model__arch="flux_kontext", model__name_or_path="black-forest-labs/FLUX.1-Kontext-dev"),
                   "c.yaml", CARD)
    assert "control_images" not in c.workload and not any("control_path" in w for w in c.warnings)


def test_wan22_with_no_expert_trained_is_one_line():
    data = _with(model__arch="wan22_14b", model__name_or_path="ai-toolkit/Wan2.2-T2V-A14B-Diffusers-bf16",
                 model__model_kwargs={"train_high_noise": False, "train_low_noise": False})
    with pytest.raises(UserError, match="train_high_noise and train_low_noise are both false"):
        map_config(data, "c.yaml", CARD)


@pytest.mark.parametrize("model,workload", [
    ({"name_or_path": "stabilityai/stable-diffusion-xl-base-1.0", "is_xl": True}, "unet-sdxl:text_encoders=frozen"),
    ({"name_or_path": "runwayml/stable-diffusion-v1-5"}, "unet-sd15:text_encoders=frozen"),  # (no arch: SD 1.x)
    ({"name_or_path": "/models/my-sdxl", "arch": "sdxl"}, "/models/my-sdxl:text_encoders=frozen"),
    ({"name_or_path": "Wan-AI/Wan2.1-T2V-14B-Diffusers", "arch": "wan21"}, "dit-wan:frames=37"),
])
def test_archs_and_older_flags_name_the_model(model, workload):
    data = _with(datasets__num_frames=40)  # (a Wan clip: 4k + 1 frames, said)
    data["config"]["process"][0]["model"] = model
    c = map_config(data, "c.yaml", CARD)
    assert c.workload == workload
    assert any("num_frames 40 is not 4k + 1" in w for w in c.warnings) == ("wan" in workload)


def test_what_memfit_runs_otherwise_is_said_in_one_line():
    quiet = map_config(_with(model__qtype="int8"), "c.yaml", CARD)  # (one byte: unsaid)
    assert quiet.warnings == () and quiet.plan.base_weights == "fp8"
    eight = map_config(_with(model__qtype="uint8|ostris/adapter.safetensors"), "c.yaml", CARD)
    assert eight.plan.base_weights == "as-is"  # (ai-toolkit's uintx path leaves 8 bits unquantized)
    assert [w.split(": ", 1)[1][:30] for w in eight.warnings][:2] == ["qtype's accuracy-recovery adap",
                                                                      "qtype uint8: ai-toolkit leaves"]
    data = _with()
    data["config"]["process"][0]["datasets"] = {"resolution": 512}
    with pytest.raises(UserError, match="datasets must be a list of datasets"):
        map_config(data, "c.yaml", CARD)
    assert map_config(_with(model__qtype="uint4"), "c.yaml", CARD).plan.base_weights == "nf4"  # (half a byte: unsaid)
    assert map_config(_with(model__qtype="int6"), "c.yaml", CARD).plan.base_weights == "fp8"  # (said: one byte)
    c = map_config(_with(model__quantize_te=False, model__layer_offloading=True, model__qtype="uint3",
                         datasets__cache_latents_to_disk=False, train__diff_output_preservation=True), "c.yaml", CARD)
    assert c.plan.base_weights == "nf4" and c.plan.swap_blocks == 0  # (FLUX.1: ai-toolkit offloads none of its layers)
    said = [w.split(": ", 1)[1][:40] for w in c.warnings]
    assert said == ["quantize_te differs from quantize; memfi", "qtype uint3 stores 3 bits a weight; memf",
                    "diff_output_preservation runs a second f",
                    "layer_offloading: ai-toolkit offloads no", "latents are not cached (cache_latents_to"], said
    assert all("\n" not in w for w in c.warnings)
    names = map_config(_with(network__network_kwargs={"ignore_if_contains": ["single_transformer_blocks.", "ff"],
                                                      "only_if_contains": ["transformer."]}), "c.yaml", CARD)
    assert names.plan.adapter == "lora:r=16,alpha=16,targets=in-blocks,skip=single_transformer_blocks.+ff,only=transformer."
    assert not any("_if_contains" in w for w in names.warnings)  # (mapped: skip= and only=, said nowhere)
    sdxl = map_config(_with(model__is_flux=None, model__is_xl=True, model__name_or_path="/m/sdxl"), "c.yaml", CARD)
    assert sdxl.plan.base_weights == "as-is" and any("quantizes no sdxl UNet" in w for w in sdxl.warnings)


def test_layer_offloading_of_qwen_image_flux2_and_wan_is_that_share_of_the_blocks_swapped():
    """ai-toolkit's memory manager streams a share of the linear layers of Qwen-Image, FLUX.2 and Wan (drawn at
    random): memfit swaps that share of the denoiser's blocks (Wan 2.1 1.3B: 30)."""
    wan = dict(model__is_flux=None, model__arch="wan21", model__name_or_path="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
               model__layer_offloading=True, model__quantize=None)
    every = map_config(_with(**wan), "c.yaml", CARD)
    assert every.workload == "dit-wan-1.3b:frames=1" and every.plan.swap_blocks == 30
    half = map_config(_with(**wan, model__layer_offloading_transformer_percent=0.5), "c.yaml", CARD)
    assert half.plan.swap_blocks == 15 and any("its last 15 of 30 blocks" in w for w in half.warnings)
    with pytest.raises(UserError, match="layer_offloading_transformer_percent must be a share from 0 to 1"):
        map_config(_with(**wan, model__layer_offloading_transformer_percent=2), "c.yaml", CARD)


def test_older_flags_are_read_in_ai_toolkits_order_and_a_datasets_batch_size_wins():
    both = map_config(_with(model__is_xl=True, model__name_or_path="/m/model"), "c.yaml", CARD)  # (is_flux too)
    assert both.workload == "/m/model:text_encoders=frozen" and any("quantizes no sdxl" in w for w in both.warnings)
    sets = _with(datasets__batch_size=3, train__batch_size=1)
    assert map_config(sets, "c.yaml", CARD).batch_size == 3


@pytest.mark.parametrize("changes,message", [
    ({"model__is_flux": None, "model__arch": "omnigen2"}, r"memfit reads ai-toolkit's flux, flux_kontext, sd1, sdxl, sd3, "
     r"lumina2, qwen_image, qwen_image_edit, qwen_image_edit_plus2509, flux2, wan21, zimage, wan22_14b, wan22_14b_i2v, "
     r"wan22_5b, hidream configs, not arch 'omnigen2'; name the model as the workload"),
    ({"network__network_kwargs": {"ignore_if_contains": "ff"}}, r"network_kwargs.ignore_if_contains must be a list of "
     r"parts of layer names, got 'ff'"),
    ({"network__network_kwargs": {"only_if_contains": ["a+b"]}}, r"network_kwargs.only_if_contains must be a list"),
    ({"model__is_flux": None, "model__arch": "chroma", "model__name_or_path": "lodestones/Chroma"},
     r"does not read ai-toolkit's chroma configs: ai-toolkit trains its own Chroma .* memfit estimate dit-chroma"),
    ({"datasets__num_frames": 0, "model__arch": "wan21"}, "datasets num_frames must be a whole number >= 1"),
    ({"train__optimizer": "prodigy8bit"}, "train.optimizer 'prodigy8bit' is not one memfit runs"),
    ({"network__type": "locon"}, "network type 'locon' is not one memfit runs; memfit models LoRA and LoKr"),
    ({"network__type": "lokr", "network__lokr_factor": 0}, "network.lokr_factor must be -1 or a whole number >= 1"),
    ({"train__dtype": "int8"}, "train.dtype 'int8' is not one memfit runs"),
    ({"datasets__resolution": "big"}, "datasets resolution must be a side in pixels or a list of them"),
    ({"model__name_or_path": None}, "model.name_or_path is not set"),
    ({"train__ema_config": {"use_ema": True, "ema_decay": "abc"}}, "ema_config.ema_decay must be a number below 1"),
    ({"train__ema_config": True}, "train.ema_config must be a mapping"),
    ({"train__gradient_accumulation": 2, "train__gradient_accumulation_steps": 2},
     "gradient_accumulation and gradient_accumulation_steps are both set"),
    ({"network__linear_alpha": "x"}, "network.linear_alpha must be a number > 0"),
])
def test_what_memfit_does_not_run_is_one_line(changes, message):
    with pytest.raises(UserError, match=message) as e:
        map_config(_with(**changes), "c.yaml", CARD)
    assert "\n" not in str(e.value)


def test_on_the_command_line_a_tiny_flux_beside_it_runs_its_plan(tmp_path):
    """The config's plan and sizes on a tiny FLUX named beside it (its text encoders in the step, as the
    config runs them); a config of another model is one line with exit status 2."""
    argv = ["estimate", f"{TINY},text_layers=1", "--from", str(EXAMPLE), "--resolution", "128", "--device", "rtx4090",
            "--json"]
    rc, out, err = run(argv)
    check(argv, rc, err)
    report = json.loads(out)
    assert rc == 0 and report["workload"] == "dit-flux 128px, text encoders frozen" and report["batch_size"] == 1
    assert report["plan"]["ema"] == {"decay": 0.99, "device": "device", "every": 1}
    other = tmp_path / "sd3.yaml"
    other.write_text(yaml.safe_dump(_with(model__is_flux=None, model__arch="omnigen2")))
    argv = ["estimate", "--from", str(other), "--device", "rtx4090"]
    rc, _, err = run(argv)
    check(argv, rc, err)
    assert rc == 2 and "not arch 'omnigen2'" in err


def test_a_job_with_no_network_is_full_fine_tuning_in_its_dtype():
    """ai-toolkit's Flex.1 full fine-tuning example: no network, so the whole transformer trains in bf16 (no LoRA in
    fp32 over it: bf16-pure), Adafactor unclipped, an EMA of every weight; quantize has nothing to store there."""
    c = read_training_config(DATA / "train_full_fine_tune_flex.yaml", CARD)
    assert c.workload == "ostris/Flex.1-alpha:text_encoders=frozen"
    assert c.plan == Plan(precision="bf16-pure", checkpointing="blocks", optimizer="adafactor",
                          ema={"decay": 0.99, "device": "device"})
    data = yaml.safe_load((DATA / "train_full_fine_tune_flex.yaml").read_text())
    process = data["config"]["process"][0]
    process["model"]["quantize"], process["train"]["dtype"] = True, "fp16"
    c = map_config(data, "c.yaml", CARD)
    assert c.plan.precision == "fp16" and c.plan.base_weights == "as-is"
    said = [w.split(": ", 1)[1][:40] for w in c.warnings]
    assert said[:2] == ["quantize with no network: the trained we", "train.dtype fp16 with no network trains "], said


def test_fit_from_the_config_takes_its_model_size_and_adapter():
    """``memfit fit --from``: the cards table of the config's model (a tiny FLUX named beside it) at the config's
    size unless given, its LoRA methods with the config's rank, alpha and targets."""
    argv = ["fit", f"{TINY},text_layers=1", "--from", str(EXAMPLE), "--devices", "rtx4090", "--methods", "lora",
            "--resolution", "512", "--json"]  # (at 128 px the largest batch is 13,906: more traces to find)
    rc, out, err = run(argv)
    check(argv, rc, err)
    report = json.loads(out)
    assert rc == 0 and report["workload"] == "dit-flux 512px, text encoders frozen"
    assert report["cells"][0]["plan"]["adapter"] == "lora:r=16,alpha=16,targets=in-blocks"



def test_the_qwen_image_edit_plus_arch_is_read_as_2509s():
    """ai-toolkit's ``qwen_image_edit_plus`` (QwenImageEditPlusModel, the arch its UI writes for Qwen-Image-Edit-2509)
    reads as ``qwen_image_edit_plus2509`` does (it was refused in one line)."""
    data = yaml.safe_load((DATA / "train_lora_qwen_image_edit_plus2509_32gb_2controls.yaml").read_text())
    data["config"]["process"][0]["model"]["arch"] = "qwen_image_edit_plus"
    c, same = map_config(data, "plus.yaml", CARD), read_training_config(
        DATA / "train_lora_qwen_image_edit_plus2509_32gb_2controls.yaml", CARD)
    assert (c.workload, c.plan, c.batch_size, c.resolution) == (same.workload, same.plan, same.batch_size, same.resolution)
    assert c.workload.startswith("dit-qwenimage:control_images=2")
