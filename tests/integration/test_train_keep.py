"""The last K checkpoints (``memfit train --keep-checkpoints K``, default 2; memfit.training.retention):
K stay, resume takes the newest that loads and says in one line which it skipped and why, a run
started over (--overwrite) removes the old run's only once its own first checkpoint is complete.

On main before this change, one checkpoint was kept: --keep-checkpoints was an unknown flag, and a
checkpoint that was complete but unreadable ended the run."""

import json

import pytest

from memfit.cli.main import main
from memfit.training import checkpoint, retention

TINY = "mha:vocab=64,dim=16,heads=2,layers=1,seq_len=8"
ARGS = ["train", TINY, "-b", "2", "--checkpoint-every", "1", "--no-report", "--json"]


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _steps(out) -> list[int]:
    return [e.step for e in retention.complete(out)]


def test_the_last_k_are_kept_and_resume_takes_the_newest_that_loads(tmp_path, capsys):
    assert main([*ARGS, "--steps", "6", "--out", str(tmp_path / "straight")]) == 0
    assert _steps(tmp_path / "straight") == [6, 5]  # the default: 2
    out = tmp_path / "out"
    assert main([*ARGS, "--steps", "4", "--out", str(out), "--keep-checkpoints", "3"]) == 0
    assert _steps(out) == [4, 3, 2]
    (out / "checkpoint-00000004.pt").write_bytes((out / "checkpoint-00000004.pt").read_bytes()[:4096])  # cut short
    capsys.readouterr()
    assert main([*ARGS, "--steps", "6", "--out", str(out), "--keep-checkpoints", "3", "--resume"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("resume: skipped checkpoint-00000004.pt (corrupt or unreadable: ")
    assert err[0].endswith("continuing from checkpoint-00000003.pt (step 3)")
    assert _losses(out) == _losses(tmp_path / "straight")  # steps 4-6 again, exactly
    assert _steps(out) == [6, 5, 4] and checkpoint.read(out)["skipped"] == []


def test_a_run_started_over_replaces_the_old_runs_checkpoints(tmp_path):
    out = tmp_path / "out"
    assert main([*ARGS, "--steps", "5", "--out", str(out), "--seed", "1"]) == 0
    assert _steps(out) == [5, 4]
    assert main([*ARGS, "--steps", "2", "--out", str(out), "--overwrite", "--seed", "2"]) == 0
    assert _steps(out) == [2, 1]  # the old run's 4 and 5 are gone, now that this run's are complete
    assert main([*ARGS, "--steps", "2", "--out", str(tmp_path / "seed2"), "--seed", "2"]) == 0
    assert _losses(out) == _losses(tmp_path / "seed2")


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5"])
def test_a_bad_keep_is_one_line(tmp_path, capsys, value):
    assert main([*ARGS, "--steps", "1", "--out", str(tmp_path), "--keep-checkpoints", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--keep-checkpoints" in err[0], err


def test_the_resume_command_keeps_the_plan_the_planner_chose():
    """Planning again on resume could choose another plan (a CPU plan times real steps), which the
    checkpoint would refuse: the command printed at a stop names the plan file the run trained."""
    from memfit.cli.train import resume_command
    argv = ["train", "gpt2", "--budget", "1GiB", "--overwrite", "--out", "run 1"]
    assert resume_command(argv, "run 1/planned.yaml") == (
        "memfit train gpt2 --budget 1GiB --out 'run 1' --plan 'run 1/planned.yaml' --resume")
    assert resume_command([*argv, "--plan", "p.yaml"], "x") == (
        "memfit train gpt2 --budget 1GiB --out 'run 1' --plan p.yaml --resume")
