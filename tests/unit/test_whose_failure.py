"""NOTE [ Whose failure ] (memfit.errors): a step that fails is the user's (their config, their precision) or
memfit's (its fake-tensor model of a library), and the error says which, in one line with the fix."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.errors import TraceError, UserError
from memfit.workloads.checks import blamed


def _own_float32(model, batch):
    """A step whose model makes a float32 tensor of its own (as xLSTM's gates) and multiplies its weight by it
    (a batched matmul, whose meta kernel checks the dtypes as the device's does)."""
    return torch.bmm(model.weight[None], torch.ones(1, 4, 4, device=model.weight.device)).sum()


def _dot_float32(model, batch):
    """The same with an op autocast leaves alone (``dot``)."""
    return torch.dot(model.weight[0], torch.ones(4, device=model.weight.device))


@pytest.mark.parametrize("fake", [False, True])
def test_dtypes_an_op_refuses_in_a_model_cast_to_16_bits_whole_are_the_models(fake):
    """xLSTM cast to bf16 whole (bf16-pure) multiplies a float32 gate by a bf16 tensor: the real step fails,
    and memfit's trace failed there too, with an error that blamed memfit ("the model is not at fault"; the
    real run's said "fix its config.json"). Both now name the dtypes and the fix, autocast."""
    FakeTensorMode.cache_clear()
    with FakeTensorMode() if fake else torch.no_grad():
        pure = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
        with pytest.raises(UserError, match=r"acme/x: loss\(model, batch\) failed .*the op refuses its operands' "
                                            r"dtypes, as the device's kernel would: RuntimeError: .*; the model makes "
                                            r"float32 tensors of its own: train it under autocast \(--precision bf16\) "
                                            r"instead$"):
            blamed("acme/x", "fix its config.json", "loss(model, batch)", _own_float32)(pure, None)
        half = torch.nn.Linear(4, 4, dtype=torch.float16)  # (fp16-pure: its autocast is fp16's)
        with pytest.raises(UserError, match=r"under autocast \(--precision fp16\) instead$"):
            blamed("acme/x", "fix its config.json", "loss(model, batch)", _own_float32)(half, None)
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TraceError if fake else UserError) as e:
            blamed("acme/x", "fix its config.json", "loss(model, batch)", _dot_float32)(pure, None)  # (autocast on:
        assert "dtypes" not in str(e.value)  # memfit's model of the cast lists is in play)
        mixed = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
        mixed.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))  # (a float32 parameter: not cast whole)
        with pytest.raises(TraceError if fake else UserError) as e:
            blamed("acme/x", "fix its config.json", "loss(model, batch)", _own_float32)(mixed, None)
        assert "dtypes" not in str(e.value)
