"""A kohya-ss sd-scripts config read as a workload and a plan (memfit.integrations.kohya): each mapped
argument, the dataset config's sizes, the model of a checkpoint file, the arguments refused in one line,
and the ones named in a warning."""

from pathlib import Path

import pytest

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.from_file import read_training_config
from memfit.integrations.kohya import REFUSED, map_config
from memfit.plans import Plan

DATA = Path(__file__).resolve().parents[1] / "data" / "kohya"
CARD = get_device("rtx4090")
MINIMAL = {"pretrained_model_name_or_path": "/m/flux1-dev.safetensors", "ae": "/m/ae.safetensors",
           "cache_latents": True, "cache_text_encoder_outputs": True}


def test_a_flux_lora_for_12_gb_as_sd_scripts_trains_it():
    """Sections merged; fp8 base, 18 blocks swapped, blocks checkpointed, 8-bit AdamW, bf16-base (the LoRA
    in fp32, bf16 autocast), and
    sd-scripts' clipping at 1.0 by default; batch and buckets from the dataset config beside it."""
    c = read_training_config(DATA / "flux-lora-12gb.toml", CARD)
    assert c.workload == "dit-flux" and (c.batch_size, c.micro_batch_size, c.resolution) == (2, 2, 1024)
    assert c.plan == Plan(adapter="lora:r=16,alpha=16,targets=all-linear", base_weights="fp8", precision="bf16-base",
                          checkpointing="blocks", swap_blocks=39, optimizer="adamw8bit", max_grad_norm=1.0)
    assert [w.split(": ", 1)[1] for w in c.warnings] == [
        "blocks_to_swap 18 swaps 9 double- and 18 single-stream blocks of FLUX; memfit swaps about as many bytes as "
        "its last 39 blocks (swap_blocks 39)"]
    assert c.summary().endswith("dit-flux · batch 2 · 1024 px · " + c.plan.describe())


def test_sd_scripts_basic_flux_command_trains_clip_l_over_t5s_cached_states():
    """sd-scripts' basic FLUX.1 LoRA command (docs/flux_train_network.md) has no network_train_unet_only and caches
    the text encoders' outputs: sd-scripts then trains CLIP-L's LoRA in the step over T5-XXL's cached states, in
    fp16 over a 16-bit base (no fp8); so does the workload."""
    c = read_training_config(DATA / "flux-docs-basic.toml", CARD)
    assert c.workload == "dit-flux:text_encoders=trained,t5=cached" and (c.batch_size, c.resolution) == (2, 1024)
    assert c.plan == Plan(adapter="lora:r=16,alpha=1,targets=all-linear", precision="fp16-base",
                          checkpointing="blocks", swap_blocks=39, optimizer="adamw8bit", max_grad_norm=1.0)
    assert [w.split(": ", 1)[1][:30] for w in c.warnings] == ["blocks_to_swap 18 swaps 9 doub"]


def test_an_sdxl_lora_of_a_checkpoint_file_takes_the_model_named_beside_it():
    """A checkpoint file does not say which UNet it holds: the workload named beside --from is the model,
    else one line asks for it; ``resolution = "1216,832"`` is width by height; fp16 is a bound (memfit has
    no fp16 weights) and network_args are not mapped, each said in one line."""
    with pytest.raises(UserError, match=r"checkpoint file \(sd_xl_base_1.0.safetensors\) whose model the config does "
                                        r"not say; name it beside --from: memfit estimate unet-sdxl --from"):
        read_training_config(DATA / "sdxl-lora.toml", CARD)
    c = read_training_config(DATA / "sdxl-lora.toml", CARD, "unet-sdxl")
    assert (c.workload, c.batch_size, c.micro_batch_size, c.resolution) == ("unet-sdxl", 8, 4, (1216, 832))
    assert c.plan == Plan(adapter="lora:r=32,alpha=16,targets=all-linear", precision="fp16", checkpointing="blocks",
                          optimizer="adamw8bit-paged", micro_batch_size=4, max_grad_norm=None)
    assert c.plan.micro_batches(c.batch_size) == (4, 2)
    assert [w.split(": ", 1)[1].split(";")[0] for w in c.warnings] == [
        "network_args are not mapped (loraplus_lr_ratio)", "memfit has no fp16 weights"]
    assert "1216x832 px" in c.summary()


def test_precision_is_sd_scripts_or_the_nearest_said():
    """LoRA scripts cast the frozen base to the mixed precision's dtype, or to fp8 (fp32 LoRA weights):
    bf16-base or fp16-base; full_bf16: bf16-pure; full_fp16 a bound, said; full fine-tuning keeps fp32
    weights: autocast."""
    def mapped(**kw):
        c = map_config({**MINIMAL, "network_train_unet_only": True, **kw}, "c.toml", CARD)
        return c.plan.precision, [w.split(": ", 1)[1][:40] for w in c.warnings]
    lora = {"network_module": "networks.lora_flux"}
    assert mapped(**lora, mixed_precision="bf16") == ("bf16-base", [])
    assert mapped(**lora, mixed_precision="bf16", fp8_base=True) == ("bf16-base", [])
    assert mapped(**lora, mixed_precision="bf16", full_bf16=True) == ("bf16-pure", [])
    assert mapped(mixed_precision="bf16") == ("bf16", []) and mapped(mixed_precision="bf16", full_bf16=True)[0] == "bf16-pure"
    assert mapped(**lora, mixed_precision="fp16") == ("fp16-base", [])
    assert mapped(**lora, mixed_precision="fp16", full_fp16=True) == ("fp16", ["memfit has no fp16 weights; its fp16 aut"])


def test_sd_scripts_own_rules_for_memory_flags():
    """An SD/SDXL UNet without sdpa, xformers or mem_eff_attn computes the whole score matrix (``attention:
    math``); fused_backward_pass is full fine-tuning's, with Adafactor; FLUX's offloaded checkpointing is the
    blocks' inputs on the host, and neither it with swapped blocks nor an SD UNet's is run by sd-scripts."""
    sd = {"pretrained_model_name_or_path": "/m/v1-5.safetensors"}
    assert map_config(sd, "c.toml", CARD, "unet-sd15").plan.attention == "math"
    assert map_config({**sd, "sdpa": True}, "c.toml", CARD, "unet-sd15").plan.attention == "auto"
    fused = map_config({**MINIMAL, "optimizer_type": "Adafactor", "fused_backward_pass": True}, "c.toml", CARD).plan
    assert fused.optimizer_in_backward and fused.max_grad_norm is None  # (sd-scripts clips each gradient in its hook)
    c = map_config({**MINIMAL, "network_module": "networks.lora_flux", "fused_backward_pass": True}, "c.toml", CARD)
    assert not c.plan.optimizer_in_backward and "fused_backward_pass does nothing" in " ".join(c.warnings)
    prodigy = [map_config({**MINIMAL, "optimizer_type": "Prodigy", **extra}, "c.toml", CARD).plan.optimizer
               for extra in ({}, {"optimizer_args": ["decouple=True", "slice_p=11", "use_bias_correction=True"]})]
    assert prodigy == ["prodigy", "prodigy:slice_p=11"]  # (Prodigy's memory option, from its optimizer_args)
    c = map_config({**MINIMAL, "gradient_checkpointing": True, "cpu_offload_checkpointing": True}, "c.toml", CARD)
    assert c.plan.checkpointing == "blocks" and c.plan.offload == ("activations",)
    for bad, error in ((dict(optimizer_type="AdamW", fused_backward_pass=True), "fused_backward_pass: sd-scripts takes "
                        "it with optimizer_type Adafactor"),
                       (dict(gradient_checkpointing=True, cpu_offload_checkpointing=True, blocks_to_swap=8),
                        "cpu_offload_checkpointing and blocks_to_swap: sd-scripts refuses the two together"),
                       (dict(use_8bit_adam=True, optimizer_type="AdamW"), "use_8bit_adam and optimizer_type are both"),
                       (dict(model_type="chroma"), "model_type 'chroma': memfit builds FLUX.1 from a checkpoint file")):
        with pytest.raises(UserError, match=error):
            map_config({**MINIMAL, **bad}, "c.toml", CARD)
    with pytest.raises(UserError, match="sd-scripts' SD and SDXL UNets take no offloaded checkpointing"):
        map_config({**sd, "gradient_checkpointing": True, "cpu_offload_checkpointing": True}, "c.toml", CARD, "unet-sdxl")


def test_defaults_and_what_runs_in_the_step_are_named(hub_cache):
    """A diffusers repository is the workload as named; sd-scripts' defaults (LoRA rank 4, alpha 1,
    clipping at 1.0); latents, text-encoder outputs and text encoders computed or trained in the step are
    named, one line each (memfit's batch is the cached tensors), where memfit cannot tell the repository's
    denoiser (not in the cache here); where it can, and it holds them, its text encoders are in the step as
    sd-scripts runs them."""
    c = map_config({"pretrained_model_name_or_path": "black-forest-labs/FLUX.1-dev",
                    "network_module": "networks.lora_flux"}, "c.toml", CARD)
    assert c.workload == "black-forest-labs/FLUX.1-dev" and c.resolution is None and c.batch_size == 1
    assert c.plan == Plan(adapter="lora:r=4,alpha=1,targets=all-linear", max_grad_norm=1.0)
    assert [w.split(": ", 1)[1].split(";")[0] for w in c.warnings] == [
        "the text encoders are trained too (no network_train_unet_only)", "latents are not cached (cache_latents)",
        "text-encoder outputs are not cached (cache_text_encoder_outputs)"]
    flux = {"_class_name": "FluxTransformer2DModel", "attention_head_dim": 16, "num_attention_heads": 2,
            "num_layers": 1, "num_single_layers": 1, "joint_attention_dim": 32, "pooled_projection_dim": 16,
            "axes_dims_rope": [4, 6, 6]}
    hub_cache("acme/flux-tune", None, files={"model_index.json": {"_class_name": "FluxPipeline",
                                                                   "transformer": ["diffusers", flux["_class_name"]]},
                                            "transformer/config.json": flux})
    held = map_config({"pretrained_model_name_or_path": "acme/flux-tune", "network_module": "networks.lora_flux",
                       "cache_latents": True}, "c.toml", CARD)
    assert held.workload == "acme/flux-tune:text_encoders=trained" and held.warnings == ()
    assert c.plan.attention == "auto"  # (FLUX's attention is sd-scripts' SDPA)


@pytest.mark.parametrize("files,workload", [({"ae": "a"}, "dit-flux"), ({"clip_g": "g", "t5xxl": "t"}, "dit-sd3"),
                                            ({"gemma2": "g", "ae": "a"}, "dit-lumina2")])  # (Lumina takes an ae too)
def test_a_checkpoint_files_model_is_named_by_the_files_beside_it(files, workload):
    data = {"pretrained_model_name_or_path": "/m/model.safetensors", "cache_text_encoder_outputs": True, **files}
    assert map_config(data, "c.toml", CARD).workload == workload
    schnell = {**MINIMAL, "pretrained_model_name_or_path": "/m/flux1-schnell.safetensors"}
    assert map_config(schnell, "c.toml", CARD).workload == "dit-flux:guidance_embeds=false"


@pytest.mark.parametrize("n,last", [(1, 2), (8, 18), (18, 39), (35, 54)])
def test_fluxs_blocks_to_swap_is_as_many_bytes_of_memfits_last_blocks(n, last):
    """sd-scripts swaps n // 2 double-stream and (n - n // 2) * 2 single-stream blocks of FLUX: memfit's last
    blocks (the 38 singles first, then doubles) of the nearest bytes, within half a double block, checked on
    FLUX.1-dev's own blocks; past sd-scripts' 17 doubles and 36 singles it is one line."""
    import torch

    from memfit.techniques.swap_blocks import model_blocks
    from memfit.workloads import load_workload
    c = map_config({**MINIMAL, "blocks_to_swap": n}, "c.toml", CARD)
    assert c.plan.swap_blocks == last
    with torch.device("meta"):
        blocks = model_blocks(load_workload("dit-flux").model())
    size = [sum(p.numel() for p in b.parameters()) for b in blocks]
    theirs = sum(size[19 - n // 2:19]) + sum(size[57 - (n - n // 2) * 2:])
    assert abs(sum(size[57 - last:]) - theirs) <= size[0] / 2, (sum(size[57 - last:]), theirs)
    with pytest.raises(UserError, match="blocks_to_swap 36 swaps 18 double and 36 single blocks of FLUX; sd-scripts "
                                        r"swaps at most 17 and 36 \(blocks_to_swap <= 35\)"):
        map_config({**MINIMAL, "blocks_to_swap": 36}, "c.toml", CARD)


def test_a_dataset_config_gives_the_largest_batch_of_pixels(tmp_path):
    (tmp_path / "sets.toml").write_text('[general]\nresolution = 512\nbatch_size = 4\n\n[[datasets]]\n\n'
                                        '[[datasets]]\nresolution = [1216, 832]\nbatch_size = 2\n')
    c = map_config({**MINIMAL, "dataset_config": "sets.toml", "train_batch_size": 8}, "c.toml", CARD, base=tmp_path)
    assert (c.batch_size, c.resolution) == (2, (1216, 832))  # (2 x 1216 x 832 pixels over 4 x 512 x 512)
    assert c.warnings[0].endswith("has 2 datasets of different sizes; memfit estimates the largest batch of pixels "
                                  "(2 at 1216x832 px)")
    c = map_config({**MINIMAL, "dataset_config": "gone.toml", "resolution": 768}, "c.toml", CARD, base=tmp_path)
    assert (c.batch_size, c.resolution) == (1, 768) and "dataset_config gone.toml not found" in c.warnings[0]


def test_unmapped_arguments_are_named_one_a_line():
    c = map_config({**MINIMAL, "network_train_unet_only": True, "t5xxl_max_token_length": 256, "lr_warmup": 9},
                   "c.toml", CARD)
    assert [w.split(": ", 1)[1] for w in c.warnings] == ["lr_warmup is not mapped; the estimate ignores it"]
    assert c.workload == "dit-flux:t5_tokens=256"  # (FLUX.1's T5 tokens a caption)
    masked = map_config({**MINIMAL, "network_train_unet_only": True, "apply_t5_attn_mask": True}, "c.toml", CARD)
    assert masked.workload == "dit-flux:t5_mask=true" and masked.warnings == ()  # (its attention masked)
    assert map_config({**MINIMAL, "split_mode": True}, "c.toml", CARD).plan.swap_blocks == 39  # (sd-scripts: 18)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_every_refused_argument_names_itself(key):
    with pytest.raises(UserError, match=f"c.toml: {key}: "):
        map_config({**MINIMAL, key: "something"}, "c.toml", CARD)


@pytest.mark.parametrize("change,error", [
    ({"network_module": "lycoris.kohya"}, "--adapter lycoris:algo=lokr,dim=...: its modules over LyCORIS's own"),
    ({"optimizer_type": "Lion"}, "optimizer_type 'Lion' is not one memfit runs; use AdamW, AdamW8bit"),
    ({"fp8_base": True}, "fp8_base without a network_module trains nothing"),
    ({"mixed_precision": "fp8"}, "mixed_precision 'fp8': use no, fp16 or bf16"),
    ({"resolution": "1024,"}, "resolution must be a size in pixels or width,height (1024, or 1216,832), got '1024,'"),
    ({"train_batch_size": 0}, "train_batch_size must be a whole number >= 1, got 0"),
    ({"pretrained_model_name_or_path": ""}, "no pretrained_model_name_or_path; the config names the model it trains"),
])
def test_bad_arguments_are_one_line(change, error):
    with pytest.raises(UserError) as e:
        map_config({**MINIMAL, **change}, "c.toml", CARD)
    assert str(e.value).startswith("--from c.toml: ") and error in str(e.value) and "\n" not in str(e.value)


def test_a_file_that_is_not_toml_or_not_a_config(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("network_dim = = 4\n")
    with pytest.raises(UserError, match=r"bad.toml: not valid TOML \("):
        read_training_config(bad, CARD)
    with pytest.raises(UserError, match=r"give an axolotl, ai-toolkit, LLaMA-Factory or torchtune config \(.yml, .yaml\), a "
                                         r"kohya-ss sd-scripts config \(.toml\) or a SimpleTuner config \(.json, .toml, .env\)"):
        read_training_config(tmp_path / "config.ini", CARD)
    with pytest.raises(UserError, match=r"config.json: no such file; give a SimpleTuner config.json"):
        read_training_config(tmp_path / "config.json", CARD)
    with pytest.raises(UserError, match=r"give a workload or --from .*, not both"):
        read_training_config(Path(__file__).resolve().parents[1] / "data" / "axolotl" / "lora-llama.yml", CARD, "gpt2")


def test_what_sd_scripts_ignores_or_turns_on_and_values_of_the_wrong_kind():
    """SD/SDXL take no blocks_to_swap; offloaded checkpointing without checkpointing does nothing in a LoRA
    script and turns checkpointing on in full fine-tuning; split_mode yields to a blocks_to_swap given, 0
    too; lora_fa (A frozen) is not memfit's LoRA; values of the wrong kind are one line."""
    sd = {"pretrained_model_name_or_path": "/m/sdxl.safetensors", "sdpa": True}
    c = map_config({**sd, "blocks_to_swap": 3}, "c.toml", CARD, "unet-sdxl")
    assert c.plan.swap_blocks == 0 and "blocks_to_swap: sd-scripts' SD and SDXL scripts take none" in c.warnings[0]
    c = map_config({**MINIMAL, "network_module": "networks.lora_flux", "cpu_offload_checkpointing": True}, "c.toml", CARD)
    assert c.plan.offload == () and any("does nothing in sd-scripts' LoRA" in w for w in c.warnings)
    c = map_config({**MINIMAL, "cpu_offload_checkpointing": True}, "c.toml", CARD)
    assert (c.plan.checkpointing, c.plan.offload) == ("blocks", ("activations",))
    assert map_config({**MINIMAL, "split_mode": True, "blocks_to_swap": 0}, "c.toml", CARD).plan.swap_blocks == 0
    for bad, error in (({"network_module": "networks.lora_fa"}, "network_module 'networks.lora_fa' is not one"),
                       ({"max_grad_norm": "abc"}, "max_grad_norm must be a number >= 0"),
                       ({"dataset_config": 5}, "dataset_config must be a path to a dataset config")):
        with pytest.raises(UserError, match=error):
            map_config({**MINIMAL, **bad}, "c.toml", CARD)


def test_resolution_max_grows_the_height_at_the_configs_width():
    """``--from`` a config of 1216x832 buckets with ``--resolution max``: the width stays the config's (a
    ``width=`` override beside the workload's own), the height is what max grows."""
    import argparse

    from memfit.cli.common import apply_config
    args = argparse.Namespace(from_config=str(DATA / "sdxl-lora.toml"), device="rtx4090", workload="unet-sdxl:layers_per_block=1",
                              batch_size=None, seq_len=None, resolution="max")
    apply_config(args)
    assert args.workload == "unet-sdxl:layers_per_block=1,width=1216" and args.resolution == "max"
    args = argparse.Namespace(from_config=str(DATA / "sdxl-lora.toml"), device="rtx4090", workload="unet-sdxl",
                              batch_size=None, seq_len=None, resolution=None)
    apply_config(args)
    assert (args.workload, args.resolution) == ("unet-sdxl", "1216x832")


def test_text_encoders_the_config_trains_or_runs_are_in_the_workload_and_said_elsewhere():
    """A LoRA without network_train_unet_only trains the text encoders; without cached outputs they run frozen:
    the SD/SDXL, FLUX.1, SD3 and Lumina 2 built-ins hold them (memfit.workloads.text_encoders), beside the workload's own
    overrides; FLUX.1's and SD3's T5-XXL stays cached where the config caches (sd-scripts' partial cache: the
    CLIPs train), and Lumina 2's Gemma-2 trains as sd-scripts' train_gemma2."""
    sd = {"pretrained_model_name_or_path": "/m/sd_xl_base_1.0.safetensors", "network_module": "networks.lora",
          "cache_latents": True}
    trained = map_config(sd, "c.toml", CARD, "unet-sdxl:layers_per_block=1")
    assert trained.workload == "unet-sdxl:layers_per_block=1,text_encoders=trained" and trained.warnings == ()
    frozen = map_config({**sd, "network_train_unet_only": True}, "c.toml", CARD, "unet-sdxl")
    assert frozen.workload == "unet-sdxl:text_encoders=frozen" and frozen.warnings == ()
    cached = map_config({**sd, "network_train_unet_only": True, "cache_text_encoder_outputs": True}, "c.toml", CARD,
                        "unet-sd15")
    assert cached.workload == "unet-sd15"
    lora = {**MINIMAL, "network_module": "networks.lora_flux"}
    flux = map_config({**lora, "cache_text_encoder_outputs": False}, "c.toml", CARD)
    assert flux.workload == "dit-flux:text_encoders=trained" and flux.warnings == ()
    partial = map_config(lora, "c.toml", CARD)
    assert partial.workload == "dit-flux:text_encoders=trained,t5=cached" and partial.warnings == ()
    unet_only = map_config({**lora, "network_train_unet_only": True, "cache_text_encoder_outputs": False}, "c.toml",
                           CARD)
    assert unet_only.workload == "dit-flux:text_encoders=frozen"
    fp8_unet = map_config({**lora, "cache_text_encoder_outputs": False, "fp8_base_unet": True,
                           "network_args": ["train_t5xxl=True"]}, "c.toml", CARD)
    assert [w.split(": ", 1)[1][:40] for w in fp8_unet.warnings] == [
        "train_t5xxl: memfit trains the CLIP enco", "fp8_base_unet keeps the text encoders in"]  # (said once)
    other = map_config({**lora, "cache_text_encoder_outputs": False}, "c.toml", CARD, "dit-flux2")
    assert other.workload == "dit-flux2" and "the text encoders are trained too" in other.warnings[0]
    full = map_config({**MINIMAL, "cache_text_encoder_outputs": False, "train_text_encoder": True}, "c.toml", CARD)
    assert full.workload == "dit-flux:text_encoders=frozen"  # (flux_train trains no text encoder)
    sd3_full = {"pretrained_model_name_or_path": "/m/sd3.5_medium.safetensors", "clip_l": "l", "clip_g": "g",
                "t5xxl": "t", "cache_latents": True, "use_t5xxl_cache_only": True}
    assert map_config(sd3_full, "c.toml", CARD).workload == "dit-sd3:text_encoders=frozen,t5=cached"
    assert map_config({**sd3_full, "train_text_encoder": True}, "c.toml", CARD).workload == \
        "dit-sd3:text_encoders=trained,t5=cached"
    sd3 = {"pretrained_model_name_or_path": "/m/sd3.5_medium.safetensors", "clip_l": "l", "clip_g": "g",
           "t5xxl": "t", "network_module": "networks.lora_sd3", "cache_latents": True, "t5xxl_max_token_length": 154}
    assert map_config(sd3, "c.toml", CARD).workload == "dit-sd3:text_encoders=trained,t5_tokens=154"
    assert map_config({**sd3, "cache_text_encoder_outputs": True}, "c.toml", CARD).workload == \
        "dit-sd3:text_encoders=trained,t5=cached,t5_tokens=154"
    lumina = {"pretrained_model_name_or_path": "/m/lumina.safetensors", "gemma2": "g", "ae": "a",
              "network_module": "networks.lora_lumina", "cache_latents": True}
    assert map_config(lumina, "c.toml", CARD).workload == "dit-lumina2:text_encoders=trained"
    assert map_config({**lumina, "network_train_unet_only": True}, "c.toml", CARD).workload == \
        "dit-lumina2:text_encoders=frozen"


@pytest.mark.parametrize("args,only", [
    (["train_blocks=all"], None),
    (["train_blocks=single"], [f"transformer.single_transformer_blocks.{i}." for i in range(38)]),
    (["train_blocks=double", "train_double_block_indices=0-2,7"],
     [f"transformer.transformer_blocks.{i}." for i in (0, 1, 2, 7)]),
    (["train_double_block_indices=none", "train_single_block_indices=10"], ["transformer.single_transformer_blocks.10."]),
])
def test_fluxs_block_selection_is_the_adapters_only(args, only):
    """sd-scripts' ``train_blocks`` and ``train_double_block_indices``/``train_single_block_indices`` (networks.lora_flux)
    choose the blocks its LoRA adapts: memfit's ``only=`` those blocks, named as diffusers writes them, and the text
    encoders (whose trained CLIP-L keeps its LoRA); every block is no ``only=``. Not said: it is mapped."""
    c = map_config({**MINIMAL, "network_module": "networks.lora_flux", "network_args": args}, "c.toml", CARD)
    want = "lora:r=4,alpha=1,targets=all-linear" + ("" if only is None else ",only=" + "+".join([*only, "text_encoders."]))
    assert c.plan.adapter == want and not any("network_args" in w for w in c.warnings)


def test_a_flux_block_selection_adapts_those_blocks_alone():
    """On a tiny FLUX with its CLIP-L trained, ``train_blocks=single`` leaves the double-stream blocks and the layers
    outside the blocks without LoRA, as sd-scripts does, and keeps CLIP-L's."""
    from memfit.step import build_step
    tiny = ("dit-flux:num_layers=1,num_single_layers=2,attention_head_dim=16,num_attention_heads=2,joint_attention_dim=32,"
            "pooled_projection_dim=16,in_channels=16,axes_dims_rope=4/6/6,text_encoders=trained,text_layers=1,t5=cached")
    c = map_config({**MINIMAL, "network_module": "networks.lora_flux", "network_args": ["train_blocks=single"]},
                   "c.toml", CARD)
    from memfit.target import Target
    model = build_step(Target.resolve(tiny, Plan(adapter=c.plan.adapter), 1, "cpu", resolution=64)).model
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted and all(n.startswith(("denoiser.single_transformer_blocks.", "text_encoders.0.")) for n in adapted)
    assert any(n.startswith("text_encoders.0.") for n in adapted)
    assert {f"denoiser.single_transformer_blocks.{i}.proj_out" for i in (0, 1)} <= adapted


@pytest.mark.parametrize("args,error", [
    (["train_blocks=some"], "network_args train_blocks=some is not all, single or double"),
    (["train_single_block_indices=40"], "train_single_block_indices=40 is not all, none, or indices and ranges below 38"),
    (["train_blocks=double", "train_double_block_indices=none"], "network_args select no FLUX.1 block"),
    (["conv_dim"], "network_args must be a list of \"key=value\" strings, got 'conv_dim'"),
])
def test_bad_block_selections_are_one_line(args, error):
    with pytest.raises(UserError, match=error):
        map_config({**MINIMAL, "network_module": "networks.lora_flux", "network_args": args}, "c.toml", CARD)
