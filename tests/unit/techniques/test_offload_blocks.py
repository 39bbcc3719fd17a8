"""Activation offload with block checkpointing (issue 15): forward offloads what each checkpoint
keeps for backward (its block's input; with ``selective``, what the policy saves too) and the saved
tensors outside the blocks; backward's recomputation offloads nothing. NOTE [ Checkpoints under
saved-tensor hooks ] in memfit.techniques.checkpointing."""

import contextlib
from collections import Counter

import pytest
import torch

from helpers import GPT2_DROPOUT, assert_same_training, measured, run_steps
from memfit.memory.estimate import estimate
from memfit.observer import NullObserver
from memfit.plans import Plan
from memfit.step import build_step
from memfit.techniques import offload
from memfit.techniques.checkpoint_call import HOOKS_KWARGS
from memfit.techniques.checkpointing import find_blocks
from memfit.workloads import load_workload

OFF = ["activations"]
BATCH, SEQ, WIDTH = 4, 64, 64  # GPT2_DROPOUT's n_embd
INPUT_BYTES = BATCH * SEQ * WIDTH * 4
"""One block's input: [batch, seq, n_embd] in fp32."""


@pytest.mark.parametrize("mode", ["blocks", "blocks:every=2", "selective"])
def test_offload_trains_exactly_as_checkpointing_alone(mode):
    assert_same_training(run_steps(GPT2_DROPOUT, Plan(checkpointing=mode)),
                         run_steps(GPT2_DROPOUT, Plan(checkpointing=mode, offload=OFF)))


class _Phases(NullObserver):
    """The step's observer: which phase runs now (the step announces them)."""

    now = "idle"

    @contextlib.contextmanager
    def phase(self, name):
        before, self.now = self.now, name
        try:
            yield
        finally:
            self.now = before


def _one_step(monkeypatch, plan):
    """One step of ``plan`` on the tiny GPT-2: every pack of the offload hooks as (phase, inside a
    block's call?, the block's input?, offloaded?), the calls of each block's first submodule by
    phase (a recomputation calls it again in backward), the number of blocks, the hooks."""
    packs, running, calls, made = [], [], Counter(), []
    phases = _Phases()
    real_pack, real_init = offload.OffloadActivations._pack, offload.OffloadActivations.__init__

    def pack(self, t):
        out = real_pack(self, t)
        inside = running[-1] if running else None
        packs.append((phases.now, inside is not None, inside == t.untyped_storage()._cdata,
                      not isinstance(out, torch.Tensor)))
        return out

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(offload.OffloadActivations, "_pack", pack)
    monkeypatch.setattr(offload.OffloadActivations, "__init__", init)
    wl = load_workload(GPT2_DROPOUT, seq_len=SEQ)
    torch.manual_seed(0)
    step = build_step(wl, plan, BATCH, "cpu", observer=phases)
    ((_, blocks),) = find_blocks(step.model)
    for block in blocks:  # (a block's own hooks run in forward only: the recomputation calls its forward)
        block.register_forward_pre_hook(lambda m, args, kwargs: running.append(
            (args[0] if args else kwargs["hidden_states"]).untyped_storage()._cdata), with_kwargs=True)
        block.register_forward_hook(lambda m, args, out: running.pop() and None)  # (None: the output stays)
        next(block.children()).register_forward_pre_hook(lambda m, args: calls.update([phases.now]))
    step(wl.batch(BATCH))
    return packs, calls, len(blocks), made[0]


def test_blocks_offload_each_input_in_forward_and_nothing_while_recomputing(monkeypatch):
    packs, calls, n, hooks = _one_step(monkeypatch, Plan(checkpointing="blocks", offload=OFF))
    assert calls == {"forward": n, "backward": n}  # every block was recomputed in backward...
    assert [p for p in packs if p[0] != "forward"] == []  # ...and nothing it saved went to the host
    inside = [p for p in packs if p[1]]
    assert inside == [("forward", True, True, True)] * n  # in a block: its input, once, to the host
    assert any(off for _, within, _, off in packs if not within)  # and outside them (head, loss)
    assert hooks.saved == {} and hooks.fetched == {} and not hooks.unpacked  # freed with the graph


@pytest.mark.skipif(not HOOKS_KWARGS, reason="torch < 2.14 keeps what selective checkpointing saves out of the "
                    "saved-tensor hooks (no respect_saved_tensors_hooks)")
def test_selective_offloads_what_its_policy_saves_and_nothing_while_recomputing(monkeypatch):
    packs, calls, n, _ = _one_step(monkeypatch, Plan(checkpointing="selective", offload=OFF))
    assert calls == {"forward": n, "backward": n}
    assert [p for p in packs if p[0] != "forward"] == []
    inside = [p for p in packs if p[1]]
    assert sum(1 for p in inside if p[2]) == n  # each block's input
    assert sum(1 for p in inside if not p[2] and p[3]) >= 3 * n  # matmul / attention outputs (qkv, proj, mlp...)


def test_device_keeps_no_block_inputs_and_the_host_one_per_block():
    """Measured (tracker on real tensors, its device + host total checked against the profiler):
    offload takes exactly the blocks' inputs off the device's activations; the host holds one input
    per block plus what lies outside the blocks, so deeper models add one input per block."""
    blocks = measured(GPT2_DROPOUT, Plan(checkpointing="blocks"))
    both = measured(GPT2_DROPOUT, Plan(checkpointing="blocks", offload=OFF))
    for r in (blocks, both):
        assert abs(r.error_percent) <= 1.0, r.error_percent
    acts = blocks.measured.breakdown["activations"] - both.measured.breakdown["activations"]
    assert acts == 2 * INPUT_BYTES, acts  # the 2 blocks' inputs, at the peak
    assert both.measured.breakdown["activations"] < 1024  # (only what is below min_bytes)
    assert both.measured.host_peak_bytes == both.predicted.host_peak_bytes > 2 * INPUT_BYTES

    def host(layers, checkpointing):
        spec = GPT2_DROPOUT.replace("n_layer=2", f"n_layer={layers}")
        return estimate(spec, Plan(checkpointing=checkpointing, offload=OFF), batch_size=BATCH,
                        seq_len=SEQ).host_peak_bytes
    assert host(2, "blocks") == both.measured.host_peak_bytes
    assert host(4, "blocks") - host(2, "blocks") == 2 * INPUT_BYTES  # one input per added block
    assert host(4, "none") - host(2, "none") > 20 * INPUT_BYTES  # without checkpointing: all they save


GPT2_4 = GPT2_DROPOUT.replace("n_layer=2", "n_layer=4")


@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_the_first_blocks_offload_alone_and_train_exactly_as_without(checkpointing, monkeypatch):
    """``activations:blocks=K``: what is saved inside the first K blocks goes to the host, nothing else
    (not the later blocks', not the head's or the loss'); the training equals the plain one."""
    assert_same_training(run_steps(GPT2_4, Plan(checkpointing=checkpointing)),
                         run_steps(GPT2_4, Plan(checkpointing=checkpointing, offload=["activations:blocks=2"])))
    packs, _, n, hooks = _one_step(monkeypatch, Plan(checkpointing="blocks", offload=["activations:blocks=1"]))
    assert [off for _, within, _, off in packs if not within and off] == []  # outside the blocks: kept
    assert hooks.blocks == 1 and hooks._inside == 0


def test_offloading_the_first_blocks_keeps_between_none_and_all_and_is_predicted():
    plain, half, every = (measured(GPT2_4, Plan(offload=off)) for off in ([], ["activations:blocks=2"], OFF))
    for r in (plain, half, every):
        assert abs(r.error_percent) <= 1.0, r.error_percent
    acts = [r.measured.breakdown["activations"] for r in (plain, half, every)]
    assert acts[0] > acts[1] > acts[2]
    assert 0 < half.predicted.host_peak_bytes < every.predicted.host_peak_bytes


@pytest.mark.parametrize("items,problem", [
    (["activations:blocks=0"], "K must be a whole number >= 1"), (["activations:blocks=9"], "give 1 to 4"),
    (["activations", "activations:blocks=2"], "lists activations twice"),
    (["activations:blocks=x"], "is not valid")])
def test_bad_first_blocks_are_one_line(items, problem):
    from memfit.errors import UserError
    with pytest.raises(UserError, match=problem) as e:
        estimate(GPT2_4, Plan(offload=items), batch_size=BATCH, seq_len=SEQ)
    assert "\n" not in str(e.value)


def test_the_first_blocks_save_no_more_than_all_and_the_search_tries_half():
    from memfit.devices import get_device
    from memfit.planner.space import default_space, model_facts
    half, every, states = (Plan(offload=o).config("offload") for o in (["activations:blocks=2"], OFF,
                                                                        ["optimizer_states"]))
    assert half.saves_at_most(every, 4) and not every.saves_at_most(half, 4) and not half.saves_at_most(states, 4)
    space = default_space(model_facts(load_workload("llama:num_hidden_layers=8", seq_len=64)), get_device("h100-80gb"), 1)
    assert ("activations:blocks=4",) in space.values["offload"]
    # frozen text encoders first (CLIP-L's 12 and T5's 24 layers) save nothing: half of FLUX.1's 57 blocks behind them
    flux = default_space(model_facts(load_workload("dit-flux:text_encoders=frozen")), get_device("h100-80gb"), 1)
    assert flux.values["offload"][-1] == ("activations:blocks=64",)
