"""Compile searched by default on a GPU preset for a run long enough to pay for its compiles
(memfit.techniques.compile.PAYS_AFTER_STEPS), and not otherwise: the user's step as written stays
eager unless the run's length says compiling pays."""

import pytest

from memfit.devices import get_device
from memfit.planner.space import default_space, model_facts
from memfit.techniques.compile import PAYS_AFTER_STEPS
from memfit.workloads import load_workload

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128"


@pytest.fixture(scope="module")
def facts():
    return model_facts(load_workload(SPEC, seq_len=64))


@pytest.mark.parametrize("device, steps, modes", [
    ("h100-80gb", PAYS_AFTER_STEPS, ["none", "blocks", "full"]),
    ("h100-80gb", 10 * PAYS_AFTER_STEPS, ["none", "blocks", "full"]),
    ("h100-80gb", PAYS_AFTER_STEPS - 1, ["none"]),
    ("h100-80gb", None, ["none"]),
    ("cpu", 10 * PAYS_AFTER_STEPS, ["none"]),
])
def test_compile_modes_searched_by_the_runs_length(facts, device, steps, modes):
    space = default_space(facts, get_device(device), 4, run_steps=steps)
    assert space.values["compile"] == modes


def test_modes_given_win_over_the_runs_length(facts):
    space = default_space(facts, get_device("h100-80gb"), 4, compile_modes=("none",), run_steps=10 * PAYS_AFTER_STEPS)
    assert space.values["compile"] == ["none"]
