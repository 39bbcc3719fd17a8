"""A plan as an ai-toolkit job (memfit.integrations.ai_toolkit_export): each of ai-toolkit's examples read by
``--from`` and written back is the same workload, sizes and plan; what ai-toolkit has no field for is listed
as plan keys; a model it does not train is one line; on the command line, ``--format ai-toolkit`` searches
only the plans ai-toolkit runs and prints the job."""

import json
from pathlib import Path

import pytest
import yaml

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.ai_toolkit import map_config
from memfit.integrations.ai_toolkit_export import to_ai_toolkit
from memfit.integrations.from_file import read_training_config
from memfit.plans import Plan
from memfit.workloads import load_workload
from tests.integration.test_cli_errors import check, run

DATA = Path(__file__).resolve().parents[1] / "data" / "ai_toolkit"
CARD = get_device("rtx4090")
TINY = ("dit-flux:num_layers=1,num_single_layers=2,attention_head_dim=16,num_attention_heads=2,"
        "joint_attention_dim=32,pooled_projection_dim=16,in_channels=16,axes_dims_rope=4/6/6")
FACTS = ("text_encoders", "t5", "frames", "cross_attention_dim", "control_images", "control_px")


def _job(plan: Plan, batch: int, workload: str, resolution, **facts):
    if "/" in workload:  # (a hub id: its class as the config would say, offline)
        model_class, config = "FluxTransformer2DModel", {"text_encoders": "frozen"}
    else:
        config = load_workload(workload).info.config
        model_class = config.get("model_class")
    return to_ai_toolkit(plan, batch, workload, model_class, resolution, CARD, {k: config.get(k) for k in FACTS} | facts)


@pytest.mark.parametrize("name", sorted(p.stem for p in DATA.glob("*.yaml")))
def test_each_example_written_back_reads_as_the_same_run(name):
    """The LoRA examples (Z-Image Turbo's with Prodigy) and the full fine-tuning of Flex.1 (a hub id, no network:
    bf16-pure)."""
    given = read_training_config(DATA / f"{name}.yaml", CARD)
    job = _job(given.plan, given.batch_size, given.workload, given.resolution)
    assert job.unmapped == ()
    again = map_config(yaml.safe_load(job.yaml()), "job.yaml", CARD)
    assert (again.workload, again.plan, again.batch_size, again.resolution) == \
        (given.workload, given.plan, given.batch_size, given.resolution)


def test_what_ai_toolkit_has_no_field_for_is_listed_as_plan_keys():
    plan = Plan(adapter="lora:r=16,targets=all-linear", precision="bf16-pure", swap_blocks=19, checkpointing="blocks",
                offload=["optimizer_states"], ema={"decay": 0.99, "device": "cpu"}, micro_batch_size=1)
    job = _job(plan, 4, "dit-flux:text_encoders=trained,t5=cached", (1216, 832))
    keys = sorted(u.split(":", 1)[0] for u in job.unmapped)
    assert keys == ["ema", "offload", "precision", "swap_blocks", "t5"], job.unmapped
    train = job.process["train"]
    assert (train["batch_size"], train["gradient_accumulation"], train["train_text_encoder"]) == (1, 4, True)
    assert job.process["datasets"][0]["resolution"] == [992]  # (ai-toolkit buckets by area: 1216 x 832 under 992^2)
    autocast = _job(Plan(adapter="lora:r=4,targets=all-linear", precision="bf16"), 1, "dit-flux", 1024)
    assert [u.split(" (", 1)[0] for u in autocast.unmapped] == ["precision: bf16"]


@pytest.mark.parametrize("workload,arch,name", [
    ("unet-sdxl:text_encoders=frozen", "sdxl", "stabilityai/stable-diffusion-xl-base-1.0"),
    ("unet-sd15", "sd1", "runwayml/stable-diffusion-v1-5"),
    ("dit-wan:frames=33", "wan21", "Wan-AI/Wan2.1-T2V-14B-Diffusers"),
    (TINY, "flux", "black-forest-labs/FLUX.1-dev"),  # (another size of a built-in: said in a note)
    ("dit-hidream:text_encoders=frozen,force_inference_output=false", "hidream", "HiDream-ai/HiDream-I1-Full"),
    ("dit-hidream", "hidream", "HiDream-ai/HiDream-I1-Full"),  # (diffusers' inference path: ai-toolkit's differs, said)
])
def test_built_ins_are_the_hub_ids_ai_toolkit_loads(workload, arch, name):
    job = _job(Plan(adapter="lora:r=4,targets=all-linear", precision="bf16-base-noautocast"), 1, workload, 512)
    assert (job.process["model"]["arch"], job.process["model"]["name_or_path"]) == (arch, name)
    assert ("num_frames" in job.process["datasets"][0]) == ("wan" in workload)
    assert any("are not its own" in n for n in job.notes) == (workload == TINY)
    assert any("routed experts' training path" in n for n in job.notes) == (workload == "dit-hidream")


@pytest.mark.parametrize("options,fields", [
    ("experts=2,low_vram=True", (True, True, 1)),
    ("experts=2,switch=step", (False, True, 20)),  # (every 10 steps of 2 micro-batches: a whole number of steps)
    ("experts=2,switch=none", (False, False, 1)),
])
def test_wan22s_two_experts_are_ai_toolkits_wan22_arch(options, fields):
    """``dit-wan:experts=2`` is ai-toolkit's Wan 2.2 A14B (its bf16 copy), with its low_vram, the experts it trains
    and how often it switches; read back, the job is the same workload."""
    job = _job(Plan(adapter="lora:r=4,targets=in-blocks", precision="bf16-base-noautocast", micro_batch_size=1), 2,
               f"dit-wan:frames=1,{options}", 512)
    model = job.process["model"]
    assert (model["arch"], model["name_or_path"]) == ("wan22_14b", "ai-toolkit/Wan2.2-T2V-A14B-Diffusers-bf16")
    assert (model["low_vram"], model["model_kwargs"]["train_low_noise"], job.process["train"]["switch_boundary_every"]) \
        == fields
    back = map_config(yaml.safe_load(job.yaml()), "job.yaml", CARD).workload
    assert back == "dit-wan:frames=1," + options.replace("2,low", "2,switch=batch,low")


def test_kontexts_reference_image_is_ai_toolkits_flux_kontext_with_pairs():
    """``dit-flux:control_images=1`` is ai-toolkit's FLUX.1 Kontext with a paired dataset (``control_path``); read back,
    the same workload."""
    job = _job(Plan(adapter="lora:r=4,targets=in-blocks", precision="bf16-base-noautocast"), 1,
               "dit-flux:control_images=1", 512)
    assert (job.process["model"]["arch"], job.process["model"]["name_or_path"]) == \
        ("flux_kontext", "black-forest-labs/FLUX.1-Kontext-dev")
    assert job.process["datasets"][0]["control_path"]
    assert map_config(yaml.safe_load(job.yaml()), "job.yaml", CARD).workload == "dit-flux:control_images=1"


def test_a_model_ai_toolkit_does_not_train_is_one_line():
    with pytest.raises(UserError, match="memfit writes ai-toolkit jobs for FLUX.1, .* not llama") as e:
        to_ai_toolkit(Plan(), 1, "llama", None, None, CARD, {})
    assert "\n" not in str(e.value)


ARGV = ["plan", TINY, "--adapter", "lora:r=8,targets=all-linear", "--resolution", "256", "--device", "rtx4090",
        "-b", "4", "--budget", "430MiB", "--json"]
"""A tiny FLUX at a budget whose fastest plan keeps the LoRA in bf16 and offloads activations (neither of them
ai-toolkit's)."""


@pytest.mark.slow  # (25 s: the search without --format, for the test below)
def test_without_the_format_the_search_takes_what_ai_toolkit_does_not_run():
    free = json.loads(run(ARGV)[1])["chosen"]["plan"]
    assert (free["precision"], free["offload"]) == ("bf16-pure", ["activations"])


def test_on_the_command_line_the_search_keeps_to_what_ai_toolkit_runs():
    """With ``--format ai-toolkit`` the chosen plan is one ai-toolkit runs (the fastest one is not: the test
    above), written as its job; a model ai-toolkit does not train is one line, before a search."""
    argv = ARGV + ["--format", "ai-toolkit"]
    rc, out, err = run(argv)
    check(argv, rc, err)
    report = json.loads(out)
    assert rc == 0 and report["ai_toolkit_unmapped"] == [] and report["chosen"]["plan"]["offload"] == []
    process = report["ai_toolkit_process"]
    assert process["network"] == {"type": "lora", "linear": 8, "linear_alpha": 16, "transformer_only": False}
    assert process["train"]["batch_size"] * process["train"].get("gradient_accumulation", 1) == 4
    argv = ["plan", "gpt2:n_layer=2", "--format", "ai-toolkit", "--device", "rtx4090"]
    rc, _, err = run(argv)
    check(argv, rc, err)
    assert rc == 2 and "memfit writes ai-toolkit jobs for" in err


def test_swapped_blocks_are_layer_offloading_of_their_share_and_read_back():
    """10 of Wan 2.1 1.3B's 30 blocks swapped: ai-toolkit's layer_offloading of a third of the transformer's linear
    layers (the text encoder's share none), read back by ``--from`` as the same 10 blocks. FLUX.1's are not carried:
    ai-toolkit offloads no FLUX.1 layers."""
    plan = Plan(adapter="lora:r=16,alpha=16,targets=all-linear", base_weights="fp8", precision="bf16-base-noautocast",
                checkpointing="blocks", swap_blocks=10, max_grad_norm=1.0)
    job = _job(plan, 1, "dit-wan-1.3b:frames=1", 480, blocks=30)
    assert job.unmapped == ()
    model = job.process["model"]
    assert (model["layer_offloading"], model["layer_offloading_transformer_percent"],
            model["layer_offloading_text_encoder_percent"]) == (True, 0.3333, 0.0)
    assert job.process["train"]["noise_scheduler"] == "flowmatch" and model["quantize_te"] is True
    again = map_config(yaml.safe_load(job.yaml()), "job.yaml", CARD)
    assert again.plan == plan and any("its last 10 of 30 blocks" in w for w in again.warnings)
    flux = _job(plan.replace(swap_blocks=19), 1, "dit-flux", 1024, blocks=57)
    assert [u.split(" (")[0] for u in flux.unmapped] == ["swap_blocks: 19"]
    adafactor = _job(Plan(adapter="lora:r=4,targets=all-linear", precision="bf16-base-noautocast", optimizer="adafactor"), 1,
                     "dit-flux", 1024)
    assert "max_grad_norm" not in adafactor.process["train"] and not any("clips" in n for n in adafactor.notes)


@pytest.mark.parametrize("targets,blocks_only", [("in-blocks", True), ("all-linear", False)])
def test_a_loras_targets_are_ai_toolkits_transformer_only_and_read_back(targets, blocks_only):
    """``targets=in-blocks`` is ai-toolkit's ``transformer_only: true`` (its default for a DiT), ``all-linear`` its
    ``false``; read back, each is the same LoRA."""
    plan = Plan(adapter=f"lora:r=16,alpha=16,targets={targets}", precision="bf16-base-noautocast", checkpointing="blocks")
    job = _job(plan, 1, TINY, 256)
    assert job.unmapped == () and job.process["network"]["transformer_only"] is blocks_only
    back = map_config(yaml.safe_load(job.yaml()), "job.yaml", CARD, TINY)
    assert back.plan.adapter == plan.adapter


def test_a_unets_lora_on_its_blocks_alone_is_not_carried():
    """ai-toolkit's ``transformer_only`` leaves a UNet's LoRA on every linear layer: ``in-blocks`` there is listed."""
    job = _job(Plan(adapter="lora:r=4,targets=in-blocks", precision="bf16-base-noautocast"), 1, "unet-sd15", 512)
    assert any(u.startswith("adapter: lora:r=4,targets=in-blocks") for u in job.unmapped), job.unmapped
    assert "transformer_only" not in job.process["network"]


@pytest.mark.parametrize("adapter", ["lokr:r=full,targets=in-blocks,factored=1",
                                     "lokr:r=16,alpha=16,targets=all-linear,skip=single_transformer_blocks,factor=8,"
                                     "factored=1"])
def test_a_factored_lokr_is_ai_toolkits_lokr_and_read_back(adapter):
    """ai-toolkit's ``type: lokr`` (``lokr_full_rank``, ``lokr_factor``) is the factored LoKr over its LoRA's layers;
    PEFT's LoKr (not factored) and kohya, which runs LyCORIS's, are listed."""
    plan = Plan(adapter=adapter, precision="bf16-base-noautocast", checkpointing="blocks")
    job = _job(plan, 1, TINY, 256)
    assert job.unmapped == () and job.process["network"]["type"] == "lokr"
    assert job.process["network"]["lokr_full_rank"] is ("r=full" in adapter)
    back = map_config(yaml.safe_load(job.yaml()), "job.yaml", CARD, TINY)
    assert back.plan.adapter == plan.adapter
    peft = _job(plan.replace(adapter=adapter.replace(",factored=1", "")), 1, TINY, 256)
    assert any(u.startswith("adapter: lokr:") for u in peft.unmapped) and peft.process.get("network", {}).get(
        "type") != "lokr"
