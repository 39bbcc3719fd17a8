"""memfit plan on the command line: its flags, what it writes and prints, and one-line refusals."""

from __future__ import annotations

import json

import pytest
import yaml

from memfit.cli.main import main
from memfit.devices import get_device
from memfit.integrations.export import HF_TRAINER
from memfit.memory.estimate import estimate_target
from memfit.planner import cost
from memfit.plans import Plan
from memfit.target import Target
from memfit.workloads import load_workload

pytestmark = pytest.mark.integration
SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128"
SMALL = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=32"
BATCH = 8


def _peak(wl, batch: int) -> int:
    return estimate_target(Target(wl, Plan(), batch, get_device("cpu"))).peak_bytes


def test_nothing_fits_names_the_smallest_budget(capsys):
    assert main(["plan", "mha", "-b", "4", "--budget", "4MiB", "--max-traces", "5"]) == 1
    out = capsys.readouterr().out
    assert "nothing fits" in out and "a budget of at least that would fit" in out


@pytest.mark.slow  # (keeps the default suite under 10 minutes)
def test_cli_writes_a_plan_that_estimate_accepts(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["plan", "mha", "-b", "4", "--budget", "60MiB", "--out", str(out), "--format", "hf",
                 "--pareto", str(tmp_path / "p.png")]) == 0
    text = capsys.readouterr().out
    assert "TrainingArguments(**{" in text and (tmp_path / "p.png").stat().st_size > 5000
    assert Plan.from_dict(yaml.safe_load(out.read_text()))
    assert main(["estimate", "mha", "-b", "4", "--plan", str(out), "--json"]) == 0


@pytest.mark.slow  # (keeps the default suite under 10 minutes)
def test_plan_flags_fix_fields(capsys):
    assert main(["plan", "mha", "-b", "4", "--budget", "60MiB", "--precision", "bf16", "--checkpointing", "none",
                 "--json", "--max-traces", "3"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"]["plan"]["precision"] == "bf16" and out["chosen"]["plan"]["checkpointing"] == "none"


def test_plan_refuses_a_batch_the_fixed_micro_batch_does_not_divide(capsys):
    assert main(["plan", "mha", "-b", "6", "--budget", "60MiB", "--micro-batch-size", "4"]) == 2
    assert "not a multiple" in capsys.readouterr().err


def test_cli_flags_are_checked(capsys):
    for flags, message in ((["--compile-modes", "blocks,fast"], "--compile-modes: unknown mode 'fast'"),
                           (["--compile-modes", ","], "--compile-modes: unknown mode ''"),
                           (["--steps", "0"], "--steps must be a positive whole number")):
        assert main(["plan", SPEC, "-b", "2", "--seq-len", "16", *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # (a compiled trace: keeps the default suite under 10 minutes)
def test_gpu_preset_plan_shows_compile_time(capsys):
    """A roomy budget on a GPU preset, compile blocks searched: the fastest plan is compiled,
    traced through Inductor's pipeline on fake tensors, with its predicted compile time; over a short
    run (this toy's steps take microseconds on the preset) an eager plan is faster."""
    argv = ["plan", SPEC, "-b", "8", "--seq-len", "64", "--device", "a100-40gb", "--budget", "4GiB",
            "--max-traces", "2", "--optimizers", "adamw", "--compile-modes", "none,blocks"]
    assert main([*argv, "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen["plan"]["compile"] == "blocks" and chosen["compile_seconds"] > 0
    assert main(argv) == 0
    table = capsys.readouterr().out.split("alternatives, fastest first")[1].splitlines()
    assert table[1].split()[:5] == ["plan", "memory", "ms/step", "tokens/s", "compile"] and "compile=blocks" in table[2]
    assert main([*argv, "--steps", "1000"]) == 0
    out = capsys.readouterr().out
    assert "over a run of 1000 steps, compile time included" in out
    assert "compile" not in out.split("chosen:")[1].splitlines()[0]


@pytest.mark.slow  # a planner run (~20 s here); the default tier prints an export in tests/integration
def test_plan_prints_the_arguments_what_they_cannot_carry_and_the_callback(tmp_path, capsys, target_machine):
    out = tmp_path / "plan.yaml"
    argv = ["plan", "gpt2:n_layer=2,n_embd=32,n_head=2,vocab_size=256,n_positions=32", "--seq-len", "16", "-b", "4",
            "--budget", "1GiB", "--max-traces", "2", "--precision", "bf16", "--checkpointing", "blocks",
            "--optimizer-in-backward", "true", "--loss-chunks", "2", "--format", "hf", "--out", str(out)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    call = next(line for line in lines if line.startswith("TrainingArguments("))
    args = eval(call, {"TrainingArguments": lambda **kw: target_machine("cpu", **kw)})  # noqa: S307
    # the step in backward and the chunked loss change the step: MemfitTrainer's own step runs the
    # plan, precision and checkpointing included, so the arguments leave those to it
    assert args.use_cpu and args.per_device_train_batch_size == 4 and not args.bf16 and not args.gradient_checkpointing
    for key in ("optimizer_in_backward: true", "loss_chunks: 2", "precision: bf16", "checkpointing: blocks"):
        assert f"  not carried by these arguments: {key}" in lines
    assert any(line.startswith(f"  -> {HF_TRAINER}(..., plan=") for line in lines), lines


def test_plan_refuses_in_one_line_when_no_batch_fits_the_free_memory(monkeypatch, capsys):
    wl = load_workload(SPEC, seq_len=64)
    monkeypatch.setattr(cost, "available_host_bytes", lambda: int(0.5 * _peak(wl, 1) / cost.HOST_SHARE))
    ran = []
    monkeypatch.setattr(cost, "_time_steps", lambda *a: ran.append(a) or (0.01, 0.0))
    assert main(["plan", SPEC, "--seq-len", "64", "-b", str(BATCH), "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "times real steps" in err and "at batch 1 (predicted)" in err
    assert "--device h100-80gb" in err and not ran


@pytest.mark.parametrize("args, message", [
    (["--world-size", "2", "--max-world-size", "4"], "not both"),
    (["--world-size", "2", "--device", "cpu"], "times sharded plans on GPU presets"),
])
def test_plan_world_size_flags_refused_with_the_fix(capsys, args, message):
    from memfit.cli.main import main
    assert main(["plan", SMALL, "-b", "8", "--seq-len", "32", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_plan_chosen_because_the_trace_limit_came_first_says_so(capsys):
    """NOTE [ The trace limit before a faster plan ]: the smallest plan traced, chosen where it fits when the walk
    stops at --max-traces, is not the fastest that fits: the reason and a note say so, with the flag to trace more."""
    assert main(["plan", SPEC, "-b", "8", "--seq-len", "64", "--device", "h100-80gb", "--budget", "597MiB",
                 "--max-traces", "1", "--optimizers", "adamw", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["trace_limited"] and out["chosen"]["reason"].startswith("the smallest plan found")
    assert "the trace limit (1) came first" in out["chosen"]["reason"] and "--max-traces 2" in out["notes"][-1]
