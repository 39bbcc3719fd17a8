"""Prediction equals measurement: the zoo, fp32 and bf16 autocast, AdamW (stateful).

The measurement is independent of memfit's tracker: the PyTorch profiler's CPU allocator events
(see NOTE [ Independent measurement ] in memfit/memory/measure.py), which include kernel scratch
that no storage tracker sees. Bound: 1% of the measured peak.

CPUs differ (see memfit/errors.py): where this CPU has no kernel for an op at a precision
(oneDNN's bf16 LSTM without AVX-512), the user gets an estimate that says so and a one-line error
from ``profile``; that behaviour is what is checked there.
"""

import pytest
import torch

from memfit.errors import KernelUnavailable
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads.small import SMALL_HF
from memfit.workloads.small import SMALL_SEQ as SEQ

ZOO = ["cnn", "lstm", "transformer", "mha", "dit", *SMALL_HF]


def cpu_runs_bf16_lstm() -> bool:
    """Does oneDNN on this CPU have a bf16 LSTM kernel? (Independent of memfit: a tiny real run.)"""
    lstm = torch.nn.LSTM(8, 8, batch_first=True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lstm(torch.randn(2, 3, 8))[0].sum().backward()
    except RuntimeError:
        return False
    return True


def _kernel_missing(name: str, precision: str) -> bool:
    return name == "lstm" and precision == "bf16" and not cpu_runs_bf16_lstm()


# One precision of each architecture in the default tier (both for cnn and lstm), the other in the slow tier
# (keeps the default suite under 10 minutes); the GPU rows of tests/data hold both on a GPU.
SLOW_CASES = {("t5", "fp32"), ("transformer", "fp32"), ("gpt2", "bf16"), ("bert", "fp32"), ("llama", "bf16"),
              ("vit", "fp32"), ("mha", "bf16"), ("dit", "fp32")}


@pytest.mark.parametrize("name,precision", [
    pytest.param(n, p, marks=pytest.mark.slow) if (n, p) in SLOW_CASES else (n, p) for n in ZOO for p in ("fp32", "bf16")])
def test_prediction_within_one_percent_of_measurement(name, precision):
    spec = SMALL_HF.get(name, name)
    if _kernel_missing(name, precision):
        predicted = estimate(spec, Plan(precision=precision), batch_size=4, seq_len=SEQ.get(name))
        assert predicted.method == "fake" and predicted.breakdown["optimizer_states"] > 0
        assert any("no kernel on this CPU" in a and "mkldnn_rnn_layer" in a for a in predicted.approximations)
        with pytest.raises(KernelUnavailable, match=r"mkldnn_rnn_layer .*in module LSTM .*--precision fp32"):
            profile(spec, Plan(precision=precision), batch_size=4, seq_len=SEQ.get(name), repeats=0)
        return
    result = profile(spec, Plan(precision=precision), batch_size=4, seq_len=SEQ.get(name), repeats=0)
    assert result.predicted.method == "fake"
    assert result.measured.breakdown["optimizer_states"] > 0  # steady state: AdamW states exist
    assert abs(result.error_percent) <= 1.0, (result.predicted.peak_bytes, result.measured.peak_bytes)


def test_micro_batching_prediction_matches_measurement():
    result = profile(SMALL_HF["gpt2"], Plan(micro_batch_size=2), batch_size=8, repeats=0)
    whole = profile(SMALL_HF["gpt2"], Plan(), batch_size=8, repeats=0)
    assert abs(result.error_percent) <= 1.0
    assert result.peak_bytes < whole.peak_bytes  # and it saves activation memory
