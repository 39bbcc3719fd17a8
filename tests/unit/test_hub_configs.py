"""The twelve popular configs of issue 55, read as a new user would (``memfit estimate ORG/NAME
--device rtx4090 -b 1 --seq-len 512`` with a Hugging Face cache holding each config.json only,
offline): each gives a number or is refused in one line that is true. The default run shrinks
every model to one layer (the same code paths, seconds); the slow run estimates them at full size
and checks the mixtures of experts' parameter counts against their model cards."""

import json
from pathlib import Path

import pytest

from memfit.cli.main import main
from memfit.memory.estimate import estimate
from memfit.plans import Plan

CONFIGS = json.loads((Path(__file__).parents[1] / "data" / "hub_configs.json").read_text())
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers")
REFUSED = {
    "openai/whisper-large-v3": "hub model openai/whisper-large-v3: --seq-len 512 exceeds config.json's "
                               "max_target_positions=448 (the decoder's labels); use --seq-len <= 448",
    "google/vit-huge-patch14-224-in21k": "hub model google/vit-huge-patch14-224-in21k: config.json's architectures "
                                         "names ViTModel, a head memfit cannot feed a synthetic batch to",
}
CARDS = {"mistralai/Mixtral-8x7B-v0.1": ("46.70 B", "12.88 B", "top-2 of 8 experts in 32 layers"),
         "Qwen/Qwen1.5-MoE-A2.7B": ("14.32 B", "2.69 B", "top-4 of 60 experts in 24 layers")}


def one_layer(config: dict) -> dict:
    return {k: (1 if k in LAYER_FIELDS else v) for k, v in config.items()}


@pytest.fixture
def cache(hub_cache):
    def fill(shrink: bool):
        for repo_id, config in CONFIGS.items():
            hub_cache(repo_id, one_layer(config) if shrink else config)
    return fill


def test_the_twelve_estimate_or_are_refused_in_one_true_line(cache, capsys):
    cache(shrink=True)
    assert len(CONFIGS) == 12
    for repo_id in CONFIGS:
        code = main(["estimate", repo_id, "--device", "rtx4090", "-b", "1", "--seq-len", "512", "--json"])
        out, err = capsys.readouterr()
        if repo_id in REFUSED:
            assert code == 2 and err.strip().count("\n") == 0 and REFUSED[repo_id] in err, (repo_id, err)
        else:
            assert code == 0 and json.loads(out)["peak_bytes"] > 0, (repo_id, err)
    whisper = estimate("openai/whisper-large-v3", Plan(), batch_size=1, device="rtx4090", seq_len=448)
    assert whisper.method == "fake" and whisper.peak_bytes > 0


@pytest.mark.slow
def test_the_twelve_at_full_size(cache, capsys):
    cache(shrink=False)
    for repo_id in CONFIGS:
        code = main(["estimate", repo_id, "--device", "rtx4090", "-b", "1", "--seq-len", "512", "--json"])
        out, err = capsys.readouterr()
        assert code == (2 if repo_id in REFUSED else 0), (repo_id, err)
        if repo_id in CARDS:
            total, active, shape = CARDS[repo_id]
            assert json.loads(out)["facts"][0] == (f"mixture of experts: {total} parameters, {active} active per "
                                                   f"token ({shape})")
