"""memfit.memory.deep_stream: a plan's allocations at full depth from its two shallow traces, and
the reserved bytes they give, against the full trace's."""

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from memfit.memory.allocator import replay as replay_trace
from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.cuda.reduce import STAGING_BUFFER
from memfit.memory.deep_stream import Stream, deepen, from_tracker, replay, sorted_free_runs, step_events
from memfit.memory.faketrace import run_tracked
from memfit.memory.report import step_window, traced_device
from memfit.memory.stream_sizes import widen
from memfit.memory.stretches import _at_run_ends, first_use, inserted, joined, unstraddled
from memfit.planner.shallow import depths, shallow_workload
from memfit.planner.space import model_facts
from memfit.planner.stacks import stacks_of
from memfit.planner.trace_job import Tracer
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target
from memfit.techniques.checkpointing import find_blocks

DEEP = "gpt2:n_layer=6,n_embd=128,n_head=4,vocab_size=1000,n_positions=64"


def _trace(target, depth=None):
    """The stream of a trace at ``depth`` blocks (None: full), and what the trace's own replay gives."""
    if depth is not None:
        target = dataclasses.replace(target, workload=shallow_workload(target.workload, depth))
    with silenced_warnings():
        tracker = run_tracked(target, fake=True).tracker
    where, streams = traced_device(target.device, "fake", target.tensor_device), getattr(tracker, "side_streams", None)
    peak, reserved, _ = replay_trace(tracker, where, step_window(tracker, STEADY_STEP), streams)
    with torch.device("meta"):
        containers = tuple(name for name, _ in find_blocks(target.workload.model()))
    return from_tracker(tracker, where, streams, containers), (peak, reserved)


@pytest.mark.parametrize("fields,same_events", [
    ({"precision": "bf16"}, True),  # autocast drops its cast weights in a hash map's order
    ({"precision": "bf16-pure", "optimizer": "adamw8bit"}, True),
    ({"precision": "bf16", "offload": ("optimizer_states",)}, True),  # a side stream
    # clipped: the stacked norms, one per gradient (NOTE [ An allocation sized by the depth ]; no stream before)
    ({"precision": "bf16-pure", "max_grad_norm": 1.0}, True),
    pytest.param({"precision": "bf16-pure", "checkpointing": "selective", "optimizer_in_backward": True}, True,
                 marks=pytest.mark.slow),
    # the optimizer's foreach steps order a few frees differently at full depth (the bytes do not move)
    pytest.param({"precision": "bf16-pure", "checkpointing": "blocks", "loss_chunks": 8}, False, marks=pytest.mark.slow),
])
def test_shallow_allocations_replayed_at_full_depth_give_the_full_traces_reserved_bytes(fields, same_events):
    """The deep stream's allocated peak and reserved bytes are the full trace's, to the byte; and
    so (but where marked) are the step's allocations and frees, in order, and who frees what."""
    target = Target.resolve(DEEP, Plan(**fields), 8, "h100-80gb", seq_len=64)
    d, e = depths(target.plan, 6)
    (a, _), (b, _), (full, truth) = _trace(target, d), _trace(target, e), _trace(target)
    deep = deepen(a, b, d, e, 6)
    assert deep is not None
    assert replay(deep, STEADY_STEP) == truth  # allocated peak, reserved bytes
    if same_events:
        step = [t for t in deep.tokens if t[0] != "mark" and t[3] != "setup"]  # (the model's build differs)
        assert step == [t for t in full.tokens if t[0] != "mark" and t[3] != "setup"]
        assert _who_frees_what(deep) == _who_frees_what(full)


def test_a_workspace_the_top_blocks_backward_makes_is_made_once_at_full_depth():
    """With every second block checkpointed, a LoRA's top block is plain: the autograd thread's first matmul
    (its cuBLASLt workspace, never freed) is in that block's backward, the block the deeper trace inserts.
    Deepened, the workspace is made once, where the full trace makes it (NOTE [ A workspace made on first
    use ]); before, the streams had no deep stream, and the plan cost a full trace."""
    plan = Plan(precision="bf16-pure", checkpointing="blocks:every=2", adapter="lora:r=8")
    target = Target.resolve(DEEP, plan, 8, "rtx4090", seq_len=64)
    d, e = depths(target.plan, 6)
    (a, _), (b, _), (full, truth) = _trace(target, d), _trace(target, e), _trace(target)
    deep = deepen(a, b, d, e, 6)
    assert deep is not None and replay(deep, STEADY_STEP) == truth
    assert [t for t in deep.tokens if first_use(t)] == [t for t in full.tokens if first_use(t)] != []


def test_a_free_that_moves_with_depth_leaves_no_stream():
    """With a chunked loss and fp32 master weights, a small cast gradient is freed where the
    autograd engine gets to it, later in the backward the deeper the model: no insertion gives
    that, so there is no deep stream (the planner traces the full depth), or, where the two shallow
    traces happen to agree, one that gives the full trace's bytes."""
    target = Target.resolve(DEEP, Plan(precision="bf16", checkpointing="blocks", loss_chunks=8), 8, "h100-80gb",
                            seq_len=64)
    (a, _), (b, _) = _trace(target, 2), _trace(target, 3)
    deep = deepen(a, b, 2, 3, 6)
    if deep is not None:
        # (autocast drops its cast weights in a hash map's order, which differs between processes: in
        # one CI run of ten the free did not move between these two depths and a stream was found.
        # A stream found must then be the full trace's, to the byte.)
        _, truth = _trace(target)
        assert replay(deep, STEADY_STEP) == truth


def _who_frees_what(stream):
    """Each run of frees in the step (after the model's build) as the allocations it frees (their
    order in a run does not matter): one of the step by its place among them, one of the build by
    its token."""
    place, out, run = {}, [], []
    for i, tok in enumerate(stream.tokens):
        if tok[0] == "+" and tok[3] != "setup":
            place[i] = len(place)
        if tok[0] == "-" and stream.phases[i] != "setup":
            ja = stream.frees[i]
            run.append(place.get(ja, ("build", stream.tokens[ja][1])))  # (its op differs: meta or init)
            continue
        if run:
            out.append(sorted(run, key=str))
            run = []
    return out + ([sorted(run, key=str)] if run else [])


def _stream(events):
    """A stream from ("+", nbytes) / ("-", index of the allocation) / ("mark", name, step) events."""
    tokens, frees, phases, phase = [], [], [], "setup"
    for ev in events:
        if ev[0] == "mark":
            tokens.append(ev)
            frees.append(-1)
            phase = ev[1] if ev[1] not in ("step", "end") else phase
        elif ev[0] == "+":
            tokens.append(("+", ev[1], 0, phase, 2, "op"))
            frees.append(-1)
        else:
            tokens.append(("-",) + tokens[ev[1]][1:])
            frees.append(ev[1])
        phases.append(phase)
    return Stream(tokens, frees, phases)


def test_the_order_of_a_run_of_frees_does_not_change_what_the_allocator_holds():
    """deep_stream sorts each run of frees (some runs, like autocast's cache, come in a hash map's
    order): the caching-allocator model ends a run in the same state whatever its order."""
    rng = random.Random(0)
    sizes = [rng.choice([512, 4096, 1 << 20, 3 << 20, 12 << 20, 25 << 20]) for _ in range(60)]
    for _ in range(20):
        head = [("mark", "step", 2), *(("+", n) for n in sizes)]
        run = [("-", 1 + i) for i in rng.sample(range(60), 40)]
        tail = [("+", n) for n in sizes[:30]] + [("mark", "end", 2)]
        shuffled = run[:]
        rng.shuffle(shuffled)
        assert replay(_stream(head + run + tail), 2) == replay(_stream(head + shuffled + tail), 2)


def test_streams_that_differ_in_the_step_by_more_than_insertions_have_no_deep_stream():
    a = _stream([("mark", "step", 2), ("mark", "forward", 2), ("+", 4096), ("+", 8192), ("-", 2), ("-", 3)])
    b = _stream([("mark", "step", 2), ("mark", "forward", 2), ("+", 4096), ("+", 8192), ("+", 8192), ("-", 2),
                 ("-", 3), ("-", 4)])
    deep = deepen(a, b, 2, 3, 5)  # one more 8192 block per depth: three more at 5
    assert deep is not None and [t[1] for t in deep.tokens if t[0] == "+"] == [4096] + [8192] * 4
    changed = _stream([("mark", "step", 2), ("mark", "forward", 2), ("+", 4096), ("+", 16384), ("-", 2), ("-", 3)])
    assert deepen(a, changed, 2, 3, 5) is None


def test_the_planner_traces_what_a_wrong_deep_stream_ruled_out(monkeypatch):
    """A plan ruled out by its reserved bytes at full depth is checked against the chosen plan's
    full trace: here the deep streams are made to claim twice the budget for every plan, the walk
    finds nothing, traces the plans they ruled out, and chooses what it chooses without them."""
    from memfit.planner.baseline import Baseline
    from memfit.planner.search import plan
    from memfit.planner.space import SearchSpace
    from memfit.planner.traces import TraceBook

    space = SearchSpace(values={"precision": ["bf16"], "checkpointing": ["none", "blocks"]}, micro_batches=[8])
    kwargs = dict(device="h100-80gb", batch_size=8, seq_len=64, budget="20GiB")
    # (the walk decides here: the default plan is not confirmed before it, NOTE [ Work-adding values
    # when the default plan fits ])
    monkeypatch.setattr(Baseline, "_may_fit_alone", lambda self: False)
    truth = plan(DEEP, space=space, **kwargs)
    assert truth.chosen is not None and not any("full depth" in n for n in truth.notes)
    monkeypatch.setattr(TraceBook, "deep_used", lambda self, p: 2 * self.budget.bytes)
    lied = plan(DEEP, space=SearchSpace(values={k: list(v) for k, v in space.values.items()}, micro_batches=[8]),
                **kwargs)
    assert lied.chosen.plan == truth.chosen.plan and lied.chosen.used_bytes == truth.chosen.used_bytes
    assert any("ruled out by their reserved bytes at full depth" in n for n in lied.notes)


def _blocks_stream(depth, losses):
    """A forward and backward of ``depth`` blocks, each making a cast weight, an activation, a
    temporary freed by the next block and an output; autocast's cast weights all freed at the end
    of the forward (a sorted run), the activations by each block's backward, a gradient per block."""
    tokens, frees, phases, blocks, live = [], [], [], [], {}

    def mark(name, phase):
        tokens.append(("mark", name, 2)), frees.append(-1), phases.append(phase), blocks.append(-1)

    def alloc(key, size, phase, module, block):
        live[key] = len(tokens)
        tokens.append(("+", size, 0, phase, 2, "op", module)), frees.append(-1), phases.append(phase)
        blocks.append(block)

    def free(key, phase):
        ja = live.pop(key)
        tokens.append(("-",) + tokens[ja][1:]), frees.append(ja), phases.append(phase), blocks.append(-1)

    mark("step", "setup")
    mark("forward", "forward")
    for k in range(depth):
        alloc(("w", k), 12 << 20, "forward", "layers.#.w", k)
        alloc(("a", k), 5 << 20, "forward", "layers.#.mlp", k)
        if k:
            free(("t", k - 1), "forward")
        alloc(("t", k), 1 << 20, "forward", "layers.#.tmp", k)
        alloc(("h", k), 3 << 20, "forward", "layers.#.out", k)
    free(("t", depth - 1), "forward")
    alloc("norm", 7 << 20, "forward", "norm", -1)  # (the final norm and the loss: not blocks)
    for x in range(losses):
        alloc(("loss", x), (9 + x) << 20, "forward", "lm_head", -1)
    for k in range(depth):
        free(("w", k), "forward")
    mark("backward", "backward")
    free("norm", "backward")
    for k in reversed(range(depth)):
        alloc(("g", k), 6 << 20, "backward", "", -1)
        free(("a", k), "backward")
        free(("h", k), "backward")
        free(("g", k), "backward")
    mark("end", "backward")
    return sorted_free_runs(Stream(tokens, frees, phases, blocks))


@pytest.mark.parametrize("d,e,full", [(1, 2, 5), (2, 3, 5), (3, 4, 6), (2, 4, 8)])
@pytest.mark.parametrize("losses", [0, 3, 12])  # (they move where the diff puts the inserted free)
def test_a_sorted_run_of_frees_is_deepened_block_by_block(d, e, full, losses):
    """The cast weights freed together at the end of the forward: whichever of them the diff calls
    inserted, each block's is freed once, and the deep stream is the deeper stream itself."""
    deep = deepen(_blocks_stream(d, losses), _blocks_stream(e, losses), d, e, full)
    truth = _blocks_stream(full, losses)
    assert deep is not None and deep.tokens == truth.tokens and deep.frees == truth.frees


def test_shallow_models_cut_from_the_planner_s_meta_model_are_built_as_the_plan_builds():
    """The planner cuts its shallow models from the model it built on the meta device in fp32;
    bf16-pure builds in bf16. A shallow model copied from the fp32 one put an fp32 build in the
    trace, and the build's stretch, repeated at full depth, counted the fp32 model among the
    reserved bytes (Llama-2-7B: 25.99 GiB against the full trace's 14.55)."""
    from memfit.planner.space import model_facts
    wide = "llama:num_hidden_layers=6,hidden_size=1024,intermediate_size=2816,num_attention_heads=8," \
           "num_key_value_heads=8,vocab_size=1000"
    target = Target.resolve(wide, Plan(precision="bf16-pure", checkpointing="blocks", optimizer_in_backward=True,
                                       offload=("optimizer_states",)), 1, "rtx4090", seq_len=64)
    meta = model_facts(target.workload).model
    d, e = depths(target.plan, 6)
    with torch.device("meta"):
        containers = tuple(name for name, _ in find_blocks(target.workload.model()))
    streams = []
    for depth in (d, e):
        shallow = dataclasses.replace(target, workload=shallow_workload(target.workload, depth, meta=meta))
        with silenced_warnings():
            tracker = run_tracked(shallow, fake=True).tracker
        where = traced_device(shallow.device, "fake", shallow.tensor_device)
        streams.append(from_tracker(tracker, where, getattr(tracker, "side_streams", None), containers))
    _, truth = _trace(target)
    assert replay(deepen(*streams, d, e, 6), STEADY_STEP) == truth


def test_widen_draws_each_size_on_its_line_and_refuses_what_is_not_one():
    """NOTE [ Allocations at another batch ]: the same events at two batches, each size on its line
    (a weight's constant, an activation's x times a sample's); an allocation the build made once in
    one trace only is kept; a size off the line of whole bytes, or another event in the step, is no
    stream."""
    def at(n, extra_setup=False, odd=0):
        k = 1 + extra_setup
        s = _stream([*[("+", 4096)] * k, ("mark", "step", 2), ("mark", "forward", 2), ("+", 1000 * n + odd),
                     ("+", 8192), ("-", k + 2), ("-", k + 3)])
        if extra_setup:  # (a cache the process made on first use: another op)
            s.tokens[0] = ("+", 8, 0, "setup", 2, "lift_fresh")
        return s
    a, b = at(2, extra_setup=True), at(3)
    wide = widen(a, b, 2, 3, 10)
    assert wide is not None and [t[1] for t in wide.tokens if t[0] == "+"] == [4096, 10000, 8192]
    assert sorted(f for f in wide.frees if f >= 0) == [3, 4]  # (both step allocations freed, in size order)
    assert widen(a, at(5, odd=1), 2, 5, 10) is None  # 1 byte in 3 samples: not whole bytes at 10
    changed = _stream([("+", 4096), ("mark", "step", 2), ("mark", "forward", 2), ("+", 3000), ("+", 8192),
                       ("+", 64), ("-", 3), ("-", 4)])
    assert widen(a, changed, 2, 3, 10) is None  # (one more allocation in the step)


def test_a_cache_the_shallower_trace_made_first_in_its_process_does_not_hide_a_blocks_build():
    """The shallower trace ran first in its worker: two caches made on first use (8 bytes each) sit in
    its build where the deeper trace inserts one more block's weights. The diff calls that stretch a
    replacement; it is still the block's build, repeated at full depth (it was dropped, and Llama-2-7B's
    LoRA weights with it: 14 MiB of reserved bytes short of the full trace)."""
    def build(blocks, caches):
        s = _stream([*[("+", 8)] * caches, *[("+", 262144)] * blocks, ("mark", "step", 2), ("mark", "forward", 2),
                     ("+", 4096), ("-", caches + blocks + 2)])
        s.tokens[:caches] = [("+", 8, 0, "setup", 2, "lift_fresh")] * caches
        s.tokens[caches:caches + blocks] = [("+", 262144, 0, "setup", 2, "empty")] * blocks
        return s
    first_in_process = build(2, 2)
    for shallower in (first_in_process, build(2, 0)):
        deep = deepen(shallower, build(3, 0), 2, 3, 5)
        assert deep is not None and sum(t[1] == 262144 for t in deep.tokens if t[0] == "+") == 5


def test_side_streams_are_numbered_by_first_use_not_by_the_process():
    """A process numbers its CUDA streams on, trace after trace (FSDP2's all-gather streams were 10 in
    a worker's first trace and 18 in its second): the two depths of a plan traced in one process then
    differed in every side-stream allocation, and the planner traced the plan at full depth."""
    from types import SimpleNamespace

    def tracker(first_stream):
        rec = [SimpleNamespace(device="cuda:0", nbytes=n, phase="forward", step=2, op="empty", module="")
               for n in (4096, 8192, 512)]
        state = SimpleNamespace(records=rec, events=[(0, 1), (1, 1), (2, 1), (1, -1), (0, -1)],
                                marks=[("step", 2, 0), ("forward", 2, 0)])
        return SimpleNamespace(state=state), {1: first_stream, 2: first_stream + 2}

    (t1, s1), (t2, s2) = tracker(10), tracker(18)
    one, two = from_tracker(t1, "cuda:0", s1), from_tracker(t2, "cuda:0", s2)
    assert one == two and [t[2] for t in one.tokens if t[0] == "+"] == [0, 1, 2]



def _lora_like(blocks: int) -> Stream:
    """A step whose first block is unlike the rest: each block casts a weight and saves it for the
    backward, but the first, whose input needs no gradient, frees its cast at the end of the forward."""
    tokens, frees, phases, owner = [], [], [], []
    made = {}

    def event(tok, phase, frees_=-1, block=-1):
        tokens.append(tok), frees.append(frees_), phases.append(phase), owner.append(block)

    def alloc(kind, size, phase, block):
        made[(kind, block)] = len(tokens)
        event(("+", size, 0, phase, 1, kind, "h.#" if phase == "forward" else ""), phase, block=block)

    def free(kind, block):
        j = made.pop((kind, block))
        event(("-", *tokens[j][1:]), phase_now[0], frees_=j)

    phase_now = ["setup"]
    for name in ("step", "forward"):
        event(("mark", name, 1), "forward")
    phase_now[0] = "forward"
    for k in range(blocks):
        alloc("cast", 8, "forward", k)
        alloc("mm", 32, "forward", k)
    free("cast", 0)
    event(("mark", "backward", 1), "backward")
    phase_now[0] = "backward"
    for k in reversed(range(blocks)):
        alloc("grad", 32, "backward", -1)
        free("mm", k)
        if k:
            free("cast", k)
        free("grad", -1)
    event(("mark", "end", 1), "backward")
    return Stream(tokens, frees, phases, owner)


def test_a_first_block_unlike_the_rest_is_not_the_copied_one():
    """The diff of the shallow streams takes the first block's forward for the inserted one; but the first
    block frees its cast at the end of the forward (a LoRA's first block: its input needs no gradient), and
    the copies of it would free the last block's cast twice. The stretches slid to a middle block, and the
    first block's free kept where it was made, give the deeper step's allocations and who frees what (NOTE
    [ Which copy is inserted ]; a fp16 LoRA of Llama-2-7B at one sample took a full trace before)."""
    deep = deepen(_lora_like(2), _lora_like(3), 2, 3, 6)
    assert deep is not None
    full = _lora_like(6)
    assert deep.tokens == full.tokens
    assert _who_frees_what(deep) == _who_frees_what(full)


def test_a_reductions_staging_buffer_is_sized_at_another_batch_off_the_line():
    """A bias gradient's reduction on an H100 splits each output's inputs over more blocks as the batch
    grows, in steps (memfit.memory.cuda.reduce): its staging buffer is not on the line through two
    batches. ``widen`` sizes it from its input's shape drawn on the line, and gives the traced step."""
    # (64 features, 64 tokens: past 32 samples, a [tokens, 64] bias gradient's staging buffer grows every
    # second sample)
    target = Target.resolve("gpt2:n_layer=6,n_embd=64,n_head=4,vocab_size=1000,n_positions=64",
                            Plan(precision="bf16-pure"), 1, "h100-80gb", seq_len=64)
    (a, _), (b, _), (c, _) = (_trace(dataclasses.replace(target, batch_size=n), 2) for n in (40, 41, 46))
    staging = [(u[1], v[1], w[1]) for u, v, w in zip(step_events(a), step_events(b), step_events(c))
               if u[0] == "+" and u[5] == STAGING_BUFFER]
    assert any(w != u + (v - u) * 6 for u, v, w in staging)  # (off the line: what the test is about)
    wide = widen(a, b, 40, 41, 46)
    assert wide is not None and step_events(wide) == step_events(c)


def _foreach_like(blocks: int, sizes: tuple[int, ...] = (4096,)) -> Stream:
    """An optimizer step whose foreach op allocates one output per tensor of each block (of ``sizes``), then
    frees them all."""
    tokens, frees, phases = [("mark", "step", 1), ("mark", "optimizer", 1)], [-1, -1], ["optimizer"] * 2
    tokens.append(("+", 64, 0, "optimizer", 1, "_to_copy", ""))  # (a scalar before the run)
    frees.append(-1)
    phases.append("optimizer")
    made = []
    for _ in range(blocks):
        for size in sizes:
            made.append(len(tokens))
            tokens.append(("+", size, 0, "optimizer", 1, "_foreach_sqrt", ""))
            frees.append(-1)
            phases.append("optimizer")
    for j in reversed(made):
        tokens.append(("-",) + tokens[j][1:])
        frees.append(j)
        phases.append("optimizer")
    tokens += [("-", 64, 0, "optimizer", 1, "_to_copy", ""), ("mark", "end", 1)]
    frees += [2, -1]
    phases += ["optimizer"] * 2
    return Stream(tokens, frees, phases, [-1] * len(tokens))


def test_a_blocks_outputs_and_their_frees_side_by_side_are_two_stretches():
    """The diff places the extra block's foreach output and its free side by side, at the seam of the run of
    allocations and the run of frees: copied as one stretch they would alternate at full depth; as two, the
    runs grow, as the full step's do (the fp16 optimizer step of Llama-2-7B: 2 MiB of reserved bytes)."""
    deep = deepen(_foreach_like(2), _foreach_like(3), 2, 3, 6)
    assert deep is not None
    assert deep.tokens == _foreach_like(6).tokens


def test_a_foreach_step_over_tensors_of_several_sizes_grows_each_run():
    """The same where each block's tensors have several sizes (a layer of Phi-3-mini's QLoRA: 8 matrices of 4
    sizes). Where the diff puts the extra layer's outputs and their frees side by side at the seam of the runs,
    they are two stretches (Phi-3-mini's QLoRA, whose replay was 44 MiB short of its full trace's 4.72 GB
    reserved, is exact with it); before, only runs of one size were split."""
    sizes = (98304, 98304, 98304, 294912, 98304, 524288, 262144, 98304)
    b = _foreach_like(3, sizes)
    seam = 3 + 3 * len(sizes)  # (after the scalar and three layers' outputs: the first free)
    assert _at_run_ends(b, seam - len(sizes), seam + len(sizes)) == [(seam - len(sizes), seam), (seam, seam + len(sizes))]
    forward = b._replace(phases=["forward"] * len(b.tokens))  # (a block's forward is not split so)
    assert _at_run_ends(forward, seam - len(sizes), seam + len(sizes)) == [(seam - len(sizes), seam + len(sizes))]
    deep = deepen(_foreach_like(2, sizes), b, 2, 3, 6)
    assert deep is not None and deep.tokens == _foreach_like(6, sizes).tokens


def _swapped_backward(middle: int) -> Stream:
    """A backward over swapped blocks then two resident ones: the first swapped block fetches its own weights
    and the next one's (C C), each of ``middle`` blocks after it the next one's (C), the last none; B is a
    swapped block's backward, R a resident one's."""
    c = [("+", 4096, 0, "backward", 1, "clone", "")] * 2
    body = [("+", 512, 0, "backward", 1, "mm", ""), ("+", 256, 0, "backward", 1, "add", "")]
    resident = [("+", 512, 0, "backward", 1, "mm", ""), ("+", 128, 0, "backward", 1, "mul", "")]
    tokens = [("mark", "backward", 1)] + c + c + body + (c + body) * middle + body + resident * 2
    return Stream(tokens, [-1] * len(tokens), ["backward"] * len(tokens))


def test_a_swapped_blocks_copies_the_diff_put_apart_from_its_backward_are_joined_to_it():
    """NOTE [ A block split by the diff ]: ``C C B B`` to ``C C B C B B``, the diff may insert the middle block's
    copies and the last block's backward, ``C C B [C] B [B]``; copied, the Cs would run in a row, then the Bs.
    The two are one stretch, a middle block: ``C C B [C B] B``. A stretch that repeats its neighbours (a whole
    block) is left as it is."""
    b = _swapped_backward(1)
    c, body = 2, 2
    split = [(1 + 2 * c + body, 1 + 3 * c + body), (1 + 3 * c + 2 * body, 1 + 3 * c + 3 * body)]  # ([C], the last [B])
    assert joined(b, split) == [(1 + 2 * c + body, 1 + 3 * c + 2 * body)]
    whole = [(1 + 2 * c + body, 1 + 3 * c + 2 * body), (len(b.tokens) - 2, len(b.tokens))]  # (C B, and an R)
    assert joined(b, whole) == whole


HUB_CONFIGS = json.loads((Path(__file__).parents[1] / "data" / "hub_configs.json").read_text())


def _pair_and_full(folder, repo_id: str, plan: Plan, layers: int, **sizes):
    """``repo_id``'s hub config at ``layers`` layers and the ``sizes`` given, traced as the planner's workers trace
    it: its pair (the depths, and the depth in units of its stacks), and in full."""
    config = dict(HUB_CONFIGS[repo_id], num_hidden_layers=layers, **sizes)
    (folder / "config.json").write_text(json.dumps(config))
    target = Target.resolve(str(folder), plan, 2, "rtx4090", seq_len=256)
    facts = model_facts(target.workload)
    stacks = stacks_of(facts.model)
    pair = depths(plan, stacks.full, stacks.least)
    tracer = Tracer(target, facts.model, Budget.resolve(None, target.device))
    tracer((plan, pair[0], None))  # (the first trace in a process may keep its batch past the step, then frees it later)
    return (*(tracer((plan, d, None)) for d in (*pair, None)), (*pair, stacks.full))


@pytest.mark.parametrize("swap", [0, pytest.param(12, marks=pytest.mark.slow)])  # (12: the suite under 10 minutes)
def test_a_chain_whose_first_link_another_op_makes_is_carried_to_full_depth(tmp_path, swap):
    """NOTE [ A chain's last link ] (memfit.memory.stretches): Gemma 2's last layer casts the gradient it gets
    (``_to_copy``) where the others add to theirs, so the shallower trace's last free in the backward frees a
    cast and the deeper one's an add. A LoRA of a 12-layer Gemma 2 with selective checkpointing and a chunked
    loss (every block swapped or none), as Gemma-2-9B's plans: its pair (1 and 2 units of a sliding-window and
    a global layer: NOTE [ Blocks of several kinds ] in memfit.planner.stacks) has allocations at full depth
    that replay to the full trace's allocated peak and reserved bytes, to the byte (Gemma-2-9B's LoRA swapping
    its 42 blocks: 19.08 and 19.99 GB, both exact). Before, there was none, and every batch of such a plan was
    a full trace."""
    plan = Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="selective", loss_chunks=4, swap_blocks=swap)
    a, b, full, (d, e, depth) = _pair_and_full(tmp_path, "google/gemma-2-9b", plan, 12, hidden_size=64,
                                               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=16, query_pre_attn_scalar=16, vocab_size=512)
    assert (d, e, depth) == ((2, 3, 6) if swap else (1, 2, 6))  # (two swapped blocks at the shallower depth)
    assert inserted(a.stream, b.stream) is not None
    deep = deepen(a.stream, b.stream, d, e, depth)
    assert deep is not None
    assert replay(deep, STEADY_STEP) == (full.peak_bytes, full.used_bytes - full.context_bytes)


def test_a_stretch_ending_on_an_allocation_freed_after_it_moves_back():
    """AdamW's first step makes each parameter's step count (L) and moments (Z, Z), and a step count made last
    is freed at once. A diff that placed the inserted parameter's states one event late (Z Z L, its L freed after it)
    is moved back to L Z Z (NOTE [ A stretch that ends on an allocation freed after it ]): Qwen2.5-VL-7B's
    QLoRA pair then replays at full depth to its full trace's reserved bytes (9,982,443,520) and peak (512
    bytes of 8.85 GB low); before, it kept no stream. A stretch with no such end stays where it is."""
    lift, zeros = ("+", 4, 0, "optimizer", 1, "lift_fresh", ""), ("+", 8, 0, "optimizer", 1, "zeros_like", "")
    tokens = [lift, zeros, zeros] * 2 + [lift, ("-", *lift[1:])]
    b = Stream(tokens, [-1] * 7 + [6], ["optimizer"] * 8)
    assert unstraddled(b, [(4, 7)]) == [(3, 6)]
    assert unstraddled(b, [(3, 6)]) == [(3, 6)] and unstraddled(b, [(0, 3)]) == [(0, 3)]


@pytest.mark.parametrize("expandable", [False, True])
def test_a_streams_replay_is_the_allocator_models_replay_of_its_events(expandable):
    """``replay`` of a stream gives memfit.memory.allocator.replay_events' figures for its events: the same
    peak and reserved bytes on random streams with marks, an emptied cache, side streams and frees of
    allocations made before the step, under either allocator model."""
    import random

    from memfit.memory.allocator import replay_events
    from memfit.memory.expandable import new_model
    rng = random.Random(1)
    for _ in range(40):
        tokens, frees, phases, live = [("mark", "step", 1)], [-1], ["setup"], []
        for i in range(1, 600):
            if i in (200, 400):
                tokens.append(("mark", "step", i // 200 + 1) if i == 200 else ("mark", "empty_cache", 0))
                frees.append(-1)
            elif live and rng.random() < 0.45:
                j = live.pop(rng.randrange(len(live)))
                tokens.append(("-", *tokens[j][1:]))
                frees.append(j)
            else:
                size = int(rng.choice([100, 4000, 600_000, 3 << 20, 15 << 20, 90 << 20]) * rng.uniform(0.5, 1.5))
                tokens.append(("+", size, rng.choice([0, 0, 0, 1]), "forward", 1, "op", ""))
                frees.append(-1)
                live.append(i)
            phases.append("forward")
        stream = Stream(tokens, frees, phases, None, None)

        def events(tokens=tokens, frees=frees):
            for i, tok in enumerate(tokens):
                if tok[0] == "mark":
                    if tok[1] == "empty_cache":
                        yield i, None, 0, 0, 0
                elif tok[0] == "+":
                    yield i, i, 1, tok[1], tok[2]
                else:
                    yield i, frees[i], -1, tok[1], tok[2]
        assert replay(stream, 2, expandable=expandable) == replay_events(events(), 200, model=new_model(expandable))[:2]
