"""allocator: expandable segments. On a GPU preset the prediction replays the step through the
expandable-segments model; the step itself computes the same thing (on the CPU it is the same step)."""

import torch

from memfit.memory.estimate import estimate_target
from memfit.plans import Plan
from memfit.step import build_step, make_batch
from memfit.target import Target
from memfit.techniques.allocator import environment_expands
from memfit.techniques.base import Export

TINY = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=64"


def _grads(plan):
    target = Target.resolve(TINY, plan, 2, "cpu", seq_len=32)
    torch.manual_seed(0)
    step = build_step(target)
    torch.manual_seed(1)
    step.forward_backward(make_batch(target))
    return [p.grad.clone() if p.grad is not None else p.detach().clone() for p in step.model.parameters()]


def test_the_step_is_the_same_with_expandable_segments():
    for a, b in zip(_grads(Plan()), _grads(Plan(allocator="expandable")), strict=True):
        assert torch.equal(a, b)


def test_the_gpu_prediction_replays_expandable_segments():
    """Same trace, other allocator: allocated bytes equal to 512-byte rounding (the default counts
    unsplit remainders), and a reserved figure the default's fragmentation does not exceed less."""
    default = estimate_target(Target.resolve("llama:num_hidden_layers=2", Plan(precision="bf16"), 2, "h100-80gb",
                                             seq_len=512))
    expand = estimate_target(Target.resolve("llama:num_hidden_layers=2", Plan(precision="bf16", allocator="expandable"),
                                            2, "h100-80gb", seq_len=512))
    assert expand.peak_bytes <= default.peak_bytes <= expand.peak_bytes * 1.01
    assert expand.reserved_bytes < default.reserved_bytes
    assert any("expandable segments" in a for a in expand.approximations)


def test_the_environment_decides_the_default(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:True")
    assert environment_expands() and Plan().config("allocator").expands
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not Plan().config("allocator").expands
    assert Plan(allocator="expandable").config("allocator").expands


def test_trainers_are_told_to_set_the_environment():
    into = Export(batch_size=2)
    Plan(allocator="expandable").config("allocator").export(into)
    assert any("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in n for n in into.hf_notes + into.lightning_notes)
