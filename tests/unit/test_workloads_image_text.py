"""Vision-language models from a config.json get an image in each sample, made by their own image
processor, and as many image tokens as their vision tower returns features for (NOTE [ Image-text
batches ]); they run for real within 1% of their prediction. Before, they were fed text alone."""

import json

import pytest
import torch

from memfit.errors import UserError
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads import load_workload

TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 400, "max_position_embeddings": 512}
TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
         "image_size": 56, "patch_size": 14}
QWEN25 = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"], **TEXT,
          "vision_start_token_id": 390, "vision_end_token_id": 391, "image_token_id": 392, "video_token_id": 393,
          "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
          "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                            "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                            "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]}}
LLAVA = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 392,
         "text_config": {"model_type": "llama", **TEXT},
         "vision_config": {"model_type": "clip_vision_model", **TOWER, "projection_dim": 32}}
GEMMA3 = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "image_token_index": 392,
          "boi_token_index": 390, "eoi_token_index": 391, "mm_tokens_per_image": 4,
          "text_config": {"model_type": "gemma3_text", **TEXT, "head_dim": 16, "sliding_window": 64},
          "vision_config": {"model_type": "siglip_vision_model", **TOWER}}
MISTRAL3 = {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10,
            "spatial_merge_size": 2, "text_config": {"model_type": "mistral", **TEXT, "head_dim": 16},
            "vision_config": {"model_type": "pixtral", **TOWER, "image_size": 64, "patch_size": 16, "head_dim": 16}}
MLLAMA = {"model_type": "mllama", "architectures": ["MllamaForConditionalGeneration"], "image_token_index": 392,
          "text_config": {"model_type": "mllama_text_model", **TEXT, "pad_token_id": 0, "cross_attention_layers": [1]},
          "vision_config": {"model_type": "mllama_vision_model", "hidden_size": 32, "intermediate_size": 64,
                            "attention_heads": 2, "num_hidden_layers": 2, "num_global_layers": 1, "image_size": 56,
                            "patch_size": 14, "max_num_tiles": 4, "intermediate_layers_indices": [0],
                            "vision_output_dim": 64}}

SMOLVLM = {"model_type": "smolvlm", "architectures": ["SmolVLMForConditionalGeneration"], "image_token_id": 392,
           "scale_factor": 2, "text_config": {"model_type": "llama", **TEXT},
           "vision_config": {"model_type": "smolvlm_vision", **TOWER, "image_size": 64, "patch_size": 16}}
SMOLVLM_PROCESSOR = {"max_image_size": {"longest_edge": 64}, "size": {"longest_edge": 128}}
"""SmolVLM splits an image into tiles of its tower's size, and a global one (a 128 px image: 4 + 1 tiles of 64 px)."""


def folder(tmp_path, config, preprocessor: dict | None = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if preprocessor is not None:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return str(tmp_path)


# (config, --seq-len, image tokens a sample: Qwen2.5-VL 448x448 = 32x32 patches of 14 px, merged 2x2;
# LLaVA 56 px in 14 px patches, CLS dropped; Gemma 3 its mm_tokens_per_image; Pixtral 64 px in 16 px
# patches, merged 2x2; Llama 3.2 Vision one <|image|> token, its 4 tiles cross-attended)
CASES = [(QWEN25, 320, 256), (LLAVA, 96, 16), (GEMMA3, 96, 4), (MISTRAL3, 96, 4), (MLLAMA, 96, 1)]
IDS = ["qwen2.5-vl", "llava", "gemma3", "mistral3", "mllama"]  # (Llama 3.2 Vision: one token, cross-attended)


@pytest.mark.parametrize("config,seq,tokens", CASES, ids=IDS)
def test_each_sample_holds_an_image_and_exactly_its_image_tokens(tmp_path, config, seq, tokens):
    """Text ids avoid every special id (Pixtral's image token is 10, inside the drawn range), so the
    image tokens are exactly those placed; labels ignore them."""
    wl = load_workload(folder(tmp_path, config), seq_len=seq)
    image_id = config.get("image_token_id", config.get("image_token_index"))
    for _ in range(3):
        batch = wl.batch(2)
        ids = batch["input_ids"]
        assert tuple(ids.shape) == (2, seq) and "pixel_values" in batch
        assert ((ids == image_id).sum(dim=1) == tokens).all()
        assert (batch["labels"][ids == image_id] == -100).all()
    assert f"{tokens} image tokens) in {seq} tokens" in wl.info.sample and not wl.info.text_lm


@pytest.mark.parametrize("config,seq,tokens", CASES, ids=IDS)
def test_an_image_text_step_runs_for_real_within_one_percent(tmp_path, config, seq, tokens):
    r = profile(folder(tmp_path, config), Plan(), batch_size=2, seq_len=seq, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent
    assert not [a for a in r.predicted.approximations if "assumed" in a], r.predicted.approximations


def test_micro_batches_split_each_images_rows_with_its_sample(tmp_path):
    """Qwen2.5-VL's processor concatenates every image's patch rows (``pixel_values``: 256 rows an image at
    224 px), and its grid says whose they are. Split into micro-batches of one sample, each holds its own
    image's rows: the mean of the micro-batches' losses is the batch's and so are the summed gradients
    (rtol 1e-5), and the step accumulating them runs for real within 1% of its prediction. Before, each
    micro-batch held every image's rows and one image's grid, and its forward failed (the planner's plans
    of micro-batches of Qwen2.5-VL-7B were all invalid)."""
    wl = load_workload(folder(tmp_path, QWEN25), seq_len=96, resolution=224)
    torch.manual_seed(0)
    model, batch = wl.model(), wl.batch(2)
    assert batch["pixel_values"].shape[0] == 2 * 256
    whole = wl.loss(model, batch)
    whole.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    parts = wl.split(batch, 2, 2)
    assert [p["pixel_values"].shape[0] for p in parts] == [256, 256] and parts[1]["image_grid_thw"].shape == (1, 3)
    halves = [wl.loss(model, p) / 2 for p in parts]
    for h in halves:
        h.backward()
    assert torch.allclose(sum(h.detach() for h in halves), whole.detach(), rtol=1e-5)
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.allclose(p.grad, grads[n], rtol=1e-5, atol=1e-7), n
    r = profile(folder(tmp_path, QWEN25), Plan(micro_batch_size=1), batch_size=2, seq_len=96, resolution=224, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_resolution_sizes_the_image_and_a_saved_processor_config_wins(tmp_path):
    """Qwen2.5-VL takes any size: 224 px is 16x16 patches, 64 tokens. A folder's preprocessor_config.json
    is the processor users run (here max_pixels caps the image at 112x112: 16 tokens)."""
    assert "(256 patches, 64 image tokens)" in load_workload(folder(tmp_path, QWEN25), seq_len=320,
                                                             resolution=224).info.sample
    (tmp_path / "capped").mkdir()
    capped = folder(tmp_path / "capped", QWEN25, {"max_pixels": 112 * 112, "min_pixels": 56 * 56})
    assert "(64 patches, 16 image tokens)" in load_workload(capped, seq_len=320).info.sample


def test_an_image_wider_than_high_is_its_processors_and_runs_within_one_percent(tmp_path):
    """``--resolution 448x224`` (width by height: NOTE [ A resolution's width ]): Qwen2.5-VL keeps the
    aspect, 32 x 16 patches of 14 px merged 2x2 into 128 tokens, where 224 px square makes 64; the real step
    is within 1% of its prediction."""
    path = folder(tmp_path, QWEN25)
    wl = load_workload(path, seq_len=320, resolution=(448, 224))
    assert wl.info.sample.startswith("a 448x224 image (512 patches, 128 image tokens)")
    r = profile(path, Plan(), batch_size=2, seq_len=320, resolution=(448, 224), repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_the_language_model_keeps_no_cache_under_checkpointing(tmp_path):
    """memfit turned the KV cache off in the top config only; Gemma 3's language model reads its own
    (text_config.use_cache: true in every checkpoint), so each layer filled a cache, and recomputing a
    sliding-window layer under checkpointing attended to 2 x seq - 1 keys: the trace failed at 2,048
    tokens of Gemma 3 4B, and a real run fails the same way."""
    config = {**GEMMA3, "text_config": {**GEMMA3["text_config"], "sliding_window": 16, "use_cache": True}}
    r = profile(folder(tmp_path, config), Plan(checkpointing="blocks"), batch_size=2, seq_len=96, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_resolution_zero_is_text_only_and_an_uncountable_model_says_why(tmp_path, monkeypatch):
    wl = load_workload(folder(tmp_path, LLAVA), seq_len=32, resolution=0)
    assert set(wl.batch(2)) == {"input_ids", "labels"} and wl.info.text_lm and "text only (--resolution 0)" in wl.info.sample
    from memfit.workloads import image_text

    def refused(*args):
        raise image_text.TextOnly("its image processor needs files")
    monkeypatch.setattr(image_text, "one_image", refused)
    wl = load_workload(folder(tmp_path, LLAVA), seq_len=32)
    assert set(wl.batch(2)) == {"input_ids", "labels"} and wl.info.text_lm
    assert "text only: no image, as its image processor needs files, so the vision encoder's" in wl.info.sample


def test_smolvlm_finds_no_padding_tile_in_random_pixels(tmp_path):
    """SmolVLM drops padding tiles by their pixels (``(pixel_values == 0).sum(...) != n``, then an index by
    that mask): random pixels are never 0, which the trace now knows of values drawn from a normal
    distribution, so every tile is kept, as in a real run. Before, the count failed and it was fed text."""
    path = folder(tmp_path, SMOLVLM, SMOLVLM_PROCESSOR)
    wl = load_workload(path, seq_len=200, resolution=128)
    assert "a 128x128 image (5 tiles of 64x64, 20 image tokens) in 200 tokens" == wl.info.sample
    r = profile(path, Plan(), batch_size=2, seq_len=200, resolution=128, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0 and not r.predicted.approximations


@pytest.mark.parametrize("resolution,error", [
    (448, r"a 448x448 image takes 256 tokens, more than --seq-len 200 holds with its text; raise --seq-len or "
          r"lower --resolution"),
    (-1, r"--resolution must be a positive whole number of pixels \(0: text only, for a vision-language model\), "
         r"got -1")])
def test_bad_image_sizes_are_one_line(tmp_path, resolution, error):
    with pytest.raises(UserError, match=error):
        load_workload(folder(tmp_path, QWEN25), seq_len=200, resolution=resolution)


def test_a_config_whose_vision_tower_is_not_as_wide_as_its_language_model_is_its_fault(tmp_path):
    """The model's own check (features and image tokens, its values known to the trace) fails; that is the config's
    fault, said as such, not a fake-tensor trace that needs a real run (it printed a fake tensor in its message)."""
    from memfit.errors import TraceError
    from memfit.memory.faketrace import run_tracked
    from memfit.target import Target
    narrow = {**QWEN25, "vision_config": {**QWEN25["vision_config"], "out_hidden_size": 48}}
    target = Target.resolve(folder(tmp_path, narrow), Plan(), 1, "rtx4090", seq_len=320)
    with pytest.raises(UserError, match=r"loss\(model, batch\) failed with ValueError: Image features and image "
                                        r"tokens do not match.*; fix its config.json") as raised:
        run_tracked(target, fake=True)  # (the trace itself: no real run falls back here, as none would for a 7B)
    assert not isinstance(raised.value, TraceError)


def test_a_hub_vision_language_model_reads_its_preprocessor_config(hub_cache, no_network):
    hub_cache("acme/qwen-vl-toy", QWEN25, files={"preprocessor_config.json": {"max_pixels": 112 * 112}})
    assert "(64 patches, 16 image tokens)" in load_workload("acme/qwen-vl-toy", seq_len=320).info.sample


# -- what the trace needed: NOTE [ Real values of small integer tensors ] --------------------------

def test_value_sized_ops_and_tuples_of_twinned_tensors_are_exact_on_fake_tensors():
    """Qwen2-VL's vision tower reads its grid with ``.tolist()`` (an ``unbind``: a tuple), sizes its
    sequence with ``repeat_interleave`` by the grid, and builds rope deltas with ``torch.tensor`` of 0-dim
    tensors; each failed the fake trace, or read 0."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.memory.tracker import MemoryTracker
    from memfit.workloads.image_text import _ScalarsRead
    with FakeTensorMode(allow_non_fake_inputs=True), MemoryTracker(assume_scalars=True) as tracker, _ScalarsRead():
        grid = torch.tensor([[1, 4, 6], [2, 2, 2]])
        assert grid.tolist() == [[1, 4, 6], [2, 2, 2]]
        lengths = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        assert lengths.shape == (3,) and lengths.tolist() == [24, 4, 4]
        deltas = torch.tensor([lengths.max() - 1, lengths.min()])
        assert deltas.tolist() == [23, 4]
    assert not tracker.approximations


def test_a_list_read_from_a_twin_is_one_read():
    """Qwen2.5-VL's rope index reads each sample's token types with ``.tolist()``: under fake mode one
    scalar read through every mode per element (31,000 of them, half of a shallow trace's time). A tensor
    with a twin is read from it after one scalar read, as a CUDA tensor's ``tolist`` waits once (NOTE [ A
    list read from a twin ]); one without a twin is read as before, element by element."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from memfit.memory.tracker import MemoryTracker

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))
    original, expected = FakeTensor.tolist, [i % 3 == 0 for i in range(2048)]
    with FakeTensorMode(allow_non_fake_inputs=True), MemoryTracker(assume_scalars=True), Reads() as reads:
        types = torch.arange(2048) % 3 == 0
        assert types.tolist() == expected and reads.n == 1
        assert torch.arange(6).reshape(2, 3).tolist() == [[0, 1, 2], [3, 4, 5]] and reads.n == 2
    assert FakeTensor.tolist is original  # (restored on leaving the trace)


@pytest.mark.parametrize("config,seq", [(QWEN25, 320), (GEMMA3, 96)], ids=["qwen2.5-vl", "gemma3"])
def test_a_vision_language_models_loss_chunks_as_a_causal_lms(tmp_path, config, seq):
    """Its head is a plain lm_head and its loss ForCausalLMLoss, as a causal LM's: chunked, the loss and
    every gradient equal the model's own (rtol 1e-5, the tokens summed in another order), and the chunked
    step runs for real within 1% of its prediction. Before, loss_chunks refused every vision-language
    model, and a 152k-vocabulary Qwen2.5-VL kept 1.2 GiB of fp32 logits a sample."""
    import copy

    from memfit.techniques.chunked_loss import chunk_lm_loss
    path = folder(tmp_path, config)
    wl = load_workload(path, seq_len=seq)
    torch.manual_seed(0)
    plain = wl.model()
    chunked = chunk_lm_loss(copy.deepcopy(plain), 4)
    batch = wl.batch(2)
    grads = []
    for model in (plain, chunked):
        model.train()
        loss = model(**batch).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=0)
    assert grads[1][1].keys() == grads[0][1].keys()
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-5, atol=1e-7, msg=name)
    r = profile(path, Plan(loss_chunks=4), batch_size=2, seq_len=seq, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_the_trained_parameters_are_counted_on_a_build_that_reads_values(tmp_path):
    """Gemma 3's SigLIP tower initialises with ``trunc_normal_``, which asks ``mask.any()``: the planner's count of
    trained parameters (a build on fake tensors) answered it as a trace does (it raised: an internal error of
    ``memfit plan google/gemma-3-4b-it --adapter ...``), and counts what the real build trains."""
    from memfit.memory.faketrace import trainable_parameters
    from memfit.step import build_step
    from memfit.target import Target
    target = Target.resolve(folder(tmp_path, GEMMA3), Plan(adapter="lora:r=4"), 2, seq_len=96)
    real = sum(p.numel() for p in build_step(target).model.parameters() if p.requires_grad)
    assert trainable_parameters(target) == real > 0
