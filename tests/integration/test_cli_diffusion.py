"""--resolution on the command line: one line naming the problem and the fix, exit status 2;
and a tiny image model estimated at a resolution the report names.

The contract is test_cli_errors.py's (status 0 or 2, on 2 exactly one ``memfit <command>: error:``
line); these cases need no trace, except the last two, which trace a tiny Lumina2 on fake tensors.
"""

import json

import pytest

from memfit.workloads.builtin import IMAGE_BUILDERS
from tests.integration.test_cli_errors import check, run

pytest.importorskip("diffusers")

LUMINA = ("dit-lumina2:num_layers=1,num_refiner_layers=1,hidden_size=64,num_attention_heads=4,num_kv_heads=2,"
          "cap_feat_dim=32,axes_dim_rope=8/4/4,multiple_of=16")
WORKLOAD_FILE = "import torch\nfrom memfit import Workload\n" \
                "OK = Workload(model=lambda: torch.nn.Linear(4, 2), batch=lambda n: torch.randn(n, 4), " \
                "loss=lambda m, b: m(b).sum())\n"

CASES = [
    (["estimate", "dit-lumina2", "--resolution", "1000"],
     "dit-lumina2: --resolution 1000 is not a multiple of 16 (the VAE's factor 8 x patch size 2); use --resolution "
     "992 or 1008"),
    (["profile", "dit-lumina2", "--resolution", "8"], "use --resolution 16\n"),
    (["estimate", "unet-sdxl", "--resolution", "1000"],
     "unet-sdxl: --resolution 1000 is not a multiple of 32 (the VAE's factor 8 x the UNet's downsampling 4)"),
    (["plan", "unet-sd15", "--resolution", "480", "--budget", "8GiB"], "is not a multiple of 64"),
    (["estimate", "gpt2", "--resolution", "512"],
     f"gpt2: --resolution applies to the image- and video-generation built-ins ({', '.join(IMAGE_BUILDERS)}); drop it"),
    (["train", "cnn", "--resolution", "64", "--steps", "1"], "cnn: --resolution applies to the image- and video-generation"),
    (["estimate", "{d}/wl.py:OK", "--resolution", "512"], "--resolution applies to built-in workloads, model folders and hub ids only"),
    (["estimate", "dit-lumina2", "--resolution", "0"], "--resolution"),
    (["estimate", "dit-lumina2", "--resolution", "big"], "--resolution"),
    (["estimate", "dit-lumina2", "--seq-len", "256"],
     "dit-lumina2: --seq-len does not apply to an image model; give --resolution PIXELS instead"),
    (["estimate", "dit-sd3", "--resolution", "4096"], "exceeds the position table (pos_embed_max_size=192, 3072px)"),
    # --resolution WIDTHxHEIGHT (NOTE [ A resolution's width ])
    (["estimate", "dit-flux", "--resolution", "1216x"],
     "--resolution 1216x: give PIXELS (a square, e.g. 1024) or WIDTHxHEIGHT (e.g. 1216x832)"),
    (["estimate", "dit-flux", "--resolution", "1216x0"], "--resolution's height"),
    (["estimate", "dit-flux:width=1024", "--resolution", "1216x832"],
     "dit-flux: width=1024 and --resolution 1216x832 give two widths; give one"),
    (["estimate", "dit-flux", "--resolution", "1000x832"], "dit-flux: --resolution 1000x832's width 1000 is not a multiple of 16"),
    (["estimate", "gpt2", "--resolution", "512x512"], "gpt2: --resolution applies to the image- and video-generation"),
    (["estimate", "dit-lumina2:no_such=1"], "dit-lumina2: Lumina2Transformer2DModel has no field 'no_such'"),
    (["estimate", "dit-lumina2:num_layers=abc"], "dit-lumina2: num_layers must be an int"),
    (["estimate", "unet-sdxl:block_out_channels=a/b"],
     "unet-sdxl: block_out_channels takes values separated by '/', like its default"),
    (["estimate", "dit-lumina2:hidden_size=100,num_layers=1"],  # (sizes the kernels refuse: the overrides', at once)
     "dit-lumina2:hidden_size=100,num_layers=1: loss(model, batch) failed at aten.mul.Tensor in module Attention ("),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-diffusion")
    (d / "wl.py").write_text(WORKLOAD_FILE)
    return d


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_resolution_is_one_line(folder, argv, message):
    argv = [a.replace("{d}", str(folder)) for a in argv]
    rc, _, err = run(argv)
    check(argv, rc, err)
    assert rc == 2 and message in err, err


def test_resolution_sizes_the_estimate():
    """Twice the resolution, four times the image tokens (64 -> 256, beside 256 caption tokens): the
    activations grow with the joint sequence (320 -> 512). ``--resolution 192x128`` (width by height; kohya's
    ``192,128`` too) is 12 x 8 patches where 128 px square has 8 x 8. The report names the size."""
    acts = {}
    for res, name in (("128", "128px"), ("256", "256px"), ("192x128", "192x128px"), ("192,128", "192x128px")):
        argv = ["estimate", LUMINA, "--resolution", res, "-b", "1", "--json"]
        rc, out, err = run(argv)
        check(argv, rc, err)
        report = json.loads(out)
        assert report["workload"] == f"dit-lumina2 {name}"
        acts[res] = report["breakdown"]["activations"]
    assert acts["256"] > 1.4 * acts["128"] and acts["192x128"] > 1.1 * acts["128"]
    assert acts["192,128"] == acts["192x128"]
