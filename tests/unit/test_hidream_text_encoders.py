"""HiDream-I1's four text encoders in the step (``dit-hidream:text_encoders=frozen``, memfit.workloads.hidream_text),
as ai-toolkit's ``hidream`` trainer holds them: the DiT fed what the pipeline's encoding gives, the same loss and
gradients as the cached step fed those states; measured as predicted; the encoders at their released sizes; bad
values in one line."""

import pytest
import torch

from memfit.errors import UserError
from memfit.memory.measure import profile
from memfit.memory.routing import BALANCED, ForcedRouting
from memfit.plans import Plan
from memfit.step import build_step
from memfit.target import Target
from memfit.workloads import load_workload
from memfit.workloads.hidream_text import hidream_configs

pytest.importorskip("diffusers")

TINY = ("dit-hidream:num_layers=1,num_single_layers=1,num_attention_heads=2,attention_head_dim=32,"
        "caption_channels=64/64,text_emb_dim=32,llama_layers=0/1,axes_dims_rope=8/12/12,caption_tokens=8")
HELD = TINY + ",text_encoders=frozen,text_layers=1"


def test_the_dit_takes_what_the_pipeline_encodes_with_the_cached_steps_loss_and_gradients():
    """The step with the encoders runs them under ``no_grad`` and feeds the DiT T5's last states, Llama's layers'
    states stacked layer first (``hidden_states[1:]``) and the CLIPs' projected pooled outputs side by side: its loss
    and every gradient equal the cached step's, fed those states as its batch. No encoder weight trains, and an
    adapter over every linear layer takes none of theirs."""
    torch.manual_seed(0)
    step = build_step(Target.resolve(HELD, Plan(adapter="lora:r=4,targets=all-linear"), 2, "cpu", resolution=128))
    model = step.model
    assert not any(p.requires_grad for p in model.text_encoders.parameters())
    assert not any("lora" in n for n, _ in model.text_encoders.named_parameters())
    batch = Target.resolve(HELD, Plan(), 2, "cpu", resolution=128).workload.batch(2)
    assert [tuple(i.shape) for i in batch["ids"]] == [(2, 8)] * 4 and "t5" not in batch
    model.train()
    with torch.no_grad():
        t5, llama, pooled = model.encode(batch["ids"])
        clip_l = model.text_encoders[0](batch["ids"][0]).text_embeds
        own = model.text_encoders[3](batch["ids"][3], output_hidden_states=True).hidden_states
    assert tuple(t5.shape) == (2, 8, 64) and tuple(llama.shape) == (2, 2, 8, 64) and tuple(pooled.shape) == (2, 32)
    assert torch.equal(pooled[:, :clip_l.shape[-1]], clip_l) and torch.equal(llama[1], own[2])
    from memfit.workloads.hidream import _loss
    held = _loss(model, batch)
    held.backward()
    grads = {n: p.grad.clone() for n, p in model.denoiser.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    cached = {k: batch[k] for k in ("x", "t", "target")}
    cached.update(t5=t5, llama=llama.transpose(0, 1), pooled=pooled)
    plain = _loss(model.denoiser, cached)
    plain.backward()
    assert grads and torch.equal(held, plain)
    assert all(torch.equal(grads[n], p.grad) for n, p in model.denoiser.named_parameters() if p.grad is not None)


@pytest.mark.parametrize("path", [pytest.param("inference", marks=pytest.mark.slow), "training"])  # (ai-toolkit's)
def test_the_step_with_the_encoders_is_measured_as_predicted(path):
    """The four encoders' weights and their encoding's transients beside the DiT: a real run (routed as the trace
    assumes) measures the prediction, on diffusers' inference path and ai-toolkit's training path; the encoders add
    their weights to the cached step's peak, and not to the mixture of experts' parameters the report gives."""
    spec = HELD + (",force_inference_output=false" if path == "training" else "")
    plan = Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="blocks")
    with ForcedRouting(BALANCED):
        held = profile(spec, plan, batch_size=2, resolution=128, repeats=0)
        cached = profile(spec.replace(",text_encoders=frozen,text_layers=1", ""), plan, batch_size=2, resolution=128,
                         repeats=0)
    assert held.predicted.method == "fake" and abs(held.error_percent) < 0.01, held.error_percent
    with torch.device("meta"):
        weights = build_step(Target.resolve(spec, plan, 2, "cpu", resolution=128)).model.text_encoders
    size = sum(p.numel() * p.element_size() for p in weights.parameters())
    assert held.peak_bytes >= cached.peak_bytes + 0.9 * size

    def experts(r):
        return next(f for f in r.predicted.facts if f.startswith("mixture of experts"))
    assert experts(held) == experts(cached)  # (the denoiser's parameters, not the encoders' beside them)


def test_the_encoders_at_their_released_sizes():
    """CLIP-L and CLIP-G with projections (SD3's and SDXL's sizes, with HiDream's 248 positions), T5-XXL's encoder
    (4.76B, FLUX.1's) and Llama-3.1-8B as ``LlamaForCausalLM`` (8.03B: its output layer included)."""
    from memfit.workloads.text_encoders import _encoder
    configs = hidream_configs(2048, 4096, 4096, 32, None)
    with torch.device("meta"):
        sizes = [sum(p.numel() for p in _encoder(c, i < 2).parameters()) for i, c in enumerate(configs)]
    positions = (248 - 77) * 768, (248 - 77) * 1280
    assert sizes == [123_650_304 + positions[0], 694_659_840 + positions[1], 4_762_310_656, 8_030_261_248]


def test_bad_values_are_one_line():
    with pytest.raises(UserError, match="text_encoders=trained: memfit trains none of HiDream's four text encoders"):
        load_workload(TINY + ",text_encoders=trained", resolution=128)
    with pytest.raises(UserError, match="caption_tokens=300 exceeds the 248 positions of HiDream's CLIP encoders"):
        load_workload("dit-hidream:text_encoders=frozen,caption_tokens=300")
    assert load_workload("dit-hidream:caption_tokens=300").info.config["caption_tokens"] == 300  # (cached: any)


def test_a_pipelines_hub_id_takes_ai_toolkits_path_and_its_own_clip_and_t5_configs(hub_cache, no_network):
    """A HiDream pipeline's hub id with ai-toolkit's overrides (the experts' training path, which no released
    config.json names, and the encoders in the step): built with the pipeline's own CLIP and T5 configs where it holds
    them (their positions read, not assumed), Llama-3.1 from its widths (it is not in the pipeline's repository)."""
    dit = {"_class_name": "HiDreamImageTransformer2DModel", "patch_size": 2, "in_channels": 16, "out_channels": 16,
           "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 32, "num_attention_heads": 2,
           "caption_channels": [64, 64], "text_emb_dim": 32, "num_routed_experts": 4, "num_activated_experts": 2,
           "axes_dims_rope": [8, 12, 12], "max_resolution": [128, 128], "llama_layers": [0, 1]}
    built = hidream_configs(32, 64, 64, 2, 1)
    clips = [{**c.to_dict(), "max_position_embeddings": 200, "model_type": "clip_text_model",
              "architectures": ["CLIPTextModelWithProjection"]} for c in built[:2]]
    t5 = {**built[2].to_dict(), "model_type": "t5", "architectures": ["T5EncoderModel"]}
    index = {"_class_name": "HiDreamImagePipeline", "transformer": ["diffusers", dit["_class_name"]],
             **{f"text_encoder{s}": ["transformers", "X"] for s in ("", "_2", "_3")}}
    files = {"model_index.json": index, "transformer/config.json": dit, "text_encoder/config.json": clips[0],
             "text_encoder_2/config.json": clips[1], "text_encoder_3/config.json": t5}
    hub_cache("HiDream-ai/toy-hidream", None, files=files)
    spec = "HiDream-ai/toy-hidream:caption_tokens=8,text_encoders=frozen,text_layers=1,force_inference_output=false"
    wl = load_workload(spec, resolution=128)
    assert wl.info.config["force_inference_output"] is False
    with torch.device("meta"):
        model = wl.model()
    assert [e.config.max_position_embeddings for e in model.text_encoders[:2]] == [200, 200]
    assert type(model.text_encoders[3]).__name__ == "LlamaForCausalLM"
