"""A plan as kohya-ss sd-scripts arguments (memfit.integrations.kohya_export): read back by
memfit.integrations.kohya it is the same plan, and what sd-scripts has no argument for is listed."""

import pytest

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.kohya import flux_swap, map_config
from memfit.integrations.kohya_export import runs_in_sd_scripts, to_kohya
from memfit.plans import Plan

CARD = get_device("rtx4090")
FILES = {"dit-flux": {"ae": "a"}, "unet-sdxl": {}, "dit-sd3": {"clip_g": "g"}}
CACHED = {"cache_latents": True, "cache_text_encoder_outputs": True}


@pytest.mark.parametrize("model,plan,batch", [
    ("dit-flux", Plan(adapter="lora:r=16,alpha=16,targets=all-linear", base_weights="fp8", precision="bf16-base",
                      checkpointing="blocks", swap_blocks=39, optimizer="adamw8bit", max_grad_norm=1.0), 2),
    ("dit-flux", Plan(adapter="lora:r=32,alpha=32,targets=all-linear", precision="bf16-pure", checkpointing="blocks",
                      offload=["activations"], optimizer="adamw8bit-paged", micro_batch_size=1), 4),
    ("unet-sdxl", Plan(adapter="lora:r=8,alpha=4,targets=all-linear", precision="fp16-base", checkpointing="blocks",
                       optimizer="adamw", max_grad_norm=1.0), 3),
    ("dit-sd3", Plan(precision="bf16-pure", checkpointing="blocks", optimizer="adafactor",
                     optimizer_in_backward=True), 1),
    ("dit-flux", Plan(adapter="lora:r=16,alpha=16,targets=all-linear", precision="bf16-base", checkpointing="blocks",
                      optimizer="adamw8bit"), 1),
], ids=["flux-swap", "flux-offload", "sdxl-fp16", "sd3-full-fused", "flux-bf16-base"])
def test_the_arguments_read_back_are_the_plan(model, plan, batch):
    out = to_kohya(plan, batch, model, (1216, 832))
    assert out.unmapped == (), out.unmapped
    data = {"pretrained_model_name_or_path": f"/m/{model}.safetensors", **FILES[model], **CACHED, **out.arguments}
    back = map_config(data, "c.toml", CARD, None if FILES[model] else model)
    assert (back.plan, back.batch_size, back.resolution) == (plan, batch, (1216, 832))


def test_what_sd_scripts_cannot_carry_is_listed():
    plan = Plan(adapter="dora:r=16", base_weights="nf4", precision="bf16", checkpointing="selective",
                offload=["optimizer_states"], compile="blocks", optimizer="adamw8bit-ao", swap_blocks=0)
    out = to_kohya(plan, 1, "dit-flux")
    assert {u.split(":")[0] for u in out.unmapped} == {
        "adapter", "base_weights", "checkpointing", "offload", "optimizer", "compile"}
    assert "network_module" not in out.arguments and out.arguments["mixed_precision"] == "bf16"
    autocast = to_kohya(Plan(adapter="lora:r=4,targets=all-linear", precision="bf16"), 1, "dit-flux")
    assert any(n.startswith("mixed_precision bf16: sd-scripts' LoRA script casts the frozen base") for n in autocast.notes)
    assert not any("casts the frozen base" in n for n in to_kohya(
        Plan(adapter="lora:r=4,targets=all-linear", precision="bf16-base"), 1, "dit-flux").notes)
    assert to_kohya(Plan(adapter="lora:r=4"), 1, "dit-flux").unmapped == ("adapter: lora:r=4",)
    assert to_kohya(Plan(world_size=2), 2, "dit-flux").unmapped[0].startswith("shard: ")  # (no FSDP in sd-scripts)


def test_fluxs_swapped_blocks_are_sd_scripts_count_of_at_least_the_plans_bytes():
    """memfit's last M blocks as the smallest blocks_to_swap whose blocks weigh as much; one it does not hit
    exactly is said (sd-scripts swaps a little more: less device memory); beyond sd-scripts' 35 it is not
    carried."""
    for m in (2, 18, 39, 54):
        n = to_kohya(Plan(adapter="lora:r=4,targets=all-linear", swap_blocks=m), 1, "dit-flux").arguments["blocks_to_swap"]
        assert flux_swap(n) == m
    out = to_kohya(Plan(adapter="lora:r=4,targets=all-linear", swap_blocks=3), 1, "dit-flux")
    assert out.arguments["blocks_to_swap"] == 2 and out.unmapped == ()
    assert any(n.startswith("swap_blocks: 3 is written as blocks_to_swap 2") for n in out.notes)
    out = to_kohya(Plan(adapter="lora:r=4,targets=all-linear", swap_blocks=57), 1, "dit-flux")
    assert "blocks_to_swap" not in out.arguments and out.unmapped[0].startswith("swap_blocks: 57 (more than")
    assert to_kohya(Plan(adapter="lora:r=4,targets=all-linear", swap_blocks=7), 1, "dit-sd3").arguments["blocks_to_swap"] == 7


def test_only_the_models_sd_scripts_trains_and_only_what_it_runs_for_each():
    """By the diffusers class: a model sd-scripts has no trainer for is one line; SD/SDXL swap no blocks;
    offloaded inputs need checkpointed blocks; a LoRA's dropout (PEFT drops the input, sd-scripts the rank-r
    output) and FLUX's math attention are listed; chunked attention is written as SDPA, its nearest."""
    for model, cls in (("dit-wan", "WanTransformer3DModel"), ("dit-flux2", "Flux2Transformer2DModel"), ("gpt2", None)):
        with pytest.raises(UserError, match="--format kohya: sd-scripts trains FLUX.1, SD3, Lumina 2 and SD/SDXL UNets"):
            to_kohya(Plan(), 1, model, model_class=cls)
    assert to_kohya(Plan(), 1, "/my/model", model_class="FluxTransformer2DModel").arguments["sdpa"]
    out = to_kohya(Plan(adapter="lora:r=4,targets=all-linear", swap_blocks=3), 1, "unet-sdxl")
    assert "blocks_to_swap" not in out.arguments and out.unmapped[0].startswith("swap_blocks: 3 (sd-scripts' SD and SDXL")
    out = to_kohya(Plan(offload=["activations"]), 1, "dit-flux")
    assert "cpu_offload_checkpointing" not in out.arguments and out.unmapped[0].startswith("offload: [activations]")
    assert to_kohya(Plan(adapter="lora:r=4,targets=all-linear,dropout=0.1"), 1, "dit-flux").unmapped
    assert to_kohya(Plan(attention="math"), 1, "dit-flux").unmapped == ("attention: math (sd-scripts runs SDPA for "
                                                                         "FLUX, SD3 and Lumina)",)
    out = to_kohya(Plan(attention="chunked"), 1, "unet-sdxl")
    assert out.arguments["sdpa"] and out.unmapped[0].startswith("attention: chunked")


def test_the_search_for_sd_scripts_keeps_the_plans_its_arguments_carry():
    """``plan --format kohya`` searches only what sd-scripts runs: every-N or selective checkpointing, compiled
    blocks, the optimizer's states on the host and a low-bit torchao optimizer are left out; the user's own
    fields are theirs (an adapter of named targets stays, and is listed); FLUX's swapped blocks are carried
    as a count that swaps a little more; a model sd-scripts does not train is refused before a search."""
    fixed = {"adapter": "lora:r=4,targets=to_q+to_k"}
    runs = runs_in_sd_scripts(2, "dit-flux", (1216, 832), "rtx4090", None, fixed)
    base = Plan(**fixed, precision="bf16-base")
    assert runs(base) and runs(base.replace(checkpointing="blocks", swap_blocks=38, optimizer="adamw8bit"))
    for change in (dict(checkpointing="blocks:every=2"), dict(checkpointing="selective"), dict(compile="blocks"),
                   dict(offload=["optimizer_states"]), dict(optimizer="adamw8bit-ao"), dict(loss_chunks=4)):
        assert not runs(base.replace(**change)), change
    with pytest.raises(UserError, match="sd-scripts trains FLUX.1, SD3, Lumina 2 and SD/SDXL UNets, not llama"):
        runs_in_sd_scripts(2, "llama")


def test_a_workload_whose_text_encoders_train_writes_a_lora_of_them_too():
    """``unet-sdxl:text_encoders=trained``: no network_train_unet_only (sd-scripts then trains the text encoders'
    LoRA), and read back it is the same workload; frozen ones are run, not cached."""
    plan = Plan(adapter="lora:r=8,alpha=8,targets=all-linear", precision="fp16-base", checkpointing="blocks")
    out = to_kohya(plan, 2, "unet-sdxl", 1024, "rtx4090", text_encoders="trained")
    assert "network_train_unet_only" not in out.arguments and out.notes[0].startswith("cache_latents (or")
    back = map_config({"pretrained_model_name_or_path": "/m/sdxl.safetensors", "cache_latents": True, **out.arguments},
                      "c.toml", CARD, "unet-sdxl")
    assert back.workload == "unet-sdxl:text_encoders=trained" and back.plan == plan
    frozen = to_kohya(plan, 2, "unet-sdxl", 1024, "rtx4090", text_encoders="frozen")
    assert frozen.arguments["network_train_unet_only"] is True and frozen.notes[0].startswith("cache_latents (or")


def test_fluxs_trained_clip_over_cached_t5_states_and_its_caption_length_read_back_as_the_same_workload():
    """``dit-flux:text_encoders=trained,t5=cached,t5_tokens=256``: the note asks for sd-scripts' cache (T5's
    states cached, CLIP-L trained in the step), ``t5xxl_max_token_length`` is written, and read back with that
    cache it is the same workload and plan."""
    plan = Plan(adapter="lora:r=16,alpha=16,targets=all-linear", precision="bf16-base", base_weights="fp8",
                checkpointing="blocks")
    out = to_kohya(plan, 1, "dit-flux", 1024, "rtx4090", text_encoders="trained", t5="cached", t5_tokens=256,
                   t5_mask=True)
    assert out.arguments["t5xxl_max_token_length"] == 256 and "network_train_unet_only" not in out.arguments
    assert out.arguments["apply_t5_attn_mask"] is True
    assert out.notes[0].startswith("cache_latents and cache_text_encoder_outputs = true")
    back = map_config({"pretrained_model_name_or_path": "/m/flux1-dev.safetensors", "ae": "/m/ae.safetensors",
                       "cache_latents": True, "cache_text_encoder_outputs": True, **out.arguments}, "c.toml", CARD)
    assert back.workload == "dit-flux:text_encoders=trained,t5=cached,t5_mask=true,t5_tokens=256" and back.plan == plan
    assert back.warnings == ()
