"""No GPU preset crashes on a built-in workload (issue 10): every preset x every built-in workload,
with and without block checkpointing, gives an estimate whose breakdown sums to its peak, or a
one-line user error (block checkpointing of a model without repeated blocks). ~4 minutes: slow."""

import warnings

import pytest

import memfit
from memfit.devices import GPU_PRESETS
from memfit.errors import UserError

WORKLOADS = ["gpt2", "llama:num_hidden_layers=2", "bert", "t5", "vit", "cnn", "lstm", "transformer", "mha", "dit"]
NO_BLOCKS = {"cnn", "lstm"}


@pytest.mark.slow
@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_preset_estimates_every_builtin_workload(workload):
    for device in GPU_PRESETS:
        for checkpointing in ("none", "blocks"):
            plan = memfit.Plan(precision="auto", checkpointing=checkpointing)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if checkpointing == "blocks" and workload in NO_BLOCKS:
                    with pytest.raises(UserError, match="no repeated blocks"):
                        memfit.estimate(workload, plan, device=device, batch_size=2)
                    continue
                report = memfit.estimate(workload, plan, device=device, batch_size=2)
            assert report.peak_bytes > 0 and sum(report.breakdown.values()) == report.peak_bytes, (device, checkpointing)
            assert report.reserved_bytes >= report.peak_bytes
