"""Synthetic batches for speech-to-text models (Whisper and its kind) built from a config.

NOTE [ Synthetic audio ]
A speech seq2seq model (transformers' ``MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING``) trains on audio and
a transcript: its encoder reads the audio, its decoder the transcript's tokens (``labels``,
shifted right inside the model). memfit feeds it random audio of the length the config implies
and random labels of ``--seq-len`` tokens (default: the decoder's position limit, capped as a
text model's is), exactly as the model's processor would shape them:

- ``whisper``: log-mel features ``[B, num_mel_bins, 2 * max_source_positions]``, the 30-second
  window every Whisper checkpoint is trained on (the encoder refuses any other length);
- ``speech_to_text``: log-mel features ``[B, frames, input_feat_per_channel * input_channels]``,
  30 seconds at 100 frames a second (Whisper's window: the config sets no length);
- ``moonshine``, ``speecht5``: raw 16 kHz audio ``[B, samples]``, 30 seconds.

Audio encoders with a head on top (transformers' CTC and audio-classification heads: wav2vec2,
HuBERT, WavLM, Data2Vec-Audio, SEW, UniSpeech, Wav2Vec2-Conformer and Wav2Vec2-BERT; AST and
Whisper's encoder for classification) get 30 seconds of audio in their processor's layout: raw
16 kHz samples ``[B, samples]`` (``input_values``); Wav2Vec2-BERT's stacked log-mel features ``[B,
1500, feature_projection_input_dim]`` (two 10 ms frames of 80 bins each, 50 a second); AST's
spectrogram ``[B, max_length, num_mel_bins]`` (its config fixes the length); Whisper's window. A CTC
head's labels are ``--seq-len`` characters (default :data:`CTC_LABELS`, a 30-second transcript), none
of them the blank (``pad_token_id``), so every label counts: CTC's ``labels >= 0`` mask is full and
its targets are of equal length (NOTE [ Sizes a fake tensor cannot know ] in
memfit.memory.assumed_sizes). A classification head's labels are one class per clip.

Other speech models (audio tokens spliced into a language model's input: Voxtral, Granite
Speech, Qwen3-ASR, ...; Parakeet's and LASR's feature layouts) are refused in one line: their batch
needs the processor's own layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.errors import UserError

AUDIO_SECONDS = 30
"""Length of the synthetic audio where the config does not fix it: Whisper's window."""
FRAMES_PER_SECOND = 100  # log-mel features: a 10 ms hop
SAMPLING_RATE = 16_000  # raw audio

_LABEL_LIMITS = {"whisper": "max_target_positions", "speech_to_text": "max_target_positions",
                 "moonshine": "max_position_embeddings", "speecht5": "max_text_positions"}
FED = tuple(_LABEL_LIMITS)


def speech_batch(model_type: str, config, seq_len: int | None, default_seq: int, where: str
                 ) -> tuple[Callable[[int], dict], int, str]:
    """(batch(batch_size), labels' length, what the audio is) for a speech seq2seq config; see
    NOTE [ Synthetic audio ]."""
    if model_type not in _LABEL_LIMITS:
        raise UserError(f"{where}: memfit makes synthetic audio for {', '.join(FED)} speech models, not "
                        f"{model_type!r} (its batch needs its processor's layout); write a file workload "
                        "(path/to/file.py:NAME) that builds the model and a batch")
    field = _LABEL_LIMITS[model_type]
    limit = getattr(config, field, None)
    seq = seq_len or (min(limit, default_seq) if isinstance(limit, int) and limit > 0 else default_seq)
    if isinstance(limit, int) and limit > 0 and seq > limit:
        raise UserError(f"{where}: --seq-len {seq} exceeds config.json's {field}={limit} (the decoder's labels); "
                        f"use --seq-len <= {limit} or raise {field} in config.json")
    vocab = config.vocab_size
    if model_type == "whisper":
        shape, key = (config.num_mel_bins, 2 * config.max_source_positions), "input_features"
        what = f"{shape[1]} log-mel frames of {shape[0]} bins (Whisper's 30 s window)"
    elif model_type == "speech_to_text":
        shape = (AUDIO_SECONDS * FRAMES_PER_SECOND, config.input_feat_per_channel * config.input_channels)
        key, what = "input_features", f"{shape[0]} log-mel frames of {shape[1]} features ({AUDIO_SECONDS} s)"
    else:
        shape, key = (AUDIO_SECONDS * SAMPLING_RATE,), "input_values"
        what = f"{shape[0]} samples of 16 kHz audio ({AUDIO_SECONDS} s)"

    def batch(batch_size: int) -> dict:
        return {key: torch.randn(batch_size, *shape), "labels": torch.randint(0, vocab, (batch_size, seq))}
    return batch, seq, what


CTC_LABELS = 448
"""A CTC head's labels without ``--seq-len``: the characters of a 30-second transcript (about 15 a
second), as many as Whisper's decoder takes for its 30 s window."""
_STACKED_FRAMES_PER_SECOND = 50  # Wav2Vec2-BERT: two 10 ms log-mel frames stacked into one


def encoder_batch(task: str, model_type: str, model_class, config, seq_len: int | None, where: str
                  ) -> tuple[Callable[[int], dict], int | None, str]:
    """(batch(batch_size), labels' length (CTC) or None, what the audio is) for an audio encoder with a
    CTC (``task`` "ctc") or classification head; see NOTE [ Synthetic audio ]."""
    key, shape, what = _encoder_audio(model_type, model_class, config, where)
    if task != "ctc":
        if seq_len is not None:
            raise UserError(f"{where}: --seq-len does not apply to an audio-classification model (one label a clip); "
                            f"drop it (the audio is {what})")
        classes = config.num_labels

        def classified(batch_size: int) -> dict:
            return {key: torch.randn(batch_size, *shape), "labels": torch.randint(0, classes, (batch_size,))}
        return classified, None, what
    vocab, blank = getattr(config, "vocab_size", None), getattr(config, "pad_token_id", None)
    if not isinstance(vocab, int) or vocab < 2:  # (a pretrained encoder's config: its CTC head is sized on fine-tuning)
        raise UserError(f"{where}: config.json has no vocab_size for the CTC head (got {vocab!r}); add \"vocab_size\": "
                        "N, the characters of your tokenizer")
    seq = seq_len or CTC_LABELS
    blank = blank if isinstance(blank, int) and 0 <= blank < vocab else None

    def ctc(batch_size: int) -> dict:
        labels = torch.randint(0, vocab - (blank is not None), (batch_size, seq))
        if blank is not None:
            labels += (labels >= blank).to(labels.dtype)  # every value but the blank
        return {key: torch.randn(batch_size, *shape), "labels": labels}
    return ctc, seq, what


def _encoder_audio(model_type: str, model_class, config, where: str) -> tuple[str, tuple[int, ...], str]:
    key = getattr(model_class, "main_input_name", "input_values")
    if model_type == "whisper":
        shape = (config.num_mel_bins, 2 * config.max_source_positions)
        return key, shape, f"{shape[1]} log-mel frames of {shape[0]} bins (Whisper's 30 s window)"
    if model_type == "audio-spectrogram-transformer":
        shape = (config.max_length, config.num_mel_bins)
        return key, shape, f"a spectrogram of {shape[0]} frames of {shape[1]} bins (AST's max_length)"
    if model_type == "wav2vec2-bert":
        shape = (AUDIO_SECONDS * _STACKED_FRAMES_PER_SECOND, config.feature_projection_input_dim)
        return key, shape, f"{shape[0]} stacked log-mel frames of {shape[1]} features ({AUDIO_SECONDS} s)"
    if key != "input_values":
        raise UserError(f"{where}: memfit makes synthetic audio for raw-audio encoders, Wav2Vec2-BERT, AST and "
                        f"Whisper, not {model_type!r} ({key}: its processor's own layout); write a file workload "
                        "(path/to/file.py:NAME) that builds the model and a batch")
    shape = (AUDIO_SECONDS * SAMPLING_RATE,)
    return key, shape, f"{shape[0]} samples of 16 kHz audio ({AUDIO_SECONDS} s)"
