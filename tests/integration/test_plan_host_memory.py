"""A GPU plan that keeps copies in host memory says how much, as its full trace (``memfit estimate``) found,
and is held to the training machine's memory where ``--host-memory`` gives it."""

import dataclasses
import functools
import io
import json

import pytest
from rich.console import Console

import memfit
from memfit.cli.common import given_fields
from memfit.cli.main import build_parser, main
from memfit.devices import available_host_bytes, get_device
from memfit.memory.budget import Budget
from memfit.planner.search import plan
from memfit.planner.space import model_facts
from memfit.planner.traces import TraceBook
from memfit.plans import Plan
from memfit.report.planner import print_plan_result
from memfit.target import Target
from memfit.units import fmt_bytes
from memfit.workloads import load_workload

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
    assert "host memory: " in out and "not checked against it: give --host-memory" in out


def test_a_plan_without_host_copies_says_nothing_of_host_memory(capsys):
    assert main(["plan", *ARGS, "--json"]) == 0  # (a tiny model: nothing is offloaded at 24 GB)
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert not chosen["plan"]["offload"] and chosen["host_bytes"] == 0
    assert main(["plan", *ARGS]) == 0
    assert "host memory" not in capsys.readouterr().out


# -- held to the host's memory ------------------------------------------------------------------------
OFFLOADED = [*ARGS[:-2], "--offload", "activations"]  # (checkpointing left to the planner)
parse = build_parser().parse_args


@functools.cache
def all_offloaded_host() -> int:
    """The host bytes of every activation offloaded (traced when a test asks, not while each worker collects)."""
    return memfit.estimate(SPEC, Plan(precision="bf16", checkpointing="none", offload=("activations",)),
                           batch_size=2, seq_len=64, device="rtx4090").host_peak_bytes


def test_a_host_memory_below_the_fastest_plans_host_bytes_chooses_a_plan_within_it(capsys):
    assert main(["plan", *OFFLOADED, "--json"]) == 0
    free = json.loads(capsys.readouterr().out)["chosen"]
    assert free["plan"]["checkpointing"] == "none" and free["host_bytes"] == all_offloaded_host()
    limit = all_offloaded_host() // 2
    assert main(["plan", *OFFLOADED, "--host-memory", f"{limit}B", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    chosen = out["chosen"]
    assert out["host_budget_bytes"] == limit and 0 < chosen["host_bytes"] <= limit
    plan = Plan.from_dict(chosen["plan"])
    assert plan.checkpointing != "none"  # (what the offloaded activations shrink with)
    report = memfit.estimate(SPEC, plan, batch_size=2, seq_len=64, device="rtx4090")
    assert chosen["host_bytes"] == report.host_peak_bytes  # (the chosen plan's own full trace)
    rejected = [r for r in out["ranked"] if "of host memory" in r["reason"]]
    assert rejected and all(r["host_bytes"] > limit for r in rejected)


def test_a_host_memory_below_every_plans_host_bytes_says_so_and_names_the_least():
    fixed = {"precision": "bf16", "checkpointing": "none", "loss_chunks": 0, "offload": ("activations",)}
    result = plan(SPEC, device="rtx4090", batch_size=2, seq_len=64, fixed=fixed, host_memory="64KiB", optimizers=("adamw",))
    assert result.chosen is None and result.host_budget_bytes == 64 << 10
    over = [c for c in result.candidates if "of host memory" in c.reason]
    assert over and all(c.host_bytes > 64 << 10 and c.plan.checkpointing == "none" for c in over)
    console = Console(file=io.StringIO(), width=200)
    print_plan_result(result, console)
    text = console.file.getvalue()
    assert f"{len(over)} plan(s) fit the device but not the host memory (64.00 KiB, --host-memory)" in text
    assert f"the least host memory among them is {fmt_bytes(min(c.host_bytes for c in over))}" in text


def test_a_default_value_given_as_a_flag_is_held():
    assert given_fields(parse(["plan", *OFFLOADED, "--checkpointing", "none"]), Plan(precision="bf16"))["checkpointing"] == "none"
    assert "checkpointing" not in given_fields(parse(["plan", *OFFLOADED]), Plan(precision="bf16"))


@pytest.mark.parametrize("given, why", [("lots", "malformed --host-memory 'lots'"), ("0GB", "--host-memory must be positive")])
@pytest.mark.parametrize("command", ["plan", "fit", "estimate", "estimate-on-cpu"])
def test_a_bad_host_memory_gets_one_line(capsys, given, why, command):
    args = {"fit": ["gpt2", "--devices", "rtx4090"], "estimate-on-cpu": [SPEC, "--device", "cpu"]}.get(command, ARGS)
    command = command.removesuffix("-on-cpu")
    assert main([command, *args, "--host-memory", given]) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and len(err.splitlines()) == 1


def test_the_host_memory_is_unchecked_on_a_preset_this_machines_on_a_local_gpu_and_a_share_of_it_when_given():
    card = get_device("rtx4090")
    assert Budget.resolve(None, card).with_host(None).host_bytes is None
    local = dataclasses.replace(card, name="cuda (NVIDIA GeForce RTX 4090)")
    assert 0.5 * available_host_bytes() < Budget.resolve(None, local).with_host(None).host_bytes < 2 * available_host_bytes()
    assert Budget.resolve(None, card).with_host("64GiB").host_bytes == 64 << 30
    assert Budget.resolve(None, get_device("cpu")).with_host("64GiB").host_bytes is None  # (one memory: in the budget)


# NOTE [ Host bytes from a shallow pair ] in memfit.planner.traces
DEEP = "gpt2:n_layer=8,n_embd=128,n_head=2,vocab_size=256"


@pytest.mark.parametrize("plan", [
    Plan(precision="bf16", offload=("activations:blocks=4", "optimizer_states")),
    Plan(adapter="lora:r=4", precision="bf16-pure", swap_blocks=4),
], ids=["half-the-activations-and-the-states", "lora-swapping-half-the-blocks"])
def test_a_shallow_pairs_host_bytes_are_its_full_traces(plan):
    card = get_device("rtx4090")
    workload = load_workload(DEEP, seq_len=128)
    book = TraceBook(Target(workload, Plan(), 4, card), model_facts(workload), Budget.of_device(card))
    try:
        shallow = book.measure(plan)
        assert not shallow.full
        assert shallow.host_bytes == book.confirm(plan).host_bytes > 0
    finally:
        book.close()


def test_paged_optimizer_states_the_card_has_no_room_for_count_as_host_memory():
    """A budget that leaves room for half the paged states: the other half lives on the host (memfit.memory.managed)."""
    spec, fixed = "gpt2:n_layer=2,n_embd=256,n_head=2,vocab_size=256", {"precision": "bf16", "checkpointing": "none",
                                                                         "optimizer": "adamw-paged", "loss_chunks": 0}
    report = memfit.estimate(spec, Plan(**fixed), batch_size=2, seq_len=64, device="rtx4090")
    room = Budget.of_device(get_device("rtx4090")).allocator_bytes(report) + report.managed_bytes // 2
    chosen = plan(spec, budget=room, device="rtx4090", batch_size=2, seq_len=64, fixed=fixed).chosen
    assert chosen.plan == Plan(**fixed) and report.host_peak_bytes == 0
    assert chosen.host_bytes == report.managed_bytes - report.managed_bytes // 2 > 0


def test_estimate_holds_the_host_copies_to_the_host_memory_given(capsys):
    """``memfit estimate --host-memory``: the step's host bytes (offloaded copies, and a paged optimizer's pages
    out) against the limit, on the terminal and in --json; not checked on a preset without it."""
    offloaded = [*ARGS, "--offload", "optimizer_states"]
    assert main(["estimate", *offloaded, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    need = report["host_peak_bytes"]
    assert report["host_bytes"] == need > 0 and report["host_budget_bytes"] is None and report["host_fits"] is None
    for limit, fits in ((need - 1, False), (need, True)):
        assert main(["estimate", *offloaded, "--host-memory", f"{limit}B", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["host_fits"] is fits
        assert main(["estimate", *offloaded, "--host-memory", f"{limit}B"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("on the host"))
        assert fmt_bytes(need) in line and fmt_bytes(limit) in line and ("does not" not in line) == fits  # (the table wraps "fit")
