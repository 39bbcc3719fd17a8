"""Local Hugging Face model folders: ``memfit estimate ./dir`` builds the model from config.json only.

The configs are written here, in the shape transformers' own files have (a Llama-3-style file
with ``torch_dtype``, ``rope_theta``, ``rope_scaling: null``), at toy sizes. The folder must give
the same model, batch and prediction as the equivalent built-in, run for real within the usual
1% of its prediction, and never read weights or reach the network.
"""

import json
import socket

import torch

from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads import load_workload

# Llama-3-8B's config.json at toy sizes (same keys, same legacy fields).
LLAMA3 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0",
    "use_cache": True, "vocab_size": 1000,
}
LLAMA3_BUILTIN = ("llama:num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
                  "num_key_value_heads=2,vocab_size=1000,max_position_embeddings=8192,rms_norm_eps=1e-05,"
                  "tie_word_embeddings=false")
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
        "n_positions": 128, "vocab_size": 500}


def folder(tmp_path, config, name="model", text=None):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(text if text is not None else json.dumps(config, indent=2))
    return d


def test_a_folder_predicts_what_the_same_builtin_predicts(tmp_path):
    d = folder(tmp_path, LLAMA3)
    plan = Plan(precision="bf16", checkpointing="blocks")
    from_folder = estimate(str(d), plan, batch_size=2, seq_len=32)
    builtin = estimate(LLAMA3_BUILTIN, plan, batch_size=2, seq_len=32)
    assert from_folder.method == builtin.method == "fake"
    assert from_folder.peak_bytes == builtin.peak_bytes
    assert from_folder.breakdown == builtin.breakdown
    from transformers import LlamaConfig, LlamaForCausalLM  # the parameters, counted independently
    with torch.device("meta"):
        cfg = {k: v for k, v in LLAMA3.items() if k not in ("architectures", "torch_dtype", "transformers_version")}
        n = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**cfg)).parameters())
    assert from_folder.breakdown["parameters"] == n * 4  # fp32 weights: the config's torch_dtype is not used


def test_a_folder_runs_for_real_within_one_percent_of_its_prediction(tmp_path):
    d = folder(tmp_path, GPT2)
    measured = profile(f"hf:{d}", Plan(), batch_size=2, seq_len=64, repeats=0)
    assert measured.predicted_peak_bytes > 0
    assert abs(measured.error_percent) <= 1.0


def test_the_head_follows_architectures_else_the_model_type(tmp_path):
    bert = {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
            "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 64}
    t5 = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "num_layers": 1, "d_model": 32,
          "d_ff": 64, "num_heads": 2, "d_kv": 16, "vocab_size": 100, "decoder_start_token_id": 0, "pad_token_id": 0}
    vit = {"architectures": ["ViTForImageClassification"], "model_type": "vit", "num_hidden_layers": 1,
           "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64, "image_size": 32, "patch_size": 8,
           "id2label": {str(i): str(i) for i in range(5)}}
    deit = {**vit, "model_type": "deit", "architectures": None}  # (two heads for its type: the first, that trains)
    cases = [(bert, "BertForMaskedLM", "masked"), (t5, "T5ForConditionalGeneration", "t5"),
             (vit, "ViTForImageClassification", "vit"), (deit, "DeiTForImageClassification", "deit"),
             ({**GPT2, "architectures": None}, "GPT2LMHeadModel", "gpt")]
    for config, cls, name in cases:
        wl = load_workload(str(folder(tmp_path, config, name)))
        model = wl.model()
        assert type(model).__name__ == cls == wl.info.config["model_class"]
        assert model.config.use_cache is False  # training: no KV cache, as the built-ins
        batch = wl.batch(2)
        loss = wl.loss(model, batch)
        assert loss.ndim == 0 and torch.isfinite(loss)
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (2, 128)  # gpt2: n_positions
    vit_batch = load_workload(str(tmp_path / "vit")).batch(3)
    assert vit_batch["pixel_values"].shape == (3, 3, 32, 32) and int(vit_batch["labels"].max()) < 5
    t5_wl = load_workload(str(tmp_path / "t5"))
    assert t5_wl.info.seq_len == 512  # relative positions: no limit in the config, the t5 built-in's length


def test_the_default_sequence_length_is_the_config_limit_capped(tmp_path):
    long = load_workload(str(folder(tmp_path, LLAMA3)))
    assert long.info.seq_len == 2048 and long.batch(1)["input_ids"].shape == (1, 2048)
    assert long.info.text_lm and long.info.vocab_size == 1000 and long.default_batch_size == 1
    short = load_workload(str(folder(tmp_path, GPT2, "gpt2")))
    assert short.info.seq_len == 128
    assert load_workload(str(tmp_path / "gpt2"), seq_len=100).info.seq_len == 100


def test_no_weights_are_read_and_no_network_is_used(tmp_path, monkeypatch):
    d = folder(tmp_path, LLAMA3)
    for weights in ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"):
        (d / weights).write_bytes(b"not weights: reading this file fails")

    def no_network(*args, **kwargs):
        raise AssertionError(f"memfit reached for the network: {args}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    r = estimate(str(d), Plan(), batch_size=1, seq_len=16)
    assert r.method == "fake" and r.peak_bytes > 0


BAD = [
    ("missing", None, r"model folder \S*nowhere not found; give a folder holding config.json"),
    ("no config.json", None, r"has no config\.json; give the folder a Hugging Face model was saved to"),
    ("not json", '{"model_type": "llama",', r"config\.json is not valid JSON \(.*\); fix the file"),
    ("a list", "[1, 2]", "config.json holds a list, not a JSON object"),
    ("no model_type", {"hidden_size": 8}, r"config\.json has no model_type; add .*\"model_type\": \"llama\""),
    ("unknown model_type", {"model_type": "nosuchformer", "auto_map": {"AutoConfig": "x.Y"}},
     r"does not know model_type 'nosuchformer' \(its auto_map names custom code.*\); upgrade transformers"),
    ("unknown class", {**GPT2, "architectures": ["GPT9LMHeadModel"]},
     r"has no class GPT9LMHeadModel .*; upgrade transformers or set \"architectures\": \[\"GPT2LMHeadModel\"\]"),
    ("unfed head", {**LLAMA3, "architectures": ["LlamaForQuestionAnswering"]},
     r"names LlamaForQuestionAnswering, a head memfit cannot feed .*set \"architectures\": \[\"LlamaForCausalLM\"\]"),
    # MusicGen: a text encoder beside its decoder, and a causal LM class built from the decoder's config alone
    ("text-to-audio", {"model_type": "musicgen_melody"},
     r"MusicgenMelodyForCausalLM for model_type 'musicgen_melody' is built from a part of its config "
     r"\(MusicgenMelodyDecoderConfig\).*write a file workload"),
    ("text-to-audio head", {"model_type": "musicgen", "architectures": ["MusicgenForConditionalGeneration"]},
     r"names MusicgenForConditionalGeneration, a head memfit cannot feed .*; write a file workload"),
    # vision-language models that train on images only, where memfit cannot make their image: fed text, they refuse
    ("image-only VLM", {"model_type": "blip-2", "num_query_tokens": 4,
                        "vision_config": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
                        "qformer_config": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                                           "num_attention_heads": 2, "encoder_hidden_size": 32, "vocab_size": 100},
                        "text_config": {"model_type": "opt", "num_hidden_layers": 1, "hidden_size": 32, "ffn_dim": 64,
                                        "num_attention_heads": 2, "vocab_size": 100, "word_embed_proj_dim": 32}},
     r"Blip2ForConditionalGeneration trains on images and was fed text only \(.*pixel_values.*\), as memfit could "
     r"not make its image: its config names no image token .*; write a file workload"),
    ("image-only VLM, pixels alone", {"model_type": "idefics", "vocab_size": 100, "hidden_size": 32,
                                      "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "cross_layer_interval": 1, "perceiver_config": {"use_resampler": False},
                                      "vision_config": {"embed_dim": 32, "image_size": 32, "patch_size": 8,
                                                        "num_hidden_layers": 1, "num_attention_heads": 2,
                                                        "intermediate_size": 64}},
     r"IdeficsForVisionText2Text trains on images and was fed text only .* has no get_image_features"),
    ("distilled head", {"model_type": "deit", "architectures": ["DeiTForImageClassificationWithTeacher"]},
     r"names DeiTForImageClassificationWithTeacher, a head memfit cannot feed .*set \"architectures\": "
     r"\[\"DeiTForImageClassification\"\]"),
    ("seq too long", GPT2, r"--seq-len 4096 exceeds config\.json's n_positions=128; use --seq-len <= 128"),
    ("bad sizes", {**GPT2, "n_embd": 30}, r"building the model failed with .*; fix its config\.json"),
]
