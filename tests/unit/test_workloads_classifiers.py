"""Text classifiers from a config.json: sequence classification (BERT's, and a decoder's as a reward
model: one score a sequence) and token classification (NER) get tokens and their labels, and run for
real within 1% of their prediction."""

import json

import pytest

from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads import load_workload

BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 128}
SENTIMENT = {**BERT, "architectures": ["BertForSequenceClassification"], "id2label": {"0": "neg", "1": "neu", "2": "pos"}}
NER = {**BERT, "architectures": ["BertForTokenClassification"], "id2label": {str(i): f"L{i}" for i in range(9)}}
REWARD = {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"], "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "vocab_size": 300, "max_position_embeddings": 128, "num_labels": 1}  # (no pad_token_id, as Llama's)


def folder(tmp_path, config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("config,labels,dtype", [(SENTIMENT, (2,), "int64"), (NER, (2, 16), "int64"),
                                                 (REWARD, (2,), "float32")], ids=["sentiment", "ner", "reward"])
def test_a_classifier_gets_tokens_and_a_label_a_sequence_or_a_token(tmp_path, config, labels, dtype):
    wl = load_workload(folder(tmp_path, config), seq_len=16)
    batch = wl.batch(2)
    assert tuple(batch["input_ids"].shape) == (2, 16) and tuple(batch["labels"].shape) == labels
    assert str(batch["labels"].dtype) == f"torch.{dtype}" and wl.info.config["model_class"] == config["architectures"][0]
    if config is not REWARD:
        assert int(batch["labels"].max()) < len(config["id2label"])


@pytest.mark.parametrize("config", [SENTIMENT, NER, REWARD], ids=["sentiment", "ner", "reward"])
def test_a_classifier_runs_for_real_within_one_percent(tmp_path, config):
    """A decoder's sequence classifier without a pad token refuses a batch of more than one sequence;
    memfit gives it one, as trainers do (TRL's RewardTrainer)."""
    r = profile(folder(tmp_path, config), Plan(), batch_size=2, seq_len=16, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


# -- image-text pairs ----------------------------------------------------------------------------

_TOWERS = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}
CLIP = {"model_type": "clip", "architectures": ["CLIPModel"], "projection_dim": 16,
        "text_config": {**_TOWERS, "vocab_size": 300, "max_position_embeddings": 20},
        "vision_config": {**_TOWERS, "image_size": 32, "patch_size": 8}}
SIGLIP = {**CLIP, "model_type": "siglip", "architectures": ["SiglipModel"]}


@pytest.mark.parametrize("config", [CLIP, SIGLIP], ids=["clip", "siglip"])
def test_an_image_text_model_trains_on_pairs_with_its_own_loss_within_one_percent(tmp_path, config):
    """CLIPModel and SiglipModel were refused ("a head memfit cannot feed"): they train on image-text pairs
    with their contrastive loss (``return_loss=True``)."""
    path = folder(tmp_path, config)
    shapes = {k: tuple(v.shape) for k, v in load_workload(path).batch(2).items()}
    assert shapes == {"input_ids": (2, 20), "pixel_values": (2, 3, 32, 32)}  # captions at the text encoder's limit
    r = profile(path, Plan(), batch_size=4, seq_len=12, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, r.error_percent


def test_a_contrastive_batch_is_never_split_into_micro_batches(tmp_path):
    """Two micro-batches of a contrastive loss compare each pair with half the batch's others: another
    objective. OOM adaptation turns to checkpointing instead, and the planner searches no micro-batch."""
    from memfit.planner.search import plan
    from memfit.training.adapt import adapt
    wl = load_workload(folder(tmp_path, CLIP), seq_len=12)
    assert "contrastive loss compares each image-text pair" in wl.info.coupled_samples
    model = wl.model()
    assert adapt(Plan(), 8, model)[0].micro_batch_size == 4  # (what an independent-sample step gets)
    adapted, change = adapt(Plan(), 8, model, coupled_samples=wl.info.coupled_samples)
    assert adapted.micro_batch_size is None and adapted.checkpointing == "blocks", change
    result = plan(wl, budget="40GiB", device="h100-80gb", batch_size=8, fixed={"precision": "bf16-pure"},
                  optimizers=("adamw",), compile_modes=("none",), max_traces=8)
    sizes = {c.plan.micro_batch_size for c in result.candidates}
    assert sizes == {None} and any("micro-batches not searched" in n for n in result.notes), (sizes, result.notes)


GEMMA3 = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 4,
          "image_token_index": 299, "boi_token_index": 297, "eoi_token_index": 298,
          "text_config": {"model_type": "gemma3_text", **_TOWERS, "num_key_value_heads": 1, "head_dim": 16,
                          "vocab_size": 300, "max_position_embeddings": 64, "sliding_window": 16},
          "vision_config": {"model_type": "siglip_vision_model", **_TOWERS, "image_size": 32, "patch_size": 8}}


@pytest.mark.parametrize("config,sample", [
    (SENTIMENT, "16 tokens and one label"), (NER, "16 tokens and a label each"),
    (CLIP, "a 32x32 image and its 16-token caption (a matching pair)"),
    (GEMMA3, "a 32x32 image (32x32, 4 image tokens) in 16 tokens"),  # (NOTE [ Image-text batches ])
], ids=["sentiment", "ner", "clip", "gemma3"])
def test_the_estimate_says_what_one_sample_is(tmp_path, config, sample):
    """What the synthetic batch holds is said: a vision-language model's image and its tokens among them."""
    from memfit.memory.estimate import estimate
    r = estimate(folder(tmp_path, config), Plan(), batch_size=1, seq_len=16)
    assert f"one sample: {sample}" in r.facts, r.facts


DEBERTA = {"model_type": "deberta-v2", "architectures": ["DebertaV2ForSequenceClassification"], **_TOWERS,
           "vocab_size": 300, "max_position_embeddings": 64, "id2label": {"0": "a", "1": "b", "2": "c"}}


def test_deberta_keeps_its_labelled_rows_traced_on_fake_tensors_within_one_percent(tmp_path):
    """DeBERTa's loss keeps the labelled rows (``(labels >= 0).nonzero()``): a size fake tensors do not
    know, so the estimate fell back to a real run on this CPU (or refused, for a large model on a GPU
    preset). The labels' real twin gives it (NOTE [ Real values of small integer tensors ])."""
    r = profile(folder(tmp_path, DEBERTA), Plan(), batch_size=4, seq_len=16, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, (r.predicted.method, r.error_percent)


def test_checks_on_the_batchs_values_are_answered_not_assumed(tmp_path):
    """A CTC head compares its labels with the vocabulary, counts and selects them; a causal LM's mask
    code checks its positions for packed sequences. Their real twins answer all of it: no assumption
    about them is left in the report (LayerDrop's random draw is a float: still assumed)."""
    from test_workloads_speech import WAV2VEC2_CTC

    from memfit.memory.estimate import estimate
    ctc = estimate(folder(tmp_path, WAV2VEC2_CTC), Plan(), batch_size=2, seq_len=12).approximations
    assert not any("masked_select" in a or "CTC targets" in a or "modeling_wav2vec2" in a for a in ctc), ctc
    lm = estimate("llama:num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,"
                  "num_key_value_heads=1,vocab_size=100", Plan(), batch_size=1, seq_len=16).approximations
    assert not any("data-dependent" in a for a in lm), lm
