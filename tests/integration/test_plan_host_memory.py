"""A GPU plan that keeps copies in host memory says how much, as its full trace (``memfit estimate``) found."""

import json

import memfit
from memfit.cli.main import main
from memfit.plans import Plan

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256"
ARGS = [SPEC, "--seq-len", "64", "-b", "2", "--device", "rtx4090", "--precision", "bf16", "--checkpointing", "none"]


def test_a_plan_offloading_optimizer_states_reports_the_host_bytes_its_estimate_finds(capsys):
    assert main(["plan", *ARGS, "--offload", "optimizer_states", "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen["plan"]["offload"] == ["optimizer_states"]
    report = memfit.estimate(SPEC, Plan(precision="bf16", checkpointing="none", offload=("optimizer_states",)),
                             batch_size=2, seq_len=64, device="rtx4090")
    assert chosen["host_bytes"] == report.host_peak_bytes > 0
    assert main(["plan", *ARGS, "--offload", "optimizer_states"]) == 0
    out = capsys.readouterr().out
    assert "host memory: " in out and "does not check it against that machine's memory yet" in out


def test_a_plan_without_host_copies_says_nothing_of_host_memory(capsys):
    assert main(["plan", *ARGS, "--json"]) == 0  # (a tiny model: nothing is offloaded at 24 GB)
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert not chosen["plan"]["offload"] and chosen["host_bytes"] == 0
    assert main(["plan", *ARGS]) == 0
    assert "host memory" not in capsys.readouterr().out
