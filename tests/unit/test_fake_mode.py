"""NOTE [ CUDA availability asked once a trace ]: a trace in a process where Lightning was imported
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``: each ``torch.cuda.is_available()`` opens NVML) asks the question a
few times, not once per op, and predicts what it predicted without the variable."""

import torch

from memfit.memory.estimate import estimate
from memfit.plans import Plan


def test_a_trace_asks_whether_cuda_is_usable_a_few_times_not_once_per_op(monkeypatch):
    plan = Plan(precision="bf16", checkpointing="blocks")
    without = estimate("gpt2", plan, batch_size=2, seq_len=32, device="rtx4090")
    asked = []
    answer = torch.cuda.is_available

    def counted():
        asked.append(1)
        return answer()
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", counted)
    with_lightnings_check = estimate("gpt2", plan, batch_size=2, seq_len=32, device="rtx4090")
    assert len(asked) < 50, f"torch.cuda.is_available() asked {len(asked)} times in one trace"
    assert with_lightnings_check.peak_bytes == without.peak_bytes
    assert with_lightnings_check.reserved_bytes == without.reserved_bytes
