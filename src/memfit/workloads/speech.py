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

Other speech models (audio tokens spliced into a language model's input: Voxtral, Granite
Speech, Qwen3-ASR, ...) are refused in one line: their batch needs the processor's own layout.
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
