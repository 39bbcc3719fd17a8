"""Activation checkpointing: same training with dropout on, recompute proven, memory saved."""

import pytest
import torch
from torch import nn

from helpers import GPT2_DROPOUT, assert_same_training, measured, run_steps
from memfit.errors import UserError
from memfit.plans import Plan
from memfit.techniques.checkpointing import checkpoint_blocks, find_blocks
from memfit.workloads import builtin_workload


@pytest.mark.parametrize("mode", ["blocks", "blocks:every=2", "selective", "blocks:reentrant=true",
                                  "blocks:every=2,reentrant=true"])
def test_same_parameters_every_step_with_dropout(mode):
    base = run_steps(GPT2_DROPOUT, Plan())
    assert_same_training(base, run_steps(GPT2_DROPOUT, Plan(checkpointing=mode)), exact=True)


def test_reentrant_blocks_train_a_frozen_models_adapter_as_without_checkpointing():
    """Under torch's reentrant checkpoint a block of a frozen model gets no input that requires grad, and its
    adapter no gradient, unless the input embeddings' output requires grad (transformers' own checkpointing
    enable does that, and so does memfit's): the adapter trains exactly as without checkpointing."""
    base = run_steps(GPT2_DROPOUT, Plan(adapter="lora:r=4"))
    reentrant = run_steps(GPT2_DROPOUT, Plan(adapter="lora:r=4", checkpointing="blocks:reentrant=true"))
    assert any("lora_A" in name for name in base[1][0])
    assert_same_training(base, reentrant, exact=True)


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
    for mode, max_ratio, act_ratio in (("blocks", 0.4, 0.25), ("selective", 0.65, 0.35), ("blocks:reentrant=true", 0.4, 0.25)):
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


class _KeywordBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x, *, scale=None):
        return self.norm(torch.relu(self.lin(x))) * (1 if scale is None else scale)


def test_reentrant_blocks_recompute_under_the_steps_contexts_and_refuse_a_keyword_gradient():
    """torch's reentrant checkpoint recomputes each block once in backward, under the step's recompute contexts
    (entered only then); a tensor that needs a gradient passed by keyword, which it would drop, is one line."""
    entered = []
    model = nn.Sequential(*[_KeywordBlock() for _ in range(4)])
    checkpoint_blocks(model, reentrant=True, recompute_contexts=[lambda: _Counted(entered)])
    model(torch.randn(2, 8)).sum().backward()  # (an input without grad: the first block's is made to require it)
    assert len(entered) == 4 and all(block.lin.weight.grad is not None for block in model)
    block = _KeywordBlock()
    blocks = nn.ModuleList([block, _KeywordBlock()])
    checkpoint_blocks(blocks, reentrant=True)
    with pytest.raises(UserError, match=r"takes scale by keyword, a tensor that needs a gradient.*use checkpointing: blocks"):
        block(torch.randn(2, 8), scale=torch.ones(8, requires_grad=True))


class _Counted:
    def __init__(self, into: list):
        self.into = into

    def __enter__(self):
        self.into.append(1)

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("fields,message", [
    ({"checkpointing": "blocks:reentrant=maybe"}, "is not valid; use none, blocks, blocks:every=N, blocks:reentrant=true"),
    ({"checkpointing": "blocks:reentrant=true", "compile": "blocks"}, "with compile is not supported"),
])
def test_reentrant_blocks_bad_input_is_one_line(fields, message):
    with pytest.raises(UserError, match=message):
        from memfit.target import Target
        Target.resolve("gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=64", Plan(**fields), 1, seq_len=8)


def test_reentrant_blocks_text_round_trips():
    from memfit.techniques.checkpointing import BlocksAC
    for text, config in (("blocks:reentrant=true", BlocksAC(reentrant=True)), ("blocks:every=2,reentrant=true",
                                                                             BlocksAC(2, reentrant=True)),
                         ("blocks:reentrant=false", BlocksAC()), ("blocks:every=3", BlocksAC(3))):
        assert Plan(checkpointing=text).config("checkpointing") == config
        assert Plan(checkpointing=config.text).config("checkpointing") == config


@pytest.mark.parametrize("kwargs,reentrant", [(None, False), ({"use_reentrant": True}, True),
                                              ({"use_reentrant": False}, False), ({}, True)])
def test_training_arguments_checkpointing_reads_as_the_checkpoint_it_runs(kwargs, reentrant):
    """``TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs=...)``: transformers' default
    (None) is the non-reentrant checkpoint; kwargs without ``use_reentrant`` reach torch's checkpoint, whose default
    is reentrant; and the plan exports back to the same kwargs."""
    from memfit.techniques.base import Export
    from memfit.techniques.checkpointing import BlocksAC, Checkpointing
    config = Checkpointing.from_arguments(Export(1, hf={"gradient_checkpointing": True,
                                                         "gradient_checkpointing_kwargs": kwargs}))
    assert config == BlocksAC(reentrant=reentrant)
    into = Export(1)
    config.export(into)
    assert into.hf["gradient_checkpointing_kwargs"] == {"use_reentrant": reentrant}
