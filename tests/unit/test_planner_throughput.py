"""Throughput beside step time: every listed plan shows tokens/s (text workloads: batch x sequence
length over the step's seconds) or samples/s, in the table, the methods table and the JSON."""

from rich.console import Console

from memfit.planner.candidate import Candidate
from memfit.planner.search import PlanResult
from memfit.plans import Plan
from memfit.report.planner import print_methods, print_plan_result


def _result(seq_len):
    chosen = Candidate(Plan(checkpointing="blocks"), 0.5, used_bytes=1 << 30)
    chosen.choose("fastest predicted plan that fits")
    slower = Candidate(Plan(optimizer="galore"), 2.0, used_bytes=None)
    slower.outrun("4.00x the chosen plan's time")
    return PlanResult(workload="llama", device="rtx4090", batch_size=2, budget_bytes=2 << 30, time_model="test",
                      chosen=chosen, candidates=[chosen, slower], seq_len=seq_len)


def _text(print_fn, *args) -> str:
    console = Console(record=True, width=250)
    print_fn(*args, console=console)
    return console.export_text()


def test_text_workloads_show_tokens_per_second():
    result = _result(2048)
    assert result.throughput(result.chosen) == 2 * 2048 / 0.5
    out = _text(print_plan_result, result)
    header = next(line for line in out.splitlines() if "ms/step" in line and "plan" in line)
    assert "8,192 tokens/s" in out and "tokens/s" in header
    assert "2,048" in out  # (the slower plan's 2 x 2048 / 2.0 s)
    ranked = result.to_json()["ranked"]
    assert [r["tokens_per_second"] for r in ranked] == [8192.0, 2048.0]
    assert "different optimizer: GaLore" in out  # (named where plans are listed)


def test_other_workloads_show_samples_per_second():
    result = _result(None)
    assert result.to_json()["chosen"]["samples_per_second"] == 4.0
    assert "4.00 samples/s" in _text(print_plan_result, result)


def test_the_methods_table_shows_throughput_too():
    from types import SimpleNamespace
    method = SimpleNamespace(name="full", trains="every weight")
    out = _text(print_methods, [(method, _result(2048), 8_000_000_000)])
    assert "tokens/s" in out and "8,192" in out


def test_the_methods_table_keeps_one_line_a_method_on_an_80_column_terminal():
    """What each method trains is said under the table (a column of sentences wrapped every row into
    five lines at 80 columns), and a memory cell is never split."""
    from types import SimpleNamespace
    none = _result(2048)
    none.chosen, none.smallest = None, Candidate(Plan(), 1.0, used_bytes=589_299_712)
    methods = [SimpleNamespace(name="lora", trains="a low-rank adapter trains; the base weights are frozen"),
               SimpleNamespace(name="qlora", trains="a low-rank adapter trains over base weights quantized to 4 bits")]
    console = Console(record=True, width=80)
    print_methods([(methods[0], _result(2048), 98_304), (methods[1], none, 98_304)], console=console)
    lines = console.export_text().splitlines()
    rows = [line for line in lines if line.startswith(("lora ", "qlora "))]
    assert len(rows) == 2 and "needs 562.00 MiB" in rows[1]
    assert "  lora: a low-rank adapter trains; the base weights are frozen" in lines
    assert all(len(line) <= 80 for line in lines if not line.startswith("note:"))


def test_the_chosen_plan_and_the_one_it_displaced_are_listed_beside_any_number_of_bigger_plans():
    """The table lists up to 12 plans: faster plans too big to fit no longer push the chosen one out
    (Qwen2.5-7B on the rtx4090 preset had 12 of them), nor the plan NOTE [ A technique pays for
    itself ] displaced."""
    from memfit.planner.candidate import Status
    result = _result(2048)
    big = []
    for i in range(15):
        c = Candidate(Plan(loss_chunks=2 + i), 0.1 + 0.01 * i, used_bytes=4 << 30)
        c.status, c.reason = Status.TOO_BIG, "needs more"
        big.append(c)
    displaced = Candidate(Plan(checkpointing="blocks", optimizer_in_backward=True), 0.499, used_bytes=1 << 30)
    displaced.status, displaced.reason = Status.NOT_WORTH, "what it adds (optimizer_in_backward=True) does not pay"
    result.candidates = [*big, displaced, *result.candidates]
    rows = [line for line in _text(print_plan_result, result).splitlines() if "GiB" in line and "ms/step" not in line]
    assert sum("too big" in r for r in rows) == 10
    assert any("not worth it" in r for r in rows) and any("chosen:" in r and "ckpt=blocks" in r for r in rows)
