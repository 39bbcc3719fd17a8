"""Prediction equals measurement: the zoo, fp32 and bf16 autocast, AdamW (stateful).

The measurement is independent of memfit's tracker: the PyTorch profiler's CPU allocator events
(see NOTE [ Independent measurement ] in memfit/memory/measure.py), which include kernel scratch
that no storage tracker sees. Bound: 1% of the measured peak.
"""

import pytest

from conftest import SEQ, SMALL_HF
from memfit.memory.measure import profile
from memfit.plans import Plan

ZOO = ["cnn", "lstm", "transformer", "mha", "dit", *SMALL_HF]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ZOO)
def test_prediction_within_one_percent_of_measurement(name, precision):
    spec = SMALL_HF.get(name, name)
    result = profile(spec, Plan(precision=precision), batch_size=4, seq_len=SEQ.get(name), repeats=1)
    assert result.predicted.method == "fake"
    assert result.measured.breakdown["optimizer_states"] > 0  # steady state: AdamW states exist
    assert abs(result.error_percent) <= 1.0, (result.predicted.peak_bytes, result.measured.peak_bytes)


def test_micro_batching_prediction_matches_measurement():
    result = profile(SMALL_HF["gpt2"], Plan(micro_batch_size=2), batch_size=8, repeats=1)
    whole = profile(SMALL_HF["gpt2"], Plan(), batch_size=8, repeats=1)
    assert abs(result.error_percent) <= 1.0
    assert result.peak_bytes < whole.peak_bytes  # and it saves activation memory
