"""A plan at any batch (memfit.planner.at_batch): once its line has drawn a third traced batch, the
book draws every other batch without a trace, and what it draws is what a full trace of the step at
that batch gives (``memfit estimate``, independent of the trace book); a line that misses its third
batch draws nothing. And the books of two architectures share a plan only where it traces alike
(memfit.planner.fit_books)."""

import pytest

from memfit.devices import get_device
from memfit.memory import stream_sizes
from memfit.memory.budget import Budget
from memfit.memory.deep_stream import deepen
from memfit.memory.estimate import estimate_target
from memfit.planner import at_batch
from memfit.planner.fit_books import Books
from memfit.planner.methods import parse_methods
from memfit.planner.recipes import recipes
from memfit.planner.shallow import OpsOnLine
from memfit.planner.space import model_facts
from memfit.planner.timing import time_from_ops
from memfit.planner.traces import TraceBook
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target
from memfit.workloads import load_workload

# 6 blocks: shallow pairs (2 and 3 blocks) and the deep stream, as for a 7B
LLAMA = ("llama:num_hidden_layers=6,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
         "vocab_size=512")
SEQ = 256


@pytest.fixture(scope="module")
def setting():
    workload = load_workload(LLAMA, seq_len=SEQ)
    with silenced_warnings():
        facts = model_facts(workload)
    return workload, facts


def _book(setting, card) -> TraceBook:
    workload, facts = setting
    return TraceBook(Target(workload, Plan(), 1, card), facts, Budget.of_device(card))


def _used(workload, plan: Plan, batch: int, card) -> int:
    with silenced_warnings():
        report = estimate_target(Target.resolve(workload, plan, batch, card))
    return Budget(0, card).used_bytes(report)


@pytest.mark.parametrize("method", ["lora", pytest.param("full", marks=pytest.mark.slow)])
def test_a_batch_drawn_on_the_line_is_the_full_trace_at_that_batch(setting, method):
    workload, facts = setting
    card = get_device("rtx4090")
    plan = recipes(parse_methods(method)[0], facts, card)[-1].plan
    book = _book(setting, card)
    try:
        with silenced_warnings():
            for batch in (2, 3, 5):
                book.at_batch(plan, batch)
            assert book.lines() == {at_batch.TRUSTED: 1, at_batch.BROKEN: 0}
            traces = book.traces
            drawn = book.at_batch(plan, 11)
            assert book.traces == traces  # (drawn: no trace)
            # drawn on the line of the two batches' streams at full depth where their builds are the same
            # events (a worker's first trace may build otherwise), which is the shallow streams' lines
            # deepened (NOTE [ A line drawn at full depth ])
            shallow = [stream_sizes.widen(book._traced[(plan, d, 2)].stream, book._traced[(plan, d, 5)].stream, 2, 5, 11)
                       for d in book.depths(plan)]
            deepened = deepen(*shallow, *book.depths(plan), book.depth)
            deep = book._widened_deep(plan, 2, 5, 11)
            assert book.stream_at(plan, 11) == (deep or deepened)
            assert deep is None or deep[:3] == deepened[:3]  # (tokens, frees, phases)
            book.at_batch(plan, 1)  # one sample's chunked loss views the labels two samples copy: off the line
            assert book.traces == traces + 2
            report = estimate_target(Target.resolve(workload, plan, 11, card))
        assert drawn.used_bytes == Budget(0, card).used_bytes(report)
        assert drawn.peak_bytes == pytest.approx(report.peak_bytes, rel=1e-4)  # (the replay rounds a few tensors)
        assert isinstance(drawn.ops, OpsOnLine) and len(drawn.ops) > 0  # (put on the line when first read)
        if method == "full":  # its ops, on the line: the time of the traced step
            traced = _book(setting, card)
            try:
                with silenced_warnings():
                    truth = traced.at_batch(plan, 11)
            finally:
                traced.close()
            target = Target.resolve(workload, plan, 11, card)
            assert time_from_ops(drawn.ops, target).seconds == pytest.approx(
                time_from_ops(truth.ops, target).seconds, rel=1e-3)
    finally:
        book.close()


@pytest.mark.slow  # (the fallback path; keeps the default suite near 10 minutes on 2 cores)
def test_a_line_that_misses_its_third_batch_draws_nothing(setting, monkeypatch):
    _, facts = setting
    card = get_device("rtx4090")
    plan = recipes(parse_methods("lora")[0], facts, card)[-1].plan
    widen = stream_sizes.widen

    def off_by_a_block(a, b, x_a, x_b, x, paired=None):  # one allocation 512 bytes off the line
        s = widen(a, b, x_a, x_b, x, paired)
        i = next(i for i, t in enumerate(s.tokens) if t[0] == "+" and t[3] == "forward")
        return s._replace(tokens=[*s.tokens[:i], (s.tokens[i][0], s.tokens[i][1] + 512, *s.tokens[i][2:]),
                                  *s.tokens[i + 1:]])

    monkeypatch.setattr(at_batch, "widen", off_by_a_block)
    book = _book(setting, card)
    try:
        with silenced_warnings():
            for batch in (1, 2, 3, 5):
                book.at_batch(plan, batch)
            assert book.lines() == {at_batch.TRUSTED: 0, at_batch.BROKEN: 1}
            traces = book.traces
            book.at_batch(plan, 11)
        assert book.traces == traces + 2  # (its shallow pair)
    finally:
        book.close()


@pytest.fixture
def books(setting):
    """Every architecture's trace book for the setting's model, closed after the test."""
    b = Books(*setting)
    try:
        with silenced_warnings():
            yield b
    finally:
        b.close()


def test_architectures_share_a_plan_only_where_it_traces_alike(setting, books):
    """An Ampere and a Blackwell card take an Ada card's LoRA traces, their workspaces and staging buffers
    sized for each (82 SMs, 32 MiB cuBLAS workspaces), and give what a trace on the card itself gives;
    Hopper's cuDNN attention allocates otherwise: its own book."""
    workload, facts = setting
    sm89, sm86 = get_device("rtx4090"), get_device("rtx3090")
    sm90, sm120 = get_device("h100-80gb"), get_device("rtx5090")
    lora = recipes(parse_methods("lora")[0], facts, sm89)[-1].plan
    first = books.for_plan(sm89, lora)
    assert first is books.open(sm89)
    first.at_batch(lora, 1)
    on_sm86, on_sm120 = books.for_plan(sm86, lora), books.for_plan(sm120, lora)
    assert on_sm86.source is first and on_sm120.source is first
    assert books.for_plan(sm90, lora) is books.open(sm90)
    assert books.shared == 2
    for card, answer in ((sm86, on_sm86), (sm120, on_sm120)):  # (a full trace on the card itself)
        assert answer.at_batch(lora, 2).used_bytes == _used(workload, lora, 2, card)


def test_a_card_of_the_group_with_other_sms_has_its_own_staging_buffers(setting, books):
    """The cards of one architecture share its book; a card with fewer SMs splits a reduction over fewer
    blocks, and its figures are its own (an RTX 4060's 24 SMs; the book's RTX 4090 has 128)."""
    workload, facts = setting
    sm89, small = get_device("rtx4090"), get_device("rtx4060")
    full = recipes(parse_methods("full")[0], facts, sm89)[-1].plan
    book = books.for_plan(sm89, full)
    answer = books.for_plan(small, full)
    assert answer.source is book
    # (65,536 tokens: an RMSNorm weight gradient's reduction fills 24 SMs)
    assert answer.at_batch(full, 256).used_bytes == _used(workload, full, 256, small)
    stream = book.stream_at(full, 256)
    assert stream_sizes.on_card(stream, small).tokens != stream.tokens  # (what the test is about)


def test_ops_on_the_line_are_each_op_on_the_line_through_its_two_sizes():
    import pickle

    from memfit.planner.ops import MATMUL, MEMORY, Op
    from memfit.planner.shallow import ops_line_up

    two = [Op(MATMUL, 0, 100.0, 40, "bf16", 1, 0, key=7), Op(MEMORY, 1, 0.0, 10, "", 3, 0, elements=5)]
    four = [Op(MATMUL, 0, 200.0, 60, "bf16", 1, 0, key=9), Op(MEMORY, 1, 0.0, 20, "", 3, 0, elements=9)]
    assert ops_line_up(two, four) and not ops_line_up(two, four[:1]) and not ops_line_up(two, four[::-1])
    ten = OpsOnLine(two, four, 2, 4, 10)
    assert len(ten) == 2 and ten._ops is None  # (nothing put on the line before it is read)
    assert list(ten) == [Op(MATMUL, 0, 500.0, 120, "bf16", 1, 0, key=9), Op(MEMORY, 1, 0.0, 50, "", 3, 0, elements=21)]
    assert ten[1].nbytes == 50 and ten[:1] == [ten[0]]
    assert pickle.loads(pickle.dumps(ten)) == list(ten)  # (a worker gets the list it is)
