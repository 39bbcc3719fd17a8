"""``memfit estimate --from config.toml``: a kohya-ss sd-scripts config on the command line. Its plan and
sizes are the estimate's, flags beside it override them, the model a checkpoint file holds is named
beside it, and what cannot be read is one line with exit status 2."""

import json
from pathlib import Path

import pytest

from memfit.plans import Plan
from tests.integration.test_cli_errors import check, run

pytest.importorskip("diffusers")

DATA = Path(__file__).resolve().parents[1] / "data" / "kohya"
FLUX = ("dit-flux:num_layers=1,num_single_layers=2,attention_head_dim=16,num_attention_heads=2,"
        "joint_attention_dim=32,pooled_projection_dim=16,in_channels=16,axes_dims_rope=4/6/6")


def test_a_flux_config_is_estimated_with_its_plan_and_sizes():
    """The config's plan and batch (2, from its dataset config) on a tiny FLUX named beside it; the
    resolution and the swapped blocks given as flags override the config's (a tiny model has 3 blocks)."""
    argv = ["estimate", FLUX, "--from", str(DATA / "flux-lora-12gb.toml"), "--resolution", "192x128",
            "--swap-blocks", "2", "--device", "rtx4090", "--json"]
    rc, out, err = run(argv)
    check(argv, rc, err)
    report = json.loads(out)
    assert rc == 0 and report["workload"] == "dit-flux 192x128px" and report["batch_size"] == 2
    plan = report["plan"]
    assert (plan["base_weights"], plan["precision"], plan["checkpointing"], plan["swap_blocks"], plan["optimizer"]) == (
        "fp8", "bf16-base", "blocks", 2, "adamw8bit")
    assert plan["adapter"] == "lora:r=16,alpha=16,targets=all-linear" and plan["max_grad_norm"] == 1.0
    said = [line for line in err.splitlines() if "kohya config" in line]  # (every argument mapped or silent, but FLUX's
    assert len(said) == 1 and "blocks_to_swap 18 swaps 9 double- and 18 single-stream blocks" in said[0]  # swap)


@pytest.mark.parametrize("argv,message", [
    (["estimate", "--from", str(DATA / "sdxl-lora.toml"), "--device", "rtx4090"],
     "whose model the config does not say; name it beside --from: memfit estimate unet-sdxl --from"),
    (["estimate", "--from", str(DATA / "missing.toml")], "missing.toml: no such file; give a kohya-ss sd-scripts config"),
    (["plan", "--from", "config.ini", "--device", "rtx4090"], "give an axolotl, ai-toolkit, LLaMA-Factory or torchtune config (.yml, .yaml), a"),
])
def test_what_cannot_be_read_is_one_line(argv, message):
    rc, _, err = run(argv)
    check(argv, rc, err)
    assert rc == 2 and message in err, err


@pytest.mark.slow  # (12 s: the suite under 10 minutes; test_kohya_export keeps the arguments and their reading back in the default suite)
def test_a_plan_is_printed_as_sd_scripts_arguments_that_read_back_as_it(tmp_path):
    """``memfit plan ... --format kohya``: the chosen plan as lines of a --config_file TOML; written to a
    file and read back with --from, they are the plan memfit chose, at its batch and resolution. The search
    keeps to what sd-scripts runs: under this budget the whole search ranks 49 plans, 30 of them with every-2
    or selective checkpointing or offloaded activations without checkpointing, which sd-scripts has no
    argument for; here every plan ranked is one it carries."""
    argv = ["plan", FLUX, "--adapter", "lora:r=16,alpha=16,targets=all-linear", "--resolution", "192x128", "-b", "2",
            "--device", "rtx4090", "--budget", "432MiB", "--format", "kohya", "--json"]
    rc, out, err = run(argv)
    check(argv, rc, err)
    result = json.loads(out)
    assert rc == 0 and result["kohya_unmapped"] == [] and result["kohya_arguments"]["resolution"] == "192,128"
    from memfit.integrations.kohya_export import runs_in_sd_scripts
    runs = runs_in_sd_scripts(2, "dit-flux", (192, 128), "rtx4090", None, {"adapter": "x"})
    assert len(result["ranked"]) > 10 and all(runs(Plan.from_dict(c["plan"])) for c in result["ranked"])
    config = tmp_path / "memfit.toml"
    config.write_text('pretrained_model_name_or_path = "/m/flux1-dev.safetensors"\nae = "/m/ae.safetensors"\n'
                      "cache_latents = true\ncache_text_encoder_outputs = true\n"
                      + "\n".join(f"{k} = {json.dumps(v)}" for k, v in result["kohya_arguments"].items()))
    from memfit.devices import get_device
    from memfit.integrations.from_file import read_training_config
    back = read_training_config(config, get_device("rtx4090"), FLUX)
    assert back.plan == Plan.from_dict(result["chosen"]["plan"]) and (back.batch_size, back.resolution) == (2, (192, 128))
