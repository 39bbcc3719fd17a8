"""memfit train --nproc N (memfit.training.distributed): ranks launched by torchrun's agent on this
CPU (gloo) train as one process does, resume at another world size, adapt to out-of-memory in
lockstep, and bad input stops before any rank starts, in one line.

Each launch starts Python processes that import torch and transformers (~10 s here): kept few."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from memfit.cli.main import main
from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.training.loop import train

pytestmark = pytest.mark.integration

SMALL = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=32,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"
EMA = {"decay": 0.5, "device": "device"}
ARGS = [SMALL, "--seq-len", "32", "-b", "8", "--no-report", "--checkpoint-every", "2", "--ema", "decay=0.5,device=device"]


def _memfit(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "memfit.cli.main", "train", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _one_process(out, steps: int, resume: bool = False):
    return train(SMALL, plan=Plan(ema=EMA), seq_len=32, batch_size=8, steps=steps, out=out, resume=resume,
                 progress=False, report=False, checkpoint_every=2)


def _params(out) -> dict[str, torch.Tensor]:
    """The parameters and EMA shadows of the checkpoint in ``out`` (whichever kind), loaded into one
    process's step."""
    from memfit.step import build_step
    from memfit.target import Target
    from memfit.training import checkpoint
    step = build_step(Target.resolve(SMALL, Plan(ema=EMA), 8, "cpu", seq_len=32))
    checkpoint.restore(step, checkpoint.read(out))
    return {**{n: p.detach().clone() for n, p in step.model.named_parameters()},
            **{f"ema:{n}": t for n, t in step.ema.state_dict()["shadow"].items()}}


@pytest.mark.slow  # (about 45 s on 2 cores: keeps the default suite under 10 minutes)
def test_two_ranks_train_as_one_process_and_resume_at_the_other_world_size(tmp_path):
    """4 steps on 2 ranks == 4 steps in one process (the same text, the same global batches; up to
    the order of float sums, 1e-5). Then each continues at the other world size to step 6: the DCP
    checkpoint of 2 ranks in one process, one process's checkpoint-<step>.pt on 2 ranks. Both continue as
    the one process that ran 6 steps straight does, EMA included (each rank's shards of it go
    through DCP). rank 0 alone writes metrics.jsonl, with each rank's measured peak beside the
    per-rank prediction."""
    ranks, whole, reference = tmp_path / "ranks", tmp_path / "whole", tmp_path / "reference"
    done = _memfit(*ARGS, "--steps", "4", "--out", str(ranks), "--nproc", "2", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    _one_process(whole, 4)
    _one_process(reference, 6)
    expected = _losses(reference)
    first = _losses(ranks)
    assert sorted(first) == [1, 2, 3, 4]  # one record per step: rank 0's
    assert [first[i] for i in range(1, 5)] == pytest.approx([expected[i] for i in range(1, 5)], rel=1e-5)
    assert sorted(p.name for p in ranks.glob("checkpoint*")) == ["checkpoint-dcp-00000002", "checkpoint-dcp-00000004"]
    predicted = estimate(SMALL, Plan(world_size=2, ema=EMA), batch_size=8, device="cpu",
                         seq_len=32).measurable_peak_bytes
    assert summary["world_size"] == 2 and summary["predicted_peak_bytes"] == predicted
    assert len(summary["measured_peak_bytes_per_rank"]) == 2 and min(summary["measured_peak_bytes_per_rank"]) > 0

    _one_process(ranks, 6, resume=True)  # 2 ranks -> 1 process
    on_two = _memfit(*ARGS, "--steps", "6", "--out", str(whole), "--nproc", "2", "--resume")  # 1 -> 2
    assert on_two.returncode == 0, on_two.stderr
    for out in (ranks, whole):
        losses = _losses(out)
        assert sorted(losses) == list(range(1, 7))
        assert [losses[5], losses[6]] == pytest.approx([expected[5], expected[6]], rel=1e-5)
    from memfit.training import checkpoint
    assert checkpoint.read(ranks)["kind"] == "whole" and checkpoint.read(whole)["kind"] == "dcp"
    reference_params = _params(reference)
    assert any(name.startswith("ema:") for name in reference_params)
    for out in (ranks, whole):
        for name, p in _params(out).items():
            torch.testing.assert_close(p, reference_params[name], rtol=1e-4, atol=1e-6)

    # a rank's user error (resuming with another batch) reaches the user as one line, exit 2
    wrong = _memfit(SMALL, "--seq-len", "32", "-b", "4", "--steps", "8", "--out", str(whole), "--nproc", "2",
                    "--resume", "--no-report")
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        "memfit train: error: the checkpoint in --out was written with another plan or batch size; resume with the "
        "same --plan/--batch-size (the world size may differ), or start a new run in another --out folder"]


@pytest.mark.slow  # (keeps the default suite under 10 minutes on 2 cores); two ranks: test_sharding
def test_optimizer_in_backward_on_two_ranks_resumes_in_one_process(tmp_path):
    """Sharded optimizer-in-backward: each rank steps its shards from FSDP2's post-reduce-scatter
    hooks; the DCP checkpoint holds the per-parameter optimizers' states by parameter name, so one
    process continues the 2-rank run as if it had run all 6 steps (1e-5)."""
    ranks, reference = tmp_path / "ranks", tmp_path / "reference"
    args = [SMALL, "--seq-len", "32", "-b", "8", "--no-report", "--checkpoint-every", "2",
            "--optimizer-in-backward", "true"]
    done = _memfit(*args, "--steps", "4", "--out", str(ranks), "--nproc", "2")
    assert done.returncode == 0, done.stderr
    plan = Plan(optimizer_in_backward=True)
    train(SMALL, plan=plan, seq_len=32, batch_size=8, steps=6, out=ranks, resume=True, progress=False, report=False,
          checkpoint_every=2)
    train(SMALL, plan=plan, seq_len=32, batch_size=8, steps=6, out=reference, progress=False, report=False)
    losses, expected = _losses(ranks), _losses(reference)
    assert sorted(losses) == list(range(1, 7))
    assert [losses[i] for i in range(1, 7)] == pytest.approx([expected[i] for i in range(1, 7)], rel=1e-5)


@pytest.mark.slow  # (keeps the default suite under 10 minutes on 2 cores); one process: test_train_adapt
def test_out_of_memory_on_two_ranks_adapts_in_lockstep(tmp_path):
    """A per-rank budget under the plan's need: the CPU guard raises out-of-memory on both ranks,
    rank 0 picks the smaller micro-batch and both rebuild; the losses stay one process's."""
    (tmp_path / "plan.yaml").write_text("world_size: 2\n")
    out, reference = tmp_path / "ranks", tmp_path / "reference"
    done = _memfit(*ARGS, "--steps", "3", "--out", str(out), "--nproc", "2", "--budget", "2.6MiB",
                   "--plan", str(tmp_path / "plan.yaml"), "--ema", "null")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    adaptations = [a for r in records for a in r.get("adaptations", [])]
    assert adaptations and all("micro_batch_size" in a["adaptation"] for a in adaptations)
    assert done.stderr.count("retrying the same batch") == len(adaptations)  # said once, by rank 0
    train(SMALL, seq_len=32, batch_size=8, steps=3, out=reference, progress=False, report=False)
    assert [r["loss"] for r in records] == pytest.approx(list(_losses(reference).values()), rel=1e-5)


def _port_in_use():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


@pytest.mark.parametrize("extra, message", [
    (["--nproc", "16"], "world_size 16 is larger than the batch (8)"),
    (["--nproc", "3"], "the batch (8) does not split evenly over world_size 3"),
    (["--nproc", "2", "--world-size", "4"], "plan: world_size 4, and --nproc 2 processes run it"),
    (["--port", "29500"], "--port is the rendezvous port of --nproc ranks"),
    (["--nproc", "2", "--port", "x"], "--port 'x': give a port number"),
    (["--nproc", "0"], "--nproc"),
])
def test_bad_launches_stop_before_any_rank_starts(tmp_path, capsys, extra, message):
    assert main(["train", *ARGS, "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_a_port_in_use_and_a_missing_backend_are_one_line(tmp_path, capsys, monkeypatch):
    sock, port = _port_in_use()
    with sock:
        assert main(["train", *ARGS, "--out", str(tmp_path / "o"), "--nproc", "2", "--port", str(port)]) == 2
    assert f"--port {port} is in use on this machine; choose another port" in capsys.readouterr().err
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    assert main(["train", *ARGS, "--out", str(tmp_path / "o"), "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["memfit train: error: --nproc on a CPU needs the gloo backend, which this PyTorch build lacks; "
                   "install a PyTorch with gloo, or train without --nproc"]


def test_a_rank_of_the_users_own_torchrun_does_not_plan_alone(tmp_path, monkeypatch, capsys):
    """Planned in each rank, a budget could give each rank another plan (the CPU planner times real
    steps): a rank that torchrun started refuses a budget without a plan, in one line."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", SMALL, "--seq-len", "32", "-b", "8", "--out", str(tmp_path / "o"), "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "would plan alone" in err[0]
