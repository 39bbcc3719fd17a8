"""LTX-2 (``dit-ltx2``, memfit.workloads.ltx2): its audio-video step with the text connectors frozen in it, as
SimpleTuner and ltx-trainer run it, or their outputs cached; predicted within 1% of the profiler, at the released
size, from a pipeline's hub id with its own connectors' config, and refusing what it cannot build in one line."""

import pytest
import torch

from memfit.errors import UserError
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads import load_workload

TINY = ("dit-ltx2:num_layers=2,num_attention_heads=2,attention_head_dim=16,cross_attention_dim=32,caption_channels=32,"
        "audio_num_attention_heads=2,audio_attention_head_dim=8,audio_cross_attention_dim=16,in_channels=16,"
        "out_channels=16,audio_in_channels=16,audio_out_channels=16,frames=9,width=128")
CASES = [("frozen", "bf16", "blocks"), ("frozen", "fp32", "none"), ("cached", "bf16", "blocks")]
SLOW = {("frozen", "fp32", "none"), ("cached", "bf16", "blocks")}  # (the suite under 10 minutes: bf16 + blocks with
# the connectors in the step, what its LoRA users run, stays; the hub id's test traces a DiT with its own connectors)


@pytest.mark.parametrize("connectors,precision,ckpt", [pytest.param(*c, marks=pytest.mark.slow) if c in SLOW else c
                                                        for c in CASES], ids=["-".join(c) for c in CASES])
def test_prediction_within_1pct_of_the_profiler(connectors, precision, ckpt):
    plan = Plan.from_dict({"precision": precision, "checkpointing": ckpt, "adapter": "lora:r=4"})
    r = profile(f"{TINY},connectors={connectors}", plan, batch_size=2, resolution=64, repeats=0)
    assert r.predicted.method == "fake"
    assert abs(r.error_percent) <= 1.0, (connectors, precision, ckpt, r.predicted.peak_bytes, r.peak_bytes)


def test_released_size_and_the_batch_of_ltx_trainers_bucket():
    """18.88B in the DiT (LTX-2's "19B"), 1.43B in the connectors; 49 frames at 960 x 544 are 7 x 17 x 30 video
    tokens of 128 channels and 49 audio latents (25 a second) of 8 x 16 packed as 128; each sample's cached Gemma-3
    states are its 49 layers' 3840 features stacked, 1,024 tokens."""
    wl = load_workload("dit-ltx2")
    with torch.device("meta"):
        model = wl.model()
    dit = sum(p.numel() for p in model.denoiser.parameters())
    text = sum(p.numel() for p in model.connectors.parameters())
    assert abs(dit - 18.88e9) / 18.88e9 < 0.01 and abs(text - 1.43e9) / 1.43e9 < 0.01, (dit, text)
    assert not any(p.requires_grad for p in model.connectors.parameters())
    with torch.device("meta"):  # (its shapes: the states alone are 770 MB at batch 2)
        batch = wl.batch(2)
    assert batch["text_states"].dtype == torch.bfloat16  # (as the trainers cache them)
    assert batch["hidden_states"].shape == (2, 7 * 17 * 30, 128) and batch["audio_hidden_states"].shape == (2, 49, 128)
    assert batch["text_states"].shape == (2, 1024, 3840 * 49) and batch["text_mask"].shape == (2, 1024)
    assert wl.info.resolution == 544 and wl.info.config["width"] == 960


def test_an_adapter_takes_the_dits_attention_and_leaves_the_frozen_connectors_alone():
    """The connectors' attention layers are named as the DiT's (``to_q``...): the adapter's default targets take
    the DiT's six attentions of each block, none of the connectors'."""
    from memfit.step import build_step
    wl = load_workload(TINY, resolution=64)
    step = build_step(wl, Plan.from_dict({"adapter": "lora:r=4"}))
    adapted = [n for n, _ in step.model.named_modules() if n.endswith("lora_A")]
    assert adapted and all(".denoiser." in f".{n}" for n in adapted)
    assert len([n for n in adapted if n.endswith("to_q.lora_A")]) == 2 * 6  # (2 blocks x attn1, attn2, audio's
    # two, audio-to-video, video-to-audio)


def test_cached_connectors_feed_the_dit_their_outputs_and_bad_values_are_one_line():
    wl = load_workload(f"{TINY},connectors=cached", resolution=64)
    batch = wl.batch(1)
    assert "text_states" not in batch and batch["encoder_hidden_states"].shape == (1, 1024, 32)
    assert batch["audio_encoder_hidden_states"].shape == (1, 1024, 32)
    with torch.device("meta"):
        assert type(wl.model()).__name__ == "LTX2VideoTransformer3DModel"
    with pytest.raises(UserError, match="connectors='trained'.*connectors=frozen"):
        load_workload("dit-ltx2:connectors=trained")
    with pytest.raises(UserError, match="frames=50 is not 8k \\+ 1"):
        load_workload("dit-ltx2:frames=50")


def test_a_pipelines_hub_id_builds_ltx2_with_its_own_connectors(hub_cache, no_network):
    """An LTX-2.3-style pipeline (no caption projection in the DiT, per-modality projections in the connectors):
    the connectors are built from its connectors/config.json, and the step runs within 1% of its prediction."""
    dit = {"_class_name": "LTX2VideoTransformer3DModel", "num_layers": 1, "num_attention_heads": 2,
           "attention_head_dim": 16, "cross_attention_dim": 32, "caption_channels": 32, "audio_num_attention_heads": 2,
           "audio_attention_head_dim": 8, "audio_cross_attention_dim": 16, "in_channels": 16, "out_channels": 16,
           "audio_in_channels": 16, "audio_out_channels": 16, "use_prompt_embeddings": False, "cross_attn_mod": True,
           "audio_cross_attn_mod": True, "gated_attn": True, "audio_gated_attn": True, "rope_type": "split"}
    connectors = {"_class_name": "LTX2TextConnectors", "caption_channels": 32, "text_proj_in_factor": 5,
                  "video_connector_num_attention_heads": 2, "video_connector_attention_head_dim": 16,
                  "audio_connector_num_attention_heads": 2, "audio_connector_attention_head_dim": 8,
                  "video_connector_num_layers": 3, "per_modality_projections": True, "video_hidden_dim": 32,
                  "audio_hidden_dim": 16, "rope_type": "split"}
    files = {"model_index.json": {"_class_name": "LTX2Pipeline", "transformer": ["diffusers", dit["_class_name"]],
                                  "connectors": ["ltx2", "LTX2TextConnectors"]},
             "transformer/config.json": dit, "connectors/config.json": connectors}
    hub_cache("Lightricks/toy-ltx2", None, files=files)
    wl = load_workload("Lightricks/toy-ltx2:frames=9,width=128", resolution=64)
    assert wl.batch(1)["text_states"].shape == (1, 1024, 32 * 5)
    with torch.device("meta"):
        model = wl.model()
    assert len(model.connectors.video_connector.transformer_blocks) == 3
    assert wl.info.sample.endswith("connectors frozen, its pipeline's")
    r = profile("Lightricks/toy-ltx2:frames=9,width=128", Plan(), batch_size=1, resolution=64, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_an_ltx23_dit_without_its_connectors_config_gets_connectors_that_feed_it_and_says_so(hub_cache, no_network):
    """A cache holding the DiT's config alone (LTX-2.3's: no caption projection) gets LTX-2's connectors with
    per-modality projections to the DiT's two widths, so its step runs; the sample line says whose they are."""
    dit = {"_class_name": "LTX2VideoTransformer3DModel", "num_layers": 1, "num_attention_heads": 2,
           "attention_head_dim": 16, "cross_attention_dim": 32, "caption_channels": 32, "audio_num_attention_heads": 2,
           "audio_attention_head_dim": 8, "audio_cross_attention_dim": 16, "in_channels": 16, "out_channels": 16,
           "audio_in_channels": 16, "audio_out_channels": 16, "use_prompt_embeddings": False, "cross_attn_mod": True}
    files = {"model_index.json": {"_class_name": "LTX2Pipeline", "transformer": ["diffusers", dit["_class_name"]]},
             "transformer/config.json": dit}
    hub_cache("Lightricks/toy-ltx23", None, files=files)
    wl = load_workload("Lightricks/toy-ltx23:frames=9,width=64", resolution=64)
    assert "connectors/config.json is not in the cache" in wl.info.sample
    loss = wl.loss(wl.model(), wl.batch(1))
    assert loss.isfinite()


def test_a_long_built_in_spec_is_not_taken_for_a_path():
    """A built-in with overrides longer than a file name may be (255 bytes) loads; before, ``stat`` of it as a path
    raised ENAMETOOLONG as an internal error."""
    assert len(TINY) > 255
    assert load_workload(TINY, resolution=64).info.config["model_class"] == "LTX2VideoTransformer3DModel"


def test_fp8_base_weights_quantize_the_dit_and_leave_the_connectors_in_bf16():
    """As ltx-trainer's low-VRAM recipe quantizes the transformer it loads, and loads the connectors (its
    embeddings processor) apart: the DiT's linears are stored in 8 bits, the connectors' stay ``nn.Linear``."""
    from memfit.step import build_step
    wl = load_workload(TINY, resolution=64)
    step = build_step(wl, Plan.from_dict({"adapter": "lora:r=4", "base_weights": "fp8", "precision": "bf16-pure"}))
    model = step.model
    plain = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear and "lora_" not in n}
    connectors = {f"connectors.{n}" for n, m in model.connectors.named_modules() if isinstance(m, torch.nn.Linear)}
    assert connectors and plain == connectors
    dit = [m for n, m in model.named_modules() if n.startswith("denoiser.") and n.endswith("attn1.to_q.base_layer")]
    assert dit and all(m.weight.dtype == torch.float8_e4m3fn for m in dit), {m.weight.dtype for m in dit}
