"""FSDP2 sharding (memfit.techniques.sharding): two gloo ranks on this CPU train as one process on
the whole batch does, and one rank's measured peak is what the fake-process-group trace predicts.

The ranks are real processes (``torch.multiprocessing`` with spawn, gloo on localhost); the
prediction is one process against PyTorch's fake process group. Kept few and small: one launch of
two Python processes runs every case (each start costs seconds)."""

import json
import socket

import pytest
import torch
import torch.multiprocessing as mp

from memfit.memory import workspaces
from memfit.memory.estimate import estimate
from memfit.plans import Plan

pytestmark = pytest.mark.integration

SMALL = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=32,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"
BATCH, STEPS = 8, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_batch(target):
    torch.manual_seed(1)
    return target.workload.batch(target.batch_size)


CASES = {"fsdp": {"shard": "fsdp", "world_size": 2},
         "fsdp+loss_chunks+ema": {"world_size": 2, "loss_chunks": 4, "ema": {"decay": 0.5, "device": "device"}},
         "fsdp+in_backward": {"world_size": 2, "optimizer_in_backward": True},
         "fsdp+shard_offload": {"world_size": 2, "shard_offload": True},  # (an internal error before: FSDP2 pinned)
         "fsdp+compile": {"world_size": 2, "compile": "blocks"}}
WIDER = "gpt2:n_layer=4,n_embd=256,n_head=4,vocab_size=2000,n_positions=64"


def _rank(rank: int, world: int, port: int, out: str, cases: list[str]) -> None:
    """One rank, every case in turn (one pair of processes for them all: each start costs seconds).
    A case: measure the peak of its second step with the profiler's allocator events (and the
    tracker's, on the real tensors), then train STEPS steps of the sharded step on its share of the
    global batch; rank 0 writes what it saw. Last, the wider model's step is measured alone."""
    import os

    import torch.distributed as dist
    from torch.utils._pytree import tree_map

    from memfit.memory.measure import measured_cpu_run
    from memfit.memory.report import report_for
    from memfit.step import build_step
    from memfit.target import Target

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seen = {}
    try:
        for case in cases:
            fields = CASES[case]
            target = Target.resolve(SMALL, Plan(**fields), BATCH, "cpu", seq_len=32)
            torch.manual_seed(0)
            run, peak, _ = measured_cpu_run(target)
            tracked = report_for(run.tracker, target, "real").peak_bytes
            del run
            torch.manual_seed(0)
            step = build_step(target)  # the same initial weights, trained on this rank's share
            b = target.rank_batch_size
            share = tree_map(lambda x, b=b: x[rank * b:(rank + 1) * b] if isinstance(x, torch.Tensor) else x,
                             _global_batch(target))
            losses = []
            for _ in range(STEPS):
                loss = step.run(share)
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                losses.append(float(loss))
            params = {n: p.full_tensor().tolist() for n, p in step.model.named_parameters()}
            ema = {n: t.full_tensor().tolist() for n, t in step.ema.sharded_state_dict()["shadow"].items()} \
                if hasattr(step.ema, "sharded_state_dict") else {}
            seen[case] = {"peak": peak, "tracked": tracked, "losses": losses, "params": params, "ema": ema}
            del step
        target = Target.resolve(WIDER, Plan(world_size=world), BATCH, "cpu", seq_len=32)
        run, peak, _ = measured_cpu_run(target)
        seen["wider"] = {"peak": peak, "tracked": report_for(run.tracker, target, "real").peak_bytes}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(seen, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, request) -> dict:
    """What rank 0 of 2 real gloo ranks saw, by case (one launch for the module): the cases this session
    runs (the slow tier's compiled case only when it is selected)."""
    out = str(tmp_path_factory.mktemp("ranks") / "rank0.json")
    cases = [c for c in CASES if any(getattr(item, "callspec", None) and item.callspec.params.get("case") == c
                                     and item.path.name == "test_sharding.py" for item in request.session.items)]
    mp.start_processes(_rank, args=(2, _free_port(), out, cases), nprocs=2, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def _one_process(steps: int, fields: dict):
    from memfit.step import build_step
    from memfit.target import Target
    one = {k: v for k, v in fields.items() if k not in ("shard", "world_size") and not k.startswith("shard_")}
    target = Target.resolve(SMALL, Plan(**one), BATCH, "cpu", seq_len=32)
    torch.manual_seed(0)
    step = build_step(target)
    batch = _global_batch(target)
    losses = [float(step.run(batch)) for _ in range(steps)]
    return losses, {n: p.detach() for n, p in step.model.named_parameters()}, step.ema.state_dict().get("shadow", {})


# (compiled blocks on two ranks: slow, keeps the default suite under 10 minutes on 2 cores)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if "compile" in c else c for c in CASES])
def test_two_ranks_train_as_one_process_and_the_rank_peak_is_predicted(two_ranks, case):
    """Same global batch, same initial weights: the 2-rank FSDP2 losses and parameters equal one
    process's (up to the reduction order of float sums: 1e-5 relative). Rank 0's step, tracked on
    its real tensors, is the fake-process-group prediction (FSDP2's buffers, their resizes, the
    sharded states) less gloo's scratch, which the tracker cannot see and the prediction books by
    rule (NOTE [ gloo's collective scratch ]). The profiler's allocator events (independent of the
    tracker, with the frees gloo's worker threads make put back: NOTE [ Frees the profiler does not
    see ]) are within 2% of the prediction, the issue's bound. The chunked loss runs inside the sharded root's patched forward (its head
    and embeddings gathered for it, their gradients reduce-scattered after it); the EMA of the
    shards is the EMA of the weights. Compiled blocks are sharded after they are compiled, as
    torchtitan does: FSDP2's hooks gather around the compiled forward."""
    fields, ranks = CASES[case], two_ranks[case]
    losses, params, ema = _one_process(STEPS, fields)
    assert ranks["losses"] == pytest.approx(losses, rel=1e-5)
    for name, p in params.items():
        torch.testing.assert_close(torch.tensor(ranks["params"][name]), p, rtol=1e-4, atol=1e-6)
    assert sorted(ranks["ema"]) == sorted(ema)  # (each rank averages its shards: together, the weights' average)
    for name, shadow in ema.items():
        torch.testing.assert_close(torch.tensor(ranks["ema"][name]), shadow, rtol=1e-4, atol=1e-6)
    predicted = estimate(SMALL, Plan(**fields), batch_size=BATCH, device="cpu", seq_len=32)
    assert predicted.breakdown["communication"] > 0
    if "compile" not in fields:  # (a real compiled block runs outside the tracker: NOTE [ Real compiled regions
        # run outside memfit's modes ]; the profiler sees it)
        assert predicted.peak_bytes - predicted.breakdown["communication"] <= ranks["tracked"] <= predicted.peak_bytes
    assert ranks["peak"] == pytest.approx(predicted.peak_bytes, rel=0.02), (ranks["peak"], predicted.peak_bytes)


def test_gloos_scratch_sets_the_wider_models_rank_peak(two_ranks, monkeypatch):
    """On a wider GPT-2 the rank's peak is in a backward all-gather, where gloo gathers into a flat
    buffer of the output's size (NOTE [ gloo's collective scratch ]): predicted by rule, measured by
    the profiler within 2%; without the rule the prediction is 2.3% low. (Not against the tracker on
    the real tensors: in one CI run it booked 0.6 MB more than the prediction without the rule, a
    real kernel's scratch the profiler's peak did not hold, while the profiler's peak was the same.)"""
    measured = two_ranks["wider"]["peak"]
    predicted = estimate(WIDER, Plan(world_size=2), batch_size=BATCH, device="cpu", seq_len=32)
    assert measured == pytest.approx(predicted.peak_bytes, rel=0.02), (measured, predicted.peak_bytes)
    monkeypatch.setattr(workspaces, "GLOO_SCRATCH", {})
    without_rule = estimate(WIDER, Plan(world_size=2), batch_size=BATCH, device="cpu", seq_len=32)
    assert measured > 1.02 * without_rule.peak_bytes, (measured, without_rule.peak_bytes)


def test_shard_offload_on_a_gpu_preset_books_the_shards_on_the_host():
    """NOTE [ FSDP2's offload on a GPU preset ]: traced on the CPU's tensors, FSDP2's copies between host and device
    are no-ops, and the prediction was the plan's without offload (refused until 2026-12-05). Now the shards, their
    gradients, the optimizer's states and its step are the host's, and the device holds only the units being
    gathered (memfit.techniques.shard_offload), for an adapter's training and a full fine-tuning."""
    import torch

    from memfit.workloads import load_workload
    kw = dict(batch_size=BATCH, device="h100-80gb", seq_len=32)
    with torch.device("meta"):
        shards = sum(p.numel() for p in load_workload(SMALL, seq_len=32).model().parameters()) * 4 // 2
    for fields, on_host in (({"adapter": "lora:r=4"}, shards), ({}, 4 * shards)):  # (full: + gradients, 2 states)
        kept = estimate(SMALL, Plan(world_size=2, **fields), **kw)
        offloaded = estimate(SMALL, Plan(world_size=2, shard_offload=True, **fields), **kw)
        for category in ("parameters", "gradients", "optimizer_states"):
            assert offloaded.breakdown[category] == 0, (fields, category, offloaded.breakdown[category])
        assert kept.breakdown["parameters"] > 0
        assert offloaded.host_peak_bytes >= on_host, (fields, offloaded.host_peak_bytes, on_host)
        assert kept.peak_bytes - offloaded.peak_bytes > shards // 2, (fields, kept.peak_bytes, offloaded.peak_bytes)
