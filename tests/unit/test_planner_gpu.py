"""The GPU-preset planner: shallow traces that extrapolate to the full trace, a search whose choice
is the brute-force optimum, reasons that name what the choice beat, and the worker processes."""

import pytest

from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.deep_stream import deepen, replay
from memfit.planner.search import gpu_search, plan
from memfit.planner.shallow import at_depth, depths, extrapolate_ops, shallow_workload
from memfit.planner.space import SearchSpace, model_facts
from memfit.planner.timing import trace_step
from memfit.planner.workers import SKIPPED, Workers
from memfit.plans import Plan
from memfit.target import Target
from tests.helpers import with_two_workers

DEEP = "gpt2:n_layer=6,n_embd=256,n_head=4,vocab_size=2000,n_positions=128"
DEVICE = "h100-80gb"


def _target(plan=None, batch_size=8):
    return Target.resolve(DEEP, plan or Plan(precision="bf16"), batch_size, DEVICE, seq_len=128)


def _model(target, space=None):
    """The trace book and the time model of a search (the book's workers are closed by the caller)."""
    space = space or SearchSpace(values={"precision": ["bf16"]}, micro_batches=[target.batch_size])
    book, model, _ = gpu_search(target, space, model_facts(target.workload), Budget.resolve(None, target.device))
    return book, model


def _traced_both_ways(target, pair):
    """The plan's full trace (report, step time, ops), and its shallow pair at ``pair`` traced and measured by
    a search's trace book (the two traces, what the book measured, the time model)."""
    report, full, full_ops = trace_step(target)
    book, model = _model(target)
    try:
        a, b = book._run([(target.plan, d, None) for d in pair])
        measured = book.measure(target.plan)
    finally:
        book.close()
    return report, full, full_ops, a, b, measured, model


SLOW = pytest.mark.slow  # (keeps the default suite under 10 minutes)


@pytest.mark.parametrize("fields", [
    pytest.param({"precision": "bf16"}, marks=SLOW), pytest.param({"precision": "bf16", "checkpointing": "blocks"},
                                                                 marks=SLOW),
    pytest.param({"precision": "bf16", "checkpointing": "blocks:every=2"}, marks=SLOW),
    pytest.param({"precision": "bf16", "micro_batch_size": 4}, marks=SLOW),
    pytest.param({"precision": "bf16", "offload": ("optimizer_states",)}, marks=SLOW),
    {"precision": "bf16-pure", "checkpointing": "blocks", "optimizer_in_backward": True, "loss_chunks": 8}])
def test_shallow_pair_extrapolates_to_the_full_trace(fields):
    """Traced at 2 and 3 of 6 blocks (every=2: 2 and 4), the plan's full-depth ops are the full
    trace's one for one (so the times are equal), and its allocated peak is on the line (within 2%: caching-allocator rounding; what prunes is a
    lower bound with that margin)."""
    target = _target(Plan(**fields))
    pair = depths(target.plan, 6)
    assert pair == ((2, 4) if "every=2" in str(fields.get("checkpointing")) else (2, 3))
    report, full, full_ops, a, b, measured, model = _traced_both_ways(target, pair)
    ops = extrapolate_ops(a.ops, b.ops, *pair, 6)
    assert ops is not None and len(ops) == len(full_ops) and measured.ops == ops
    assert model.seconds(target.plan) == pytest.approx(full.seconds, rel=1e-3)
    assert measured.peak_bytes == pytest.approx(report.peak_bytes, rel=0.02)
    assert measured.used_lower <= Budget.resolve(None, target.device).used_bytes(report)


def test_a_plan_offloading_the_first_half_of_the_blocks_has_a_shallow_pair():
    """NOTE [ A shallow pair of a plan that offloads the first K blocks ]: offloading 3 of 6 blocks is
    traced at 2 and 4 blocks offloading 1 and 2 of them. Its peak is on the line through them (within
    2%, as above), so is its step time (within 5%), and it keeps no stream (the pair cannot give the
    full model's order)."""
    target = _target(Plan(precision="bf16", checkpointing="blocks", offload=("activations:blocks=3",)))
    assert depths(target.plan, 6) == (2, 4) and depths(target.plan.replace(offload=("activations:blocks=4",)), 6) is None
    report, full, full_ops = trace_step(target)
    book, model = _model(target)
    try:
        a, b = book._run([(target.plan, d, None) for d in (2, 4)])
        measured = book.measure(target.plan)
    finally:
        book.close()
    assert not measured.full and a.stream is None and b.stream is None
    assert measured.peak_bytes == pytest.approx(report.peak_bytes, rel=0.02)
    assert model.seconds(target.plan) == pytest.approx(full.seconds, rel=0.05)


def test_shallow_model_keeps_its_first_blocks_and_tied_weights():
    wl = _target().workload
    calls = []
    built = wl.model

    def counted():
        calls.append(1)
        return built()
    shallow = shallow_workload(type(wl)(**{**wl.__dict__, "model": counted}), 3)
    first, second = shallow.model(), shallow.model()
    assert len(first.transformer.h) == 3 and first is not second and len(calls) == 1  # built once, copied
    assert first.lm_head.weight is first.transformer.wte.weight  # tied stays tied
    assert first.transformer.h[0].attn.c_attn.weight is not second.transformer.h[0].attn.c_attn.weight
    assert first.lm_head.weight.device.type != "meta"


def test_shallow_model_cut_from_the_planners_meta_model_is_the_one_built():
    """The planner's meta model (model_facts) is copied and cut, not built again, and left whole."""
    wl = _target().workload
    meta = model_facts(wl).model

    def refused():
        raise AssertionError("built again")
    cut = shallow_workload(type(wl)(**{**wl.__dict__, "model": refused}), 3, meta=meta).model()
    built = shallow_workload(wl, 3).model()
    assert [(n, p.shape, p.dtype) for n, p in cut.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in built.named_parameters()]
    assert cut.lm_head.weight is cut.transformer.wte.weight and len(meta.transformer.h) == 6


def test_ops_that_do_not_line_up_are_refused():
    target = _target()
    book, _ = _model(target)
    try:
        a, b = book._run([(target.plan, d, None) for d in (2, 3)])
    finally:
        book.close()
    assert extrapolate_ops(a.ops, b.ops[: len(b.ops) // 2], 2, 3, 6) is None  # a run is missing
    assert extrapolate_ops(b.ops, a.ops, 2, 3, 6) is None  # the deeper step has fewer ops


@pytest.mark.slow  # (keeps the default suite under 10 minutes)
def test_choice_is_the_brute_force_optimum_and_names_what_it_beat():
    """A small space on an H100 preset with a budget the plain plan does not fit: every plan traced
    in full (memory as ``estimate`` predicts it, time by the op-level model); the planner's choice is
    the fastest that fits, with its full trace's figures, and its reason names a faster plan that
    did not fit and the next ones."""
    target = _target()
    values = {"precision": ["bf16"], "checkpointing": ["none", "blocks"], "loss_chunks": [0, 8]}
    budget = Budget.resolve(None, target.device)
    truth = {}
    for ckpt in values["checkpointing"]:
        for chunks in values["loss_chunks"]:
            for micro in (8, 4):
                p = Plan(precision="bf16", checkpointing=ckpt, loss_chunks=chunks,
                         micro_batch_size=micro if micro != 8 else None)
                report, st, _ = trace_step(target.with_plan(p))
                truth[p] = (budget.used_bytes(report), st.seconds)
    plain = truth[Plan(precision="bf16")][0]
    limit = (plain + min(used for used, _ in truth.values())) // 2
    fitting = [p for p, (used, _) in truth.items() if used <= limit]
    assert fitting and len(fitting) < len(truth)
    best = min(fitting, key=lambda p: truth[p][1])
    space = SearchSpace(values={k: list(v) for k, v in values.items()}, micro_batches=[8, 4])
    rungs = _Rungs()
    r = plan(DEEP, budget=limit, device=DEVICE, batch_size=8, seq_len=128, space=space, progress=rungs)
    assert r.chosen.plan == best
    # where the time went (issue 49): every trace counted once, by phase and kind, and shown as it ran
    kinds = {k: n for k, (n, _) in r.trace_seconds.items() if not k.endswith("replay")}
    assert sum(kinds.values()) == r.traces and any(k.startswith("before the walk: ") for k in kinds)
    assert any(k.startswith("walk: full-depth") for k in kinds) and all(sec >= 0 for _, sec in r.trace_seconds.values())
    assert rungs.seen[0].startswith("before the walk: ") and any(t.startswith("walk: ") for t in rungs.seen)
    assert r.chosen.used_bytes == truth[best][0]
    assert r.chosen.seconds == pytest.approx(truth[best][1], rel=1e-6)
    faster = [c for c in r.candidates if c.seconds < r.chosen.seconds]
    assert faster and all(c.status in ("too big", "pruned") for c in faster)
    top = min((c for c in faster if c.status == "too big"), key=lambda c: c.seconds)
    assert f"fastest: {top.plan.short(8)}" in r.chosen.reason and "next: " in r.chosen.reason
    assert r.time_model.startswith("op-level")


class _Rungs:
    """A progress that records which rung each batch of traces was for."""

    def __init__(self):
        self.seen = []

    def rung(self, text):
        self.seen.append(text)

    def stage(self, text):
        pass

    def walk(self, *args):
        pass

    def note(self, text):
        pass

    def done(self, text):
        pass


WORKERS = """
import os, torch
from memfit.planner.workers import Workers
w = Workers(lambda job: (job * 2, os.getpid()))
out = w.map([1, 2, 3, 4])
assert [x for x, _ in out] == [2, 4, 6, 8] and all(pid != os.getpid() for _, pid in out), out
w.close()
parent = os.getpid()
w = Workers(lambda job: os._exit(1) if os.getpid() != parent else job)   # a worker dies: go on here
assert w.map([1, 2]) == [1, 2] and w.count == 1
from memfit.planner.timing import trace_step
from memfit.target import Target
trace_step(Target.resolve("mha", None, 2, "h100-80gb"))  # its backward: autograd no longer survives a fork
w = Workers(lambda job: (job * 2, os.getpid()))
out = w.map([1, 2])
assert [x for x, _ in out] == [2, 4] and all(pid == os.getpid() for _, pid in out) and w.count == 1, out
print("ok")
"""


BACKGROUND = """
import os, sys, time
from memfit.planner.workers import SKIPPED, Workers
log = sys.argv[1]
def job(name):
    start = time.time()
    time.sleep({"compile": 1.0, "queued": 0.3}.get(name.split("-")[0], 0.2))
    with open(log, "a") as f:
        f.write(name + "\\n")
    return name, start, time.time(), os.getpid()
w = Workers(job)
assert w.count == 2
(_, _, compiled, _), (_, start, _, _), _ = w.map(["compile-2", "compile-3", "other"], after={"compile-3": "compile-2"})
assert start >= compiled, (start, compiled)   # the deeper trace waited for the compile
w.map(["first"], behind=["queued-a", "queued-b", "queued-c", "queued-d", "queued-e", "queued-f"])
w.cancel()                                    # those not handed to a worker are dropped
time.sleep(1.0)
ran = [n for n in open(log).read().split() if n.startswith("queued")]
assert "queued-a" in ran and len(ran) <= 3 and "queued-f" not in ran, ran   # (the idle worker took the first)
out = w.map(["queued-a", "fresh"])            # a background job's result is taken, not run again
assert [n for n, *_ in out] == ["queued-a", "fresh"] and open(log).read().split().count("queued-a") == 1
big = lambda job, shallower: shallower[0].startswith("big")   # noqa: E731 - its deeper job is needless
out = w.map(["big-2", "ok-2", "big-3", "ok-3"], after={"big-3": "big-2", "ok-3": "ok-2"}, skip=big)
assert [o if o == SKIPPED else o[0] for o in out] == ["big-2", "ok-2", SKIPPED, "ok-3"]
assert "big-3" not in open(log).read().split()
w.close()
here = Workers(job, fork=False)               # one process: background jobs run only when asked for
assert [o if o == SKIPPED else o[0] for o in here.map(["big-2", "big-3"], after={"big-3": "big-2"}, skip=big)] == \
    ["big-2", SKIPPED]
here.map([], behind=["lazy"])
here.cancel()
assert "lazy" not in open(log).read().split() and here.map(["lazy"])[0][0] == "lazy"
print("ok")
"""


def test_workers_run_a_shared_compile_first_and_queue_jobs_in_the_background(tmp_path):
    """NOTE [ Jobs in the background, and after the compile they share ]: ``after`` starts a job only
    once the one it names has ended, and ``skip`` drops it where that one's result makes it
    needless; ``behind`` queues jobs without waiting, ``cancel`` drops those not started, and a
    later ``map`` takes a background job's result instead of running it again."""
    assert with_two_workers(BACKGROUND, str(tmp_path / "log")) == "ok"


AFFINITY = """
import os, time
from memfit.planner.workers import Workers
def job(name):
    start = time.time()
    time.sleep({"slow": 1.5, "compile": 0.5}.get(name.split("-")[0], 0.1))
    return name, start, time.time(), os.getpid()
w = Workers(job, affinity=lambda name: name.split("-")[0] if name.startswith("compile") else None)
assert w.count == 2
out = {o[0]: o for o in w.map(["slow-0", "compile-a", "compile-b", "other-1"])}
(_, _, a_end, a_pid), (_, b_start, _, b_pid) = out["compile-a"], out["compile-b"]
assert a_pid != out["slow-0"][3] and b_pid == a_pid and b_start >= a_end, out
again = w.map(["compile-c", "other-2"])
assert again[0][3] == a_pid and again[1][3] != a_pid, (again, a_pid)   # its key's process, both idle
(_, _, _, x_pid), = w.map(["compile2-x"])   # (both idle: the first process)
other, compiled = w.map(["slow-3", "compile2-y"])   # a job with no key, given first, leaves it the warm process
assert compiled[3] == x_pid and other[3] != x_pid and compiled[1] < other[2], (other, compiled, x_pid)
w.close()
print("ok")
"""


def test_a_compiling_job_runs_in_the_process_that_compiled_its_key():
    """NOTE [ A compile's traces in the process that compiled it ]: jobs of one affinity key run in
    one process, in turn (the other process runs the rest), also when both are idle, and a job
    without a key given first leaves that process to them."""
    assert with_two_workers(AFFINITY) == "ok"


def test_workers_fork_and_fall_back_where_a_worker_dies_or_autograd_cannot_follow():
    assert with_two_workers(WORKERS) == "ok"



def test_a_plan_over_the_budget_at_the_shallower_depth_is_not_traced_deeper():
    """NOTE [ The deeper trace of a plan over the budget at the shallower depth ]: measured with
    another plan, a plan whose shallower trace alone is over the budget keeps that trace's lower
    bound (no more than the pair's, and over the budget) and its estimated time; its deeper trace
    does not run. Alone, or before the walk, a plan keeps both traces."""
    plans = [Plan(precision="bf16"), Plan(precision="bf16", loss_chunks=8)]
    space = SearchSpace(values={"precision": ["bf16"], "loss_chunks": [0, 8]}, micro_batches=[8])
    (pair_book, pair_model), (book, model) = _model(_target(), space), _model(_target(), space)
    try:
        pair_model.prepare()
        pairs = {p: pair_book.measure(p) for p in plans}
        model.prepare()
        for p in plans[1:]:  # (as the walk meets it: not measured yet)
            book.measured.pop(p, None)
            for d in book.depths(p):
                book._traced.pop((p, d, None), None)
        book.budget = Budget.resolve(str(min(m.used_lower for m in pairs.values()) // 2), book.target.device)
        book.trace_shallow(plans, skip_over=True)
        m = book.measure(plans[1])
    finally:
        pair_book.close()
        book.close()
    assert book._traced[(plans[1], book.depths(plans[1])[1], None)] == SKIPPED and m.shallower_only
    assert book.budget.bytes < m.used_lower <= pairs[plans[1]].used_lower
    assert model.step(plans[1]) is None and plans[1] not in model.newly_measured()  # (its time: the estimate)


class _Recorded:
    """The model's workers, with what it queues in the background (per call) recorded."""

    def __init__(self, workers) -> None:
        self.workers, self.behinds = workers, []

    def __getattr__(self, name):
        return getattr(self.workers, name)

    def map(self, jobs, after=None, behind=(), skip=None):
        self.behinds.append(list(behind))
        return self.workers.map(jobs, after=after, behind=behind, skip=skip)


def test_the_walks_first_traces_are_queued_behind_the_measuring_and_dropped_where_the_fastest_fits():
    """NOTE [ The walk's first traces behind the measuring ]: the plans the search hands to
    ``prepare`` (the maximal ones, those with a shallow pair) and the base at each other micro-batch
    size are queued behind its traces, shallower first; where the fastest simple plan fits (here:
    the whole device), they are not queued again."""
    space = SearchSpace(values={"precision": ["bf16"], "loss_chunks": [0, 8]}, micro_batches=[8, 4])
    book, model = _model(_target(), space)
    book.workers = recorded = _Recorded(book.workers)
    ahead = Plan(precision="bf16", loss_chunks=8, checkpointing="blocks")
    try:
        model.prepare(ahead=[ahead])
        base = model.base
        (d, e) = book.depths(base)
    finally:
        book.close()
    first, *later = recorded.behinds
    assert [j for j in first if j[0] == ahead or j[2] == 4] == [(ahead, d, None), (ahead, e, None), (base, d, 4),
                                                                (base, e, 4)]
    assert any("only add work" in note for note in model.baseline.space.notes)  # (the fastest fits)
    assert later and not any(j[0] == ahead or j[2] == 4 for behind in later for j in behind)


def test_a_walk_round_replaces_the_queued_plans_and_keeps_the_base_at_other_micro_batch_sizes():
    """NOTE [ The next round's traces in the background ]: the round's plans' shallower traces (not
    one traced already) go first; a plan queued before is dropped; the base's traces at another
    micro-batch size (an estimate asks for them) stay queued, behind."""
    book, _ = _model(_target())
    workers = Workers(lambda job: None, fork=False)
    workers.count = 2  # (queues without forking: no job is run here)
    try:
        book.workers = workers
        base, (d, e) = Plan(precision="bf16"), book.depths(Plan(precision="bf16"))
        new, old, stale = Plan(precision="bf16", checkpointing="selective"), Plan(precision="bf16"), \
            Plan(precision="bf16", loss_chunks=8)
        book._traced[(old, d, None)] = RuntimeError("traced before")
        workers.start([(stale, d, None), (base, d, 4), (base, e, 4)])
        book.queue_shallowest([new, old])
        assert workers._queued == [(new, d, None), (base, d, 4), (base, e, 4)]
    finally:
        book.close()


def test_a_plan_that_fits_only_with_expandable_segments_is_chosen_with_them():
    """NOTE [ Expandable segments where they decide the fit ]: this plan's reserved bytes are 128 MiB
    with the default segments and 124 MiB with expandable ones. Under a budget between the two (with
    the context), the planner chooses it with ``allocator: expandable``, at the figure a full trace of
    that plan gives, from the default plan's own traces; above both, the plan stays as written."""
    fields = {"precision": "bf16-pure", "checkpointing": "blocks", "optimizer_in_backward": True, "loss_chunks": 8}
    target = _target(Plan(**fields))
    report = trace_step(target)[0]
    expanded = trace_step(target.with_plan(Plan(**fields, allocator="expandable")))[0]
    assert expanded.reserved_bytes == report.expandable_reserved_bytes < report.reserved_bytes
    budget = Budget.resolve(None, target.device)
    default_used, expandable_used = budget.used_bytes(report), budget.used_bytes(expanded)
    space = SearchSpace(values={k: [v] for k, v in fields.items()}, micro_batches=[8])
    r = plan(DEEP, budget=(default_used + expandable_used) // 2, device=DEVICE, batch_size=8, seq_len=128,
             space=space, field_recipes=False)
    assert r.chosen.plan == Plan(**fields, allocator="expandable") and r.chosen.used_bytes == expandable_used
    assert any("fits only with expandable segments" in n for n in r.notes)
    r = plan(DEEP, budget=default_used, device=DEVICE, batch_size=8, seq_len=128, space=space, field_recipes=False)
    assert r.chosen.plan == Plan(**fields) and r.chosen.used_bytes == default_used
    assert not any("expandable" in n for n in r.notes)


LORA8 = ("llama:num_hidden_layers=8,hidden_size=512,intermediate_size=1024,num_attention_heads=4,"
         "num_key_value_heads=4,vocab_size=500")


@pytest.mark.parametrize("swapped,pair", [(4, (4, 6)), (8, (2, 3))])
def test_a_plan_swapping_blocks_has_a_shallow_pair(swapped, pair):
    """NOTE [ A shallow pair of a plan that swaps the last N blocks ]: swapping 4 of 8 blocks is traced
    at 4 and 6 blocks swapping 2 and 3 of them (two swapped at the shallower depth), every block
    swapped at 2 and 3. The peak is on the line through them, and so is the step time (its ops
    extrapolated where every block is swapped, else the pair's times), as the full trace has them
    (within 0.1%; both exact here). The pair's allocations at full depth replay to the full trace's peak
    and reserved bytes, every block swapped (NOTE [ A block's first fetches two ]) or some (NOTE [ Two kinds of
    block, as two containers ]). (Before, each swapped plan was traced at full depth; then a plan swapping
    some blocks kept no stream, and each batch of it asked for was a full trace.)"""
    plan = Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="blocks", swap_blocks=swapped)
    target = Target.resolve(LORA8, plan, 2, DEVICE, seq_len=64)
    assert depths(plan, 8) == pair and depths(plan.replace(swap_blocks=2), 8) is None  # (period 4: 4 + 4 is 8)
    report, full, _, a, b, measured, model = _traced_both_ways(target, pair)
    assert not measured.full and a.stream is not None and b.stream is not None
    # (every block swapped: NOTE [ A block's first fetches two ]; some: NOTE [ Two kinds of block, as two containers ])
    assert replay(deepen(a.stream, b.stream, *pair, 8), STEADY_STEP) == (report.peak_bytes, report.reserved_bytes)
    assert (measured.ops is not None) == (swapped == 8)
    assert measured.peak_bytes == pytest.approx(report.peak_bytes, rel=1e-3)
    assert model.seconds(target.plan) == pytest.approx(full.seconds, rel=1e-3)


def test_a_shallow_model_swaps_the_full_models_share_of_every_stack():
    """``swap_blocks`` counts the blocks of every stack (an encoder-decoder's two): at ``d`` blocks a stack
    the plan swaps ``d * N / L``, all of both stacks where all were swapped (before: ``d``, half of them)."""
    assert at_depth(Plan(swap_blocks=24), 2, 12).swap_blocks == 4  # (2 stacks of 12: every block)
    assert at_depth(Plan(swap_blocks=18), 4, 12).swap_blocks == 6
    assert at_depth(Plan(swap_blocks=42), 2, 42).swap_blocks == 2
    assert at_depth(Plan(swap_blocks=14), 6, 42).swap_blocks == 2 and depths(Plan(swap_blocks=14), 42) == (6, 9)
    # (two swapped blocks at the shallower depth: 24 of 32 at 4 and 8, 3 and 6 of them; 19 of FLUX.1's 57 at 2 and 3 units)
    assert depths(Plan(swap_blocks=24), 32) == (4, 8) and depths(Plan(swap_blocks=19), 19) == (2, 3)
