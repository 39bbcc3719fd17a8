"""timm checkpoints by hub id (NOTE [ timm repositories ]): built from the registered name in their
config.json, fed images at the pretrained input size (or --resolution) and one class each, and run for
real within 1% of the prediction; what cannot be built is one line."""

import pytest

from memfit.cli.main import main
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads import load_workload

VIT = {"architecture": "vit_tiny_patch16_224", "num_classes": 10, "global_pool": "token",
       "pretrained_cfg": {"input_size": [3, 224, 224], "fixed_input_size": True, "num_classes": 1000}}
RESNET = {"architecture": "resnet18", "num_classes": 7, "pretrained_cfg": {"input_size": [3, 160, 160]}}


def test_a_timm_checkpoint_is_built_from_its_registered_name_at_its_input_size(hub_cache, no_network):
    hub_cache("timm/resnet18.toy", RESNET)
    wl = load_workload("timm/resnet18.toy")
    images, labels = wl.batch(2)
    assert tuple(images.shape) == (2, 3, 160, 160) and tuple(labels.shape) == (2,) and int(labels.max()) < 7
    assert wl.model().fc.out_features == 7 and wl.from_checkpoint and wl.info.sample == "a 160x160 image and its class"


@pytest.mark.parametrize("repo,config", [("timm/vit.toy", VIT), ("timm/resnet18.toy", RESNET)], ids=["vit", "resnet"])
def test_a_timm_model_runs_for_real_within_one_percent_at_another_resolution(hub_cache, no_network, repo, config):
    """ViT's position table is fixed: built for --resolution with img_size, as timm's fine-tuning does."""
    hub_cache(repo, config)
    r = profile(repo, Plan(), batch_size=2, resolution=32, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_a_timm_vit_takes_an_image_wider_than_high(hub_cache, no_network):
    """``--resolution 64x32`` (width by height): images [B, 3, 32, 64], a ViT built for them (its fixed
    position table: img_size=(32, 64), 8 patches of 16 px), run for real within 1%."""
    hub_cache("timm/vit.toy", VIT)
    wl = load_workload("timm/vit.toy", resolution=(64, 32))
    assert tuple(wl.batch(2)[0].shape) == (2, 3, 32, 64) and wl.info.sample == "a 64x32 image and its class"
    r = profile("timm/vit.toy", Plan(), batch_size=2, resolution=(64, 32), repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


@pytest.mark.parametrize("args,error", [
    (["estimate", "timm/none.x"], "timm/none.x: timm 1.0"),
    (["estimate", "timm/resnet18.toy", "--seq-len", "64"], "--seq-len does not apply to an image model"),
], ids=["unknown-architecture", "seq-len"])
def test_what_cannot_be_built_is_one_line(hub_cache, no_network, capsys, args, error):
    hub_cache("timm/none.x", {"architecture": "nosuchnet_b0", "num_classes": 2})
    hub_cache("timm/resnet18.toy", RESNET)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and error in err, err
