"""Speech seq2seq models from a config.json (NOTE [ Synthetic audio ]): the batch the model's
processor would give (Whisper's 30 s of log-mel frames, labels at --seq-len), run for real within
1% of the prediction; what cannot be fed is refused in one line."""

import json

import pytest

from memfit.cli.main import main
from memfit.errors import UserError
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads import load_workload
from memfit.workloads.small_configs import write_folder

SPEECH_TO_TEXT = {"model_type": "speech_to_text", "architectures": ["Speech2TextForConditionalGeneration"],
                  "d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
                  "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "vocab_size": 300,
                  "conv_channels": 32, "max_target_positions": 100}
MOONSHINE = {"model_type": "moonshine", "architectures": ["MoonshineForConditionalGeneration"], "hidden_size": 32,
             "encoder_num_hidden_layers": 1, "decoder_num_hidden_layers": 1, "encoder_num_attention_heads": 2,
             "decoder_num_attention_heads": 2, "intermediate_size": 32, "vocab_size": 300,
             "max_position_embeddings": 128}


def batch_shapes(spec, seq_len=None):
    wl = load_workload(spec, seq_len=seq_len)
    return {k: tuple(v.shape) for k, v in wl.batch(2).items()}, wl


def test_whisper_gets_its_30_second_window_and_labels_at_seq_len(tmp_path):
    folder = write_folder("whisper", tmp_path)
    shapes, wl = batch_shapes(folder, seq_len=24)
    assert shapes == {"input_features": (2, 16, 128), "labels": (2, 24)}  # 2 x max_source_positions frames
    assert wl.info.config["model_class"] == "WhisperForConditionalGeneration" and wl.info.seq_len == 24
    assert batch_shapes(folder)[0]["labels"] == (2, 64)  # default: the decoder's limit, max_target_positions


@pytest.mark.parametrize("config,shape", [(SPEECH_TO_TEXT, (3000, 80)), (MOONSHINE, (480000,))],
                         ids=["speech_to_text", "moonshine"])
def test_other_speech_models_get_30_seconds_of_audio(tmp_path, config, shape):
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes, _ = batch_shapes(str(tmp_path), seq_len=16)
    key = "input_features" if config["model_type"] == "speech_to_text" else "input_values"
    assert shapes == {key: (2, *shape), "labels": (2, 16)}


@pytest.mark.parametrize("plan", [Plan(), pytest.param(Plan(precision="bf16", checkpointing="blocks", adapter="lora:r=8"),
                                                      marks=pytest.mark.slow)],  # (slow: keeps the default suite under 10 minutes)
                         ids=["fp32", "bf16-blocks-lora"])
def test_whisper_runs_for_real_within_one_percent(tmp_path, plan):
    r = profile(write_folder("whisper", tmp_path), plan, batch_size=2, seq_len=32, repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0


def test_what_cannot_be_fed_is_one_line(tmp_path, capsys):
    folder = write_folder("whisper", tmp_path)
    with pytest.raises(UserError, match=r"--seq-len 65 exceeds config.json's max_target_positions=64 \(the decoder's "
                                        r"labels\); use --seq-len <= 64"):
        load_workload(folder, seq_len=65)
    other = tmp_path / "pop2piano"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "pop2piano",
                                                   "architectures": ["Pop2PianoForConditionalGeneration"]}))
    capsys.readouterr()  # (what the calls above printed, e.g. a library's import notices: not the command's)
    assert main(["estimate", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "memfit makes synthetic audio for whisper, speech_to_text, moonshine, speecht5" in err


# -- audio encoders with a CTC or classification head ---------------------------------------------

WAV2VEC2_CTC = {"model_type": "wav2vec2", "architectures": ["Wav2Vec2ForCTC"], "hidden_size": 32,
                "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 32,
                "pad_token_id": 0, "conv_dim": [16, 16, 16], "conv_stride": [5, 4, 4], "conv_kernel": [10, 4, 4],
                "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2, "layerdrop": 0.0,
                "mask_time_prob": 0.2, "mask_time_length": 4}  # (SpecAugment on: its mask is drawn with numpy)
HUBERT_CLASSIFIER = {**WAV2VEC2_CTC, "model_type": "hubert", "architectures": ["HubertForSequenceClassification"],
                     "num_labels": 5}


def _folder(tmp_path, config, **changes):
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    return str(tmp_path)


def test_a_ctc_head_gets_30_seconds_of_audio_and_labels_that_are_never_the_blank(tmp_path):
    shapes, wl = batch_shapes(_folder(tmp_path, WAV2VEC2_CTC), seq_len=40)
    assert shapes == {"input_values": (2, 480000), "labels": (2, 40)}
    assert wl.info.config["model_class"] == "Wav2Vec2ForCTC" and wl.info.seq_len == 40
    labels = wl.batch(64)["labels"]
    assert labels.min() >= 1 and labels.max() == 31  # every value but the blank (pad_token_id 0)
    assert batch_shapes(str(tmp_path))[0]["labels"] == (2, 448)  # default: a 30-second transcript


def test_a_ctc_head_without_a_vocabulary_is_one_line(tmp_path):
    """A pretrained encoder's config (Wav2Vec2-BERT's, Wav2Vec2-Conformer's) sizes no CTC head: was an internal error."""
    with pytest.raises(UserError, match=r"config.json has no vocab_size for the CTC head \(got None\); add "):
        batch_shapes(_folder(tmp_path, WAV2VEC2_CTC, vocab_size=None))


def test_an_audio_classifier_gets_one_label_a_clip_and_refuses_seq_len(tmp_path):
    folder = _folder(tmp_path, HUBERT_CLASSIFIER)
    shapes, _ = batch_shapes(folder)
    assert shapes == {"input_values": (2, 480000), "labels": (2,)}
    with pytest.raises(UserError, match="--seq-len does not apply to an audio-classification model"):
        load_workload(folder, seq_len=16)


@pytest.mark.parametrize("config", [WAV2VEC2_CTC, HUBERT_CLASSIFIER], ids=["wav2vec2-ctc", "hubert-classifier"])
def test_audio_encoders_are_traced_on_fake_tensors_and_run_for_real_within_one_percent(tmp_path, config, monkeypatch):
    """Before, CTC's masked_select and _ctc_loss and SpecAugment's host-drawn mask (indexed in backward)
    each failed the fake trace, and the estimate fell back to a real run on this CPU (NOTE [ Sizes a
    fake tensor cannot know ]). (5 s of audio, not 30: the same ops, a sixth of the real run's time.)"""
    import memfit.workloads.speech
    monkeypatch.setattr(memfit.workloads.speech, "AUDIO_SECONDS", 5)
    r = profile(_folder(tmp_path, config), Plan(), batch_size=1, seq_len=40 if "ctc" in str(config) else None,
                repeats=0)
    assert r.predicted.method == "fake" and abs(r.error_percent) < 1.0, (r.predicted.method, r.error_percent)
