"""Activation checkpointing: same training with dropout on, recompute proven, memory saved."""

import pytest
import torch
from torch import nn

from helpers import GPT2_DROPOUT, assert_same_training, measured, run_steps
from memfit.errors import UserError
from memfit.plans import Plan
from memfit.techniques.checkpointing import checkpoint_blocks, find_blocks
from memfit.workloads import builtin_workload


@pytest.mark.parametrize("mode", ["blocks", "blocks:every=2", "selective"])
def test_same_parameters_every_step_with_dropout(mode):
    base = run_steps(GPT2_DROPOUT, Plan())
    assert_same_training(base, run_steps(GPT2_DROPOUT, Plan(checkpointing=mode)), exact=True)


def test_blocks_are_found_in_hf_and_plain_models():
    from memfit.workloads import load_workload
    gpt2 = load_workload(GPT2_DROPOUT).model()
    assert [(n, len(b)) for n, b in find_blocks(gpt2)] == [("transformer.h", 2)]
    t5 = load_workload("t5:num_layers=2,d_model=64,d_ff=128,num_heads=2,d_kv=32,vocab_size=500").model()
    assert {n for n, _ in find_blocks(t5)} == {"encoder.block", "decoder.block"}
    with pytest.raises(UserError, match="no repeated blocks"):
        checkpoint_blocks(nn.Linear(2, 2))


class _Layer(nn.Module):  # (two layers: a list of single layers is no stack, NOTE [ A list of single layers ])
    def __init__(self, width: int, out: int):
        super().__init__()
        self.proj, self.norm = nn.Linear(width, out), nn.LayerNorm(out)


class _Attention(_Layer):
    pass


class _Mamba(_Layer):
    pass


def test_a_list_of_blocks_of_several_classes_each_repeated_is_one_stack():
    """A hybrid decoder's layers (Jamba: Mamba layers, an attention layer every eighth) are one stack of blocks to
    checkpoint, as Hugging Face's gradient checkpointing takes them; a list whose classes are not each repeated
    (a UNet's down blocks: three with attention, one without) is not, nor a Sequential of several classes."""
    hybrid = nn.Module()
    hybrid.layers = nn.ModuleList([_Attention(4, 4) if i % 8 == 4 else _Mamba(4, 4) for i in range(16)])
    assert [(n, len(b)) for n, b in find_blocks(hybrid)] == [("layers", 16)]
    assert len(checkpoint_blocks(hybrid)) == 16
    unet = nn.Module()
    unet.down = nn.ModuleList([_Attention(4, 4), _Attention(4, 4), _Attention(4, 4), _Mamba(4, 4)])
    unet.seq = nn.Sequential(_Attention(4, 4), _Attention(4, 4), _Mamba(4, 4), _Mamba(4, 4))
    assert find_blocks(unet) == []
    jamba = nn.Module()
    jamba.layers = nn.ModuleList(hybrid.layers[:8])  # (a shallow cut of one attention layer: not a stack)
    assert find_blocks(jamba) == []


def test_recomputed_forwards_are_counted():
    """Each checkpointed block runs its forward twice per step (forward + recompute)."""
    calls = {"n": 0}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            calls["n"] += 1
            return torch.relu(self.lin(x))

    for every, expected in ((1, 8), (2, 6)):
        model = nn.Sequential(*[Block() for _ in range(4)])
        checkpoint_blocks(model, every=every)
        calls["n"] = 0
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
        assert calls["n"] == expected


def test_memory_saved_and_predicted():
    spec = "gpt2:n_layer=4,n_embd=128,n_head=4,vocab_size=1000,n_positions=512"
    base = measured(spec, Plan(), seq_len=512)
    for mode, max_ratio, act_ratio in (("blocks", 0.4, 0.25), ("selective", 0.65, 0.35)):
        r = measured(spec, Plan(checkpointing=mode), seq_len=512)
        assert r.peak_bytes < max_ratio * base.peak_bytes, (mode, r.peak_bytes, base.peak_bytes)
        assert abs(r.error_percent) <= 1.0, (mode, r.error_percent)
        assert r.predicted.breakdown["activations"] < act_ratio * base.predicted.breakdown["activations"]


class _Projection(nn.Module):  # (HiDream-I1's TextProjection: one Linear)
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4, bias=False)


def test_a_list_of_single_layers_is_no_stack_and_a_chain_of_them_is():
    """NOTE [ A list of single layers ]: HiDream-I1's 49 caption projections (a Linear each: a Llama layer's states per
    block, and T5's), a list of norms or of bare Linears are no blocks to checkpoint or swap; a Sequential of
    Linears runs in a chain and stays a stack. The released HiDream-I1 keeps its 16 + 32 transformer blocks."""
    heads = nn.Module()
    heads.projections = nn.ModuleList(_Projection() for _ in range(49))
    heads.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(5))
    heads.linears = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    assert find_blocks(heads) == []
    with pytest.raises(UserError, match=r"a ModuleList of modules of one class, each more than one layer"):
        checkpoint_blocks(heads)
    heads.chain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert [(n, len(b)) for n, b in find_blocks(heads)] == [("chain", 2)]
    with torch.device("meta"):
        hidream = builtin_workload("dit-hidream").model()
    assert [(n, len(b)) for n, b in find_blocks(hidream)] == [("double_stream_blocks", 16), ("single_stream_blocks", 32)]
