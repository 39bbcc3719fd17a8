"""HiDream-I1 (``dit-hidream``, memfit.workloads.hidream): its mixture-of-experts DiT traced on fake tensors, the
router's choice answered with balanced routing (NOTE [ Routing on fake tensors ]): a real run routed so measures the
prediction, on the inference path diffusers' LoRA script loads (``force_inference_output``) and the model's own
training path; at the released size; from a pipeline's hub id; bad values in one line."""

import contextlib

import pytest
import torch

from memfit.errors import UserError
from memfit.memory.measure import profile
from memfit.memory.routing import BALANCED, WORST, ForcedRouting
from memfit.plans import Plan
from memfit.workloads import load_workload

TINY = ("dit-hidream:num_layers=1,num_single_layers=1,num_attention_heads=2,attention_head_dim=32,"
        "caption_channels=64/64,text_emb_dim=32,llama_layers=0/1,axes_dims_rope=8/12/12,caption_tokens=8")
CASES = [("inference", "bf16-pure", "blocks"), ("inference", "fp32", "none"), ("training", "fp32", "none"),
         ("training", "bf16-pure", "blocks")]
SLOW = {("training", "bf16-pure", "blocks")}  # (the suite under 10 minutes: each path keeps an fp32 case)


def _measured(spec: str, plan: Plan, routing: str | None):
    with ForcedRouting(routing) if routing else contextlib.nullcontext():
        return profile(spec, plan, batch_size=2, resolution=128, repeats=0)


@pytest.mark.parametrize("path,precision,ckpt", [pytest.param(*c, marks=pytest.mark.slow) if c in SLOW else c
                                                 for c in CASES], ids=["-".join(c) for c in CASES])
def test_a_run_routed_as_assumed_measures_the_prediction(path, precision, ckpt):
    """Balanced routing's prediction is what a real run routed so measures (within 0.01%); the worst routing's
    bound is at least what a run routed the worst way measures. Before, the trace failed at the router's choice
    (``bincount`` of the inference path, the training path's boolean masks) and fell back to a real run here."""
    spec = TINY + (",force_inference_output=false" if path == "training" else "")
    plan = Plan.from_dict({"precision": precision, "checkpointing": ckpt,
                           **({"adapter": "lora:r=4"} if precision != "fp32" else {})})
    balanced = _measured(spec, plan, BALANCED)
    assert balanced.predicted.method == "fake" and abs(balanced.error_percent) < 0.01, balanced.error_percent
    assert any("MoEGate" in a and "assumed balanced" in a for a in balanced.predicted.approximations)
    worst = _measured(spec, plan, WORST)
    assert worst.predicted.worst_routing_peak_bytes >= worst.peak_bytes * 0.9999


def test_the_inference_path_keeps_no_activations_of_the_routed_experts():
    """``force_inference_output`` (diffusers' script) runs the routed experts under ``no_grad``: the model's own
    training path keeps their activations, about twice a dense feed-forward's, so it peaks higher."""
    inference = load_workload(TINY, resolution=128)
    training = load_workload(TINY + ",force_inference_output=false", resolution=128)
    assert inference.info.config["force_inference_output"] is True
    assert training.info.config["force_inference_output"] is False
    from memfit.memory.estimate import estimate
    low, high = (estimate(wl, Plan(), batch_size=2).peak_bytes for wl in (inference, training))
    assert high > 1.3 * low, (low, high)


def test_released_size_and_batch():
    """HiDream-I1's 17.1B parameters (its 16 double- and 32 single-stream blocks, 4 routed experts and a shared one
    each); at 1024 px, 4,096 image tokens; T5's states and Llama-3.1's 32 layers' states, 128 tokens each; the LoRA of
    diffusers' script: the image stream's ``to_q``, ``to_k``, ``to_v`` and ``to_out`` of each block, none of the text
    stream's (``to_q_t``...)."""
    wl = load_workload("dit-hidream")
    with torch.device("meta"):
        model = wl.model()
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - 17.11e9) / 17.11e9 < 0.01, total
    with torch.device("meta"):
        batch = wl.batch(2)
    assert batch["x"].shape == (2, 16, 128, 128) and batch["t5"].shape == (2, 128, 4096)
    assert batch["llama"].shape == (2, 32, 128, 4096) and batch["pooled"].shape == (2, 2048)
    import peft

    from memfit.techniques.adapter import _default_targets
    targets = _default_targets(model, peft)
    assert targets == ["to_k", "to_q", "to_v", "to_out"]


def test_an_adapter_takes_the_image_streams_attention():
    from memfit.step import build_step
    step = build_step(load_workload(TINY, resolution=128), Plan.from_dict({"adapter": "lora:r=4"}))
    adapted = sorted(n.removesuffix(".lora_A") for n, _ in step.model.named_modules() if n.endswith("lora_A"))
    assert len(adapted) == 2 * 4 and not any(n.endswith("_t") for n in adapted), adapted


def test_a_pipelines_hub_id_builds_hidream_as_the_script_loads_it(hub_cache, no_network):
    """A HiDream pipeline's hub id (its transformer/config.json): built as ``dit-hidream``, with
    ``force_inference_output`` as diffusers' LoRA script passes it, and traced on fake tensors."""
    dit = {"_class_name": "HiDreamImageTransformer2DModel", "patch_size": 2, "in_channels": 16, "out_channels": 16,
           "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
           "caption_channels": [64, 64], "text_emb_dim": 32, "num_routed_experts": 4, "num_activated_experts": 2,
           "axes_dims_rope": [8, 12, 12], "max_resolution": [128, 128], "llama_layers": [0, 1]}
    files = {"model_index.json": {"_class_name": "HiDreamImagePipeline", "transformer": ["diffusers", dit["_class_name"]]},
             "transformer/config.json": dit}
    hub_cache("HiDream-ai/toy-hidream", None, files=files)
    wl = load_workload("HiDream-ai/toy-hidream:caption_tokens=8", resolution=128)
    assert wl.info.config["force_inference_output"] is True
    r = profile("HiDream-ai/toy-hidream:caption_tokens=8", Plan(), batch_size=1, resolution=128, repeats=0)
    assert r.predicted.method == "fake"


def test_bad_values_are_one_line():
    with pytest.raises(UserError, match="text_encoders=sometimes is not one of cached, frozen, trained"):
        load_workload("dit-hidream:text_encoders=sometimes")
    with pytest.raises(UserError, match="more tokens than a non-square image may"):
        load_workload("dit-hidream:width=1536", resolution=1024)
    with pytest.raises(UserError, match="caption_tokens=0 must be a positive whole number"):
        load_workload("dit-hidream:caption_tokens=0")


def test_numpy_of_a_fake_tensor_reads_its_twin_or_fails_the_trace():
    """HiDream's experts count their tokens on the host (``bincount().cpu().numpy()``): a fake tensor with a twin
    gives the twin's values; one without fails the trace, naming it, where torch's own ``numpy`` read whatever was at
    the fake storage's address (HiDream's first trace ran every token through expert 0 so, silently)."""
    from memfit.errors import is_trace_error
    from memfit.fake_mode import fake_mode
    from memfit.memory.tracker import MemoryTracker
    with fake_mode(), MemoryTracker(assume_scalars=True):
        counts = (torch.arange(8) % 4).bincount()
        assert counts.numpy().tolist() == [2, 2, 2, 2]
        with pytest.raises(RuntimeError, match="numpy\\(\\) of a FakeTensor whose values a fake trace does not know") as e:
            torch.randn(8).numpy()
        assert is_trace_error(e.value)


TWO = TINY.replace("num_layers=1,num_single_layers=1", "num_layers=2,num_single_layers=2").replace(
    "llama_layers=0/1", "llama_layers=0/1/1/1")


def test_selective_checkpointing_saves_nothing_from_under_no_grad():
    """NOTE [ Nothing saved from under no_grad ] (memfit.techniques.checkpointing): HiDream's routed experts scale
    their outputs in place under ``no_grad``; selective checkpointing saved them, and torch's SAC refused the
    recomputation ("Tensor cached during selective activation checkpoint has been mutated", an internal error of
    every plan with it). Now the step runs, as predicted."""
    r = _measured(TWO, Plan.from_dict({"checkpointing": "selective"}), BALANCED)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 0.01, r.error_percent


def test_a_compiled_step_the_trace_cannot_follow_is_one_line():
    """Compiled, HiDream's experts read their token counts on the host (data-dependent for Dynamo): one line that
    says so and how to plan, not "change the overrides" nor an internal error."""
    with pytest.raises(UserError, match=r"failed in torch.compile .*plan it without compile \(--compile none\)"):
        from memfit.memory.estimate import estimate
        estimate(load_workload(TWO, resolution=128), Plan.from_dict({"compile": "blocks"}), batch_size=1)
