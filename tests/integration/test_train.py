"""memfit train: exact resume, atomic checkpoints, refusals, measured vs predicted peak."""

import json
import os

import pytest
import torch

from memfit.cli.main import main
from memfit.errors import UserError
from memfit.plans import Plan
from memfit.training import checkpoint
from memfit.training.data import ByteCorpus
from memfit.training.loop import train

LM = "gpt2:n_layer=2,n_embd=64,n_head=4,n_positions=128"


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path / "metrics.jsonl")]


@pytest.mark.parametrize("plan,half", [
    (Plan(), 4),  # 4 steps + resume + 4 steps == 8 straight
    (Plan(optimizer_in_backward=True, checkpointing="blocks"), 4),
    (Plan(optimizer="adamw8bit"), 4),  # 8-bit optimizer states
    # grad scaler and EMA; fp16 is emulated (slow) on CPUs without AVX-512 fp16
    pytest.param(Plan(precision="fp16", ema={"decay": 0.9, "device": "cpu"}), 4, marks=pytest.mark.slow),
])
def test_resume_gives_the_same_losses_as_a_straight_run(tmp_path, plan, half):
    run = dict(plan=plan, seq_len=64, batch_size=2, progress=False, report=False)
    straight = train(LM, steps=2 * half, out=tmp_path / "a", **run)
    train(LM, steps=half, out=tmp_path / "b", **run)
    resumed = train(LM, steps=2 * half, out=tmp_path / "b", resume=True, **run)
    assert resumed.losses == straight.losses[half:]
    assert _losses(tmp_path / "b") == straight.losses
    if plan.ema is not None:
        import torch

        from memfit.training.checkpoint import read
        a, b = read(tmp_path / "a")["ema"], read(tmp_path / "b")["ema"]
        assert a["updates"] == b["updates"] == 2 * half and a["shadow"].keys() == b["shadow"].keys()
        assert all(torch.equal(a["shadow"][k], b["shadow"][k]) for k in a["shadow"])


def test_steady_state_peak_matches_the_prediction(tmp_path):
    r = train(LM, steps=3, out=tmp_path, seq_len=64, batch_size=4, progress=False, report=False)
    assert abs(r.predicted_peak_bytes - r.measured_peak_bytes) <= 0.01 * r.measured_peak_bytes
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [x["step"] for x in records] == [1, 2, 3] and all("peak_bytes" in x and "loss" in x for x in records)


def test_checkpoint_is_atomic_and_refused_when_corrupt_or_foreign(tmp_path):
    train(LM, steps=2, out=tmp_path, seq_len=64, batch_size=2, progress=False, report=False)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint")] == []  # no temp left
    other = "gpt2:n_layer=1,n_embd=64,n_head=4,n_positions=128"
    with pytest.raises(UserError, match="another model"):
        train(other, steps=3, out=tmp_path, seq_len=64, batch_size=2, resume=True, progress=False, report=False)
    with pytest.raises(UserError, match="another plan"):
        train(LM, plan=Plan(precision="bf16"), steps=3, out=tmp_path, seq_len=64, batch_size=2, resume=True,
              progress=False, report=False)
    (tmp_path / "checkpoint-00000002.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="no checkpoint in .* loads .checkpoint-00000002.pt: corrupt"):
        train(LM, steps=3, out=tmp_path, seq_len=64, batch_size=2, resume=True, progress=False, report=False)


def test_data_from_files_and_bad_inputs(tmp_path, capsys):
    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.txt").write_text("hello memfit " * 200)
    assert ByteCorpus(str(text)).data.numel() == len("hello memfit ") * 200
    r = train(LM, steps=2, out=tmp_path / "o", data=str(text), seq_len=64, batch_size=2, progress=False, report=False)
    assert len(r.losses) == 2
    (tmp_path / "empty.txt").write_text("")
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    for argv, message in [
        (["train", LM, "--data", str(tmp_path / "missing")], "not found"),
        (["train", LM, "--data", str(tmp_path / "empty.txt")], "holds no text"),
        (["train", "mha", "--data", str(text)], "applies to the built-in language models"),
        (["train", LM, "--resume", "--out", str(tmp_path / "fresh")], "no checkpoint"),
        (["train", LM, "--steps", "0"], "--steps"),
        (["train", "mha", "--loss-chunks", "4", "--out", str(tmp_path / "m")], "loss_chunks needs"),
        (["train", LM, "--device", "h100", "--out", str(tmp_path / "d")], "training runs on this machine"),
        (["train", LM, "--device", "h100", "--out", str(tmp_path / "d")], "training runs on this machine"),
    ] + ([] if os.geteuid() == 0 else [(["train", LM, "--out", str(locked / "x")], "cannot write")]) + (
        [] if torch.cuda.is_available() else [(["train", LM, "--device", "cuda"], "no CUDA GPU")]):
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err


NO_DROPOUT = "gpt2:n_layer=2,n_embd=64,n_head=4,n_positions=128,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"


def _events(path):
    """The adaptations logged in metrics.jsonl (inside the record of the step they happened in)."""
    return [a for line in open(path / "metrics.jsonl") for a in json.loads(line).get("adaptations", [])]


def test_injected_ooms_keep_the_training_the_same(tmp_path, inject_oom):
    """OOMs at steps 2 and 5: the same samples are re-split into smaller micro-batches and retried."""
    import torch
    clean = train(NO_DROPOUT, steps=7, out=tmp_path / "clean", seq_len=64, batch_size=4, progress=False, report=False)
    with inject_oom({2, 5}):
        oom = train(NO_DROPOUT, steps=7, out=tmp_path / "oom", seq_len=64, batch_size=4, progress=False, report=False)
    torch.testing.assert_close(torch.tensor(oom.losses), torch.tensor(clean.losses), rtol=1e-5, atol=1e-6)
    events = _events(tmp_path / "oom")
    assert [e["step"] for e in events] == [2, 5] and all(e["phase"] == "forward" for e in events)
    assert [e["adaptation"].split(" x")[0] for e in events] == ["micro_batch_size 2", "micro_batch_size 1"]


def test_escalation_when_micro_batches_cannot_shrink(tmp_path, inject_oom):
    import torch
    plan = Plan(optimizer_in_backward=True)  # cannot accumulate: escalates to checkpointing, then offload
    clean = train(NO_DROPOUT, plan=plan, steps=4, out=tmp_path / "a", seq_len=64, batch_size=2, progress=False, report=False)
    with inject_oom({2, 3}):
        oom = train(NO_DROPOUT, plan=plan, steps=4, out=tmp_path / "b", seq_len=64, batch_size=2, progress=False,
                    report=False)
    torch.testing.assert_close(torch.tensor(oom.losses), torch.tensor(clean.losses), rtol=1e-5, atol=1e-6)
    assert [e["adaptation"] for e in _events(tmp_path / "b")] == ["checkpointing: blocks", "offload: activations"]
    # the adapted plan is in the checkpoint: resuming continues with it
    resumed = train(NO_DROPOUT, plan=plan, steps=6, out=tmp_path / "b", seq_len=64, batch_size=2, resume=True,
                    progress=False, report=False)
    straight = train(NO_DROPOUT, plan=plan, steps=6, out=tmp_path / "c", seq_len=64, batch_size=2, progress=False, report=False)
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(straight.losses[4:]), rtol=1e-5, atol=1e-6)


def test_a_process_killed_while_saving_leaves_the_last_good_checkpoint(tmp_path):
    """Save a large checkpoint over and over in a child process and SIGKILL it mid-write."""
    import signal
    import subprocess
    import sys
    import time

    import torch

    from memfit.step import build_step
    from memfit.training.checkpoint import read, restore
    from memfit.workloads import load_workload

    train(LM, steps=1, out=tmp_path, seq_len=64, batch_size=2, progress=False, report=False)
    good = read(tmp_path)
    code = f"""
import torch, sys
sys.argv = ["x"]
from memfit.training import checkpoint
from memfit.step import build_step
from memfit.workloads import load_workload
from memfit.plans import Plan
from pathlib import Path
wl = load_workload({LM!r}, seq_len=64)
step = build_step(wl, Plan(), 2, "cpu")
step.model.register_buffer("ballast", torch.zeros(64 << 20))  # 256 MiB: a slow write
print("ready", flush=True)
while True:
    checkpoint.save(Path({str(tmp_path)!r}), step, step_index=1, samples_seen=0, workload="gpt2", requested_plan=Plan())
"""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    child.send_signal(signal.SIGKILL)
    child.wait()
    state = read(tmp_path)  # whatever was on disk when the kill came: a complete checkpoint
    step = build_step(load_workload(LM, seq_len=64), Plan(), 2, "cpu")
    if "ballast" in state["model"]:
        step.model.register_buffer("ballast", torch.zeros(64 << 20))
    assert restore(step, state)[0] == good["step"]
    # the killed save's temporary file is removed by the next run in that folder
    train(LM, steps=2, out=tmp_path, seq_len=64, batch_size=2, progress=False, overwrite=True, report=False)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_ctrl_c_saves_the_steps_done_and_resume_continues_exactly(tmp_path, capsys):
    import dataclasses

    from memfit.workloads import load_workload
    wl = load_workload(LM, seq_len=64)
    real_calls = []

    def interrupted_in_step_6(model, batch):
        if type(batch["input_ids"]) is torch.Tensor:  # a real step, not the estimate's fake trace
            real_calls.append(1)
            if len(real_calls) == 6:
                raise KeyboardInterrupt
        return wl.loss(model, batch)

    run = dict(batch_size=2, report=False, checkpoint_every=0)
    straight = train(LM, steps=8, out=tmp_path / "a", progress=False, seq_len=64, **run)
    with pytest.raises(KeyboardInterrupt):
        train(dataclasses.replace(wl, loss=interrupted_in_step_6), steps=8, out=tmp_path / "b", **run)
    assert "saved the checkpoint of step 5" in capsys.readouterr().err
    resumed = train(LM, steps=8, out=tmp_path / "b", resume=True, progress=False, seq_len=64, **run)
    assert resumed.losses == straight.losses[5:]
    assert _losses(tmp_path / "b") == straight.losses


def test_resume_after_a_crash_keeps_one_record_per_step(tmp_path):
    """The crashed run logged steps 5-6 (and half a line) after its checkpoint at step 4."""
    run = dict(seq_len=64, batch_size=2, progress=False, report=False, checkpoint_every=4)
    straight = train(LM, steps=8, out=tmp_path / "a", **run)
    train(LM, steps=4, out=tmp_path / "b", **run)
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 1.0, "peak_bytes": 1}) + "\n")
        f.write(json.dumps({"step": 6, "loss": 1.0, "peak_bytes": 1}) + "\n{\"step\": 7, \"lo")
    train(LM, steps=8, out=tmp_path / "b", resume=True, **run)
    records = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == straight.losses


def test_a_checkpoint_written_before_a_plan_key_existed_still_resumes():
    """Plans in checkpoints are compared as plans: a key added since the checkpoint was written
    (a new technique's) takes its default, so a run resumes across versions; another plan, or a
    key this version does not know, is still refused."""
    state = {"workload": "gpt2", "plan": {"precision": "bf16"}, "batch_size": 2}
    checkpoint.check(state, workload="gpt2", requested_plan=Plan(precision="bf16"), batch_size=2)
    for plan, data in ((Plan(), state["plan"]), (Plan(precision="bf16"), {"precision": "bf16", "future_key": 1})):
        with pytest.raises(UserError, match="another plan"):
            checkpoint.check({**state, "plan": data}, workload="gpt2", requested_plan=plan, batch_size=2)
