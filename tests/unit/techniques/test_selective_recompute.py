"""Selective checkpointing recomputes no matmul; block checkpointing recomputes the block's matmuls.

memfit's selective policy (NOTE [ Selective checkpointing policy ]) saves the outputs of matmuls,
convolutions and attention kernels inside each checkpointed block and recomputes everything else
in backward. Here the claim is counted from outside memfit, as torchtitan's AC tests do: a
dispatch mode counts the matmul and pointwise calls of one real step, ``FlopCounterMode`` its
FLOPs, and the expected numbers come from the toy model's shapes.
"""

import contextlib
import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from memfit.plans import Plan
from memfit.step import build_step
from memfit.workload import Workload

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
BATCH, DIM, HIDDEN, LAYERS = 16, 32, 64, 3


class Block(nn.Module):
    """Pre-norm MLP block: x + down(gelu(up(norm(x))))."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """LAYERS identical blocks (what memfit checkpoints) and a head outside them (never checkpointed)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class OpCounts(TorchDispatchMode):
    """How many times each aten op ran, and how many of them were matmuls."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        self.matmuls += func in MATMULS
        return func(*args, **(kwargs or {}))


class MatmulOutputs(TorchDispatchMode):
    """A weak reference to the storage of every matmul output: alive later means something kept it."""

    def __init__(self):
        super().__init__()
        self.storages: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            self.storages.append(weakref.ref(out.untyped_storage()))
        return out


def _workload() -> Workload:
    torch.manual_seed(0)
    init = Net()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 1, generator=g)
    return Workload(model=lambda: copy.deepcopy(init), batch=lambda n: (x[:n], y[:n]),
                    loss=lambda model, b: F.mse_loss(model(b[0]), b[1]),
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))


def _one_step(checkpointing: str, early_stop: bool = True) -> dict:
    wl = _workload()
    step = build_step(wl, Plan(checkpointing=checkpointing), BATCH, "cpu")
    batch = wl.batch(BATCH)
    # early stop is read when the checkpointed forward runs (torch.utils.checkpoint); True is torch's default
    stop = contextlib.nullcontext() if early_stop else set_checkpoint_early_stop(False)
    with stop, FlopCounterMode(display=False) as flops, OpCounts() as ops:
        loss = step(batch)
    return {"loss": loss, "model": step.model, "flops": flops.get_total_flops(), "matmuls": ops.matmuls,
            "gelu": ops.calls.get("gelu", 0), "layer_norm": ops.calls.get("native_layer_norm", 0),
            "params": {n: p.detach().clone() for n, p in step.model.named_parameters()},
            "grads": {n: p.grad.clone() for n, p in step.model.named_parameters()}}


def _linear_flops(lin: nn.Linear) -> int:
    return 2 * BATCH * lin.in_features * lin.out_features


@pytest.mark.parametrize("early_stop", [True, False], ids=["early_stop", "no_early_stop"])
def test_selective_recomputes_no_matmul_blocks_recompute_the_forward(early_stop):
    """Per step, counted by a dispatch mode and FlopCounterMode, expected from the shapes:

    - none: every Linear runs 3 matmuls (forward, grad input, grad weight), 3x the forward FLOPs;
    - selective: exactly the same matmuls and FLOPs as none, yet each block's GELU and LayerNorm
      run twice (the recompute happened, and it reused the saved matmul outputs);
    - blocks: the blocks' forward matmuls once more. With torch's default early stop the recompute
      ends at the last tensor backward needs: the down projection's output feeds only the residual
      add, which saves nothing, so only the up projection is recomputed; without early stop every
      block matmul is.

    Training is unchanged: loss, gradients and updated parameters are torch.equal in the three modes.
    """
    runs = {mode: _one_step(mode, early_stop) for mode in ("none", "selective", "blocks")}
    model = runs["none"]["model"]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    forward_flops = sum(_linear_flops(m) for m in linears)
    block_linears = [m for b in model.blocks for m in (b.up, b.down)]
    recomputed = block_linears if not early_stop else [b.up for b in model.blocks]

    none, selective, blocks = runs["none"], runs["selective"], runs["blocks"]
    assert none["matmuls"] == 3 * len(linears) and none["flops"] == 3 * forward_flops
    assert none["gelu"] == LAYERS and none["layer_norm"] == LAYERS

    assert selective["matmuls"] == none["matmuls"]
    assert selective["flops"] == none["flops"]
    assert selective["gelu"] == 2 * LAYERS and selective["layer_norm"] == 2 * LAYERS

    assert blocks["matmuls"] == none["matmuls"] + len(recomputed)
    assert blocks["flops"] == none["flops"] + sum(_linear_flops(m) for m in recomputed)
    assert blocks["gelu"] == 2 * LAYERS and blocks["layer_norm"] == 2 * LAYERS

    for mode in ("selective", "blocks"):
        assert runs[mode]["loss"] == none["loss"], mode
        for kind in ("grads", "params"):
            for name, ref in none[kind].items():
                assert torch.equal(runs[mode][kind][name], ref), (mode, kind, name)


def test_selective_keeps_every_matmul_output_blocks_keep_none():
    """What stays alive between forward and backward (weak references to the output storages):

    - none: each up projection's output (GELU saves its input), not the down projection's (the
      residual add saves nothing);
    - selective: every block matmul output, the down projection's too: the policy saves by op, not
      by whether backward reads the tensor, so it holds BATCH x DIM per block that none frees;
    - blocks: no block matmul output (only the block inputs are kept).

    The head, outside the blocks, keeps its output in all modes (mse_loss saves it).
    """
    expected = {"none": [True, False] * LAYERS, "selective": [True, True] * LAYERS,
                "blocks": [False, False] * LAYERS}
    for mode, blocks_alive in expected.items():
        wl = _workload()
        step = build_step(wl, Plan(checkpointing=mode), BATCH, "cpu")
        batch = wl.batch(BATCH)
        with MatmulOutputs() as outs:
            loss = wl.loss(step.model, batch)
        gc.collect()
        alive = [ref() is not None for ref in outs.storages]
        assert alive == [*blocks_alive, True], mode  # up, down per block in forward order; then the head
        loss.backward()
