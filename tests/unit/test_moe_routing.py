"""Mixture-of-experts routing on fake tensors (NOTE [ Routing on fake tensors ]): the per-expert
loop traces under an assumed routing, its prediction is what a real run routed that way measures
(the profiler's allocator events), the worst routing's bound is what a real run routed the worst
way measures, and runs routed by the model's own router fall between."""

import contextlib

import pytest

from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.memory.routing import BALANCED, WORST, ForcedRouting, _Layer
from memfit.plans import Plan
from memfit.workloads.small_configs import write_folder


@pytest.fixture(scope="module")
def eager_mixtral(tmp_path_factory):
    return write_folder("mixtral", tmp_path_factory.mktemp("moe"), experts_implementation="eager")


def measured(folder, plan, routing=None):
    with ForcedRouting(routing) if routing else contextlib.nullcontext():
        return profile(folder, plan, batch_size=2, seq_len=64, repeats=0)


@pytest.mark.parametrize("plan", [Plan(), pytest.param(Plan(precision="bf16", checkpointing="blocks"), marks=pytest.mark.slow)],
                         ids=["fp32", "bf16-blocks"])  # (slow: keeps the default suite under 10 minutes; bf16 blocks on MoE: test_moe_techniques)
def test_the_loop_traces_and_each_routing_is_predicted_within_one_percent(eager_mixtral, plan):
    balanced = measured(eager_mixtral, plan, BALANCED)
    assert balanced.predicted.method == "fake" and abs(balanced.error_percent) < 1.0
    worst = measured(eager_mixtral, plan, WORST)
    bound = worst.predicted.worst_routing_peak_bytes
    assert bound is not None and abs(bound - worst.peak_bytes) / worst.peak_bytes < 0.01
    assert bound > balanced.predicted.peak_bytes
    own = measured(eager_mixtral, plan)  # the model's own (random-weight) router
    assert own.peak_bytes <= bound * 1.01


def test_the_report_says_what_was_assumed_and_gives_the_bound(eager_mixtral):
    r = estimate(eager_mixtral, Plan(), batch_size=2, seq_len=64)
    assert any("routing of a mixture-of-experts loop assumed balanced (4 of 4 experts hit" in a
               for a in r.approximations)
    assert not any("scalar read" in a for a in r.approximations)  # the loop's index reads are the routing's
    share = 100 * (r.worst_routing_peak_bytes - r.peak_bytes) / r.peak_bytes
    assert r.facts[1].startswith("routing: predicted for balanced routing (about 64 of 256 (token, expert) pairs "
                                 "per expert); the worst routing (every expert hit, one of them by every token) "
                                 "peaks at ") and r.facts[1].endswith(f"({share:+.1f}%)")


def test_routing_answers():
    layer = _Layer(tokens=10, top_k=2, experts=8, capacity=None)
    layer.hit = layer.hit_count(BALANCED)
    assert layer.hit == 8 and [layer.pairs_of(BALANCED, i) for i in range(8)] == [3, 3, 3, 3, 2, 2, 2, 2]
    layer.hit = layer.hit_count(WORST)
    pairs = [layer.pairs_of(WORST, i) for i in range(layer.hit)]
    assert pairs[0] == 10 and sum(pairs) == 20 and layer.hit == 8
    few = _Layer(tokens=3, top_k=1, experts=8, capacity=None)
    assert few.hit_count(BALANCED) == 3 and few.hit_count(WORST) == 1  # top-1: every token on one expert
    capped = _Layer(tokens=10, top_k=2, experts=8, capacity=4)
    capped.hit = capped.hit_count(WORST)
    assert capped.pairs_of(WORST, 0) == 4  # tokens over an expert's capacity are dropped


@pytest.fixture(scope="module")
def jetmoe(tmp_path_factory):
    import json
    folder = tmp_path_factory.mktemp("jetmoe")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["JetMoeForCausalLM"], "model_type": "jetmoe", "hidden_size": 64, "num_hidden_layers": 2,
        "num_key_value_heads": 4, "kv_channels": 16, "intermediate_size": 128, "num_local_experts": 4,
        "num_experts_per_tok": 2, "vocab_size": 1000, "max_position_embeddings": 512}))
    return str(folder)


def test_a_router_that_reads_its_experts_token_counts_is_answered_as_each_routing_routes(jetmoe):
    """JetMoE's gating reads each expert's token count (``expert_size.tolist()``) and splits its
    tokens by them, in its experts and its attention's experts: each read was assumed 0 and the
    trace failed (a real run on the CPU measured it instead). The counts are now the routing's:
    the prediction is what a real run routed that way measures, and the bound the worst's."""
    balanced = measured(jetmoe, Plan(), BALANCED)
    assert balanced.predicted.method == "fake" and abs(balanced.error_percent) < 1.0
    assert any("assumed balanced (4 of 4 experts' token counts" in a for a in balanced.predicted.approximations)
    assert not any("scalar read" in a for a in balanced.predicted.approximations)
    assert balanced.predicted.facts[0].startswith("mixture of experts: ") and "in 4 routed layers" in balanced.predicted.facts[0]
    worst = measured(jetmoe, Plan(), WORST)
    bound = worst.predicted.worst_routing_peak_bytes
    assert bound is not None and abs(bound - worst.peak_bytes) / worst.peak_bytes < 0.01


def test_a_routers_counts():
    layer = _Layer(tokens=10, top_k=2, experts=8, capacity=None, gate=True)
    assert layer.counts(BALANCED) == [3, 3, 3, 3, 2, 2, 2, 2]
    assert layer.counts(WORST) == [10, 2, 2, 2, 1, 1, 1, 1]  # (each token's first pair on expert 0, as ForcedRouting)
    few = _Layer(tokens=2, top_k=2, experts=8, capacity=None, gate=True)
    assert few.counts(BALANCED) == [1, 1, 1, 1, 0, 0, 0, 0] and few.counts(WORST) == [2, 1, 1, 0, 0, 0, 0, 0]
