"""The end of a run: report.json with what each technique saved (checked against measurements), the
memory timeline, the progress display, and DataLoader batches (workers give the same data)."""

import io
import json

import pytest
import torch

from memfit.plans import Plan
from memfit.training.data import ByteCorpus, text_batches
from memfit.training.loop import train
from memfit.training.progress import Progress
from memfit.training.report import render, without_each_technique
from tests.helpers import measured

LM = "gpt2:n_layer=4,n_embd=64,n_head=4,n_positions=128"


@pytest.mark.slow  # (keeps the default suite under 10 minutes)
def test_report_says_what_each_technique_saved_and_measurement_agrees(tmp_path):
    plan = Plan(checkpointing="blocks", micro_batch_size=2)
    r = train(LM, plan=plan, steps=2, out=tmp_path, seq_len=128, batch_size=4, progress=False)
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "memory-timeline.png").stat().st_size > 10_000
    rows = {row["technique"]: row for row in report["technique_savings"]}
    assert set(rows) == {"checkpointing blocks", "micro-batches"}
    assert report["measured_peak_bytes"] == r.measured_peak_bytes
    # the saving the report claims for checkpointing, measured: the profiler's peak with and without it
    with_it = measured(LM, plan, batch_size=4, seq_len=128).peak_bytes
    without = measured(LM, plan.replace(checkpointing="none"), batch_size=4, seq_len=128).peak_bytes
    claimed = rows["checkpointing blocks"]["saved_bytes"]
    assert claimed > 0
    assert abs(claimed - (without - with_it)) <= 0.02 * (without - with_it), (claimed, without - with_it)
    assert "checkpointing blocks" in render(report) and "saved" in render(report)


def test_every_technique_of_a_plan_is_ablated_once():
    plan = Plan(precision="bf16", checkpointing="selective", optimizer="adafactor", optimizer_in_backward=True,
                offload=("activations",), loss_chunks=4, attention="chunked", ema={"device": "cpu"})
    names = [name for name, _ in without_each_technique(plan)]
    assert names == ["precision bf16", "checkpointing selective", "optimizer adafactor", "optimizer in backward",
                     "offload activations", "chunked loss (4)", "attention chunked", "EMA on cpu"]
    for name, without in without_each_technique(plan):
        changed = {k for k, v in without.to_dict().items() if v != plan.to_dict()[k]}
        assert len(changed) == 1, (name, changed)


def test_progress_writes_few_lines_to_a_log():
    out = io.StringIO()
    with Progress(100, budget_bytes=1 << 30, stream=out, every_seconds=3600) as bar:
        for i in range(1, 101):
            bar.update(i, loss=1.0 / i, rate=1000.0, unit="tokens", peak_bytes=512 << 20)
        bar.note("step 7: out of memory in forward; retrying")
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines[:2]] == ["1/100", "100/100"] and len(lines) == 3
    assert "peak 512.00 MiB / 1.00 GiB" in lines[0]


def test_worker_processes_give_the_same_batches_in_the_same_order():
    corpus = ByteCorpus(None, cap_bytes=1 << 16)
    plain = list(text_batches(corpus, 31, 4, first_sample=5, num_batches=6))
    workers = list(text_batches(corpus, 31, 4, first_sample=5, num_batches=6, workers=2))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(plain, workers)) and len(workers) == 6
    # sample s is the 32 bytes at s * 32 (wrapping)
    n = corpus.data.numel()
    expected = corpus.data[(torch.arange(32) + 7 * 32) % n]
    assert torch.equal(plain[0]["input_ids"][2], expected)


def test_progress_draws_a_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    with Progress(10, budget_bytes=1 << 30, stream=out) as bar:
        for i in range(1, 11):
            bar.update(i, loss=2.5, rate=1234.0, unit="tokens", peak_bytes=256 << 20)
        bar.note("step 3: out of memory in backward; retrying")
    text = out.getvalue()
    assert "10/10" in text and "loss 2.5000" in text and "1,234 tokens/s" in text and "256.00 MiB / 1.00 GiB" in text
    assert "step 3: out of memory" in text and "━" in text  # the bar itself
