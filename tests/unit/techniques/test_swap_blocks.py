"""swap_blocks (memfit.techniques.swap_blocks): frozen blocks' weights in host memory, streamed in.

Bit-exact against the step without it (``torch.equal`` on every parameter after two steps, with
and without checkpointing, with fp8 base weights, with offloaded activations); the mechanism
proven by counting the copies and the swapped weights on the device at each block; memory against
the profiler's allocator events on a small Flux; host bytes against the model's own parameters.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from helpers import assert_same_training, run_steps
from memfit.devices import get_device
from memfit.errors import UserError
from memfit.memory.estimate import estimate
from memfit.memory.measure import profile
from memfit.planner.ops import H2D, SIDE_STREAM
from memfit.planner.roofline import H100
from memfit.planner.shallow import depths
from memfit.planner.space import block_input_bytes, default_space, model_facts
from memfit.planner.timing import time_from_ops, trace_step
from memfit.plans import Plan
from memfit.step import build_step
from memfit.target import Target
from memfit.techniques.base_weights import least_weight_bytes
from memfit.techniques.swap_blocks import BlockSwapper, model_blocks
from memfit.workloads import load_workload

pytest.importorskip("diffusers")
pytest.importorskip("peft")

FLUX = ("dit-flux:num_layers=2,num_single_layers=3,attention_head_dim=16,num_attention_heads=2,"
        "joint_attention_dim=32,pooled_projection_dim=16,in_channels=16,axes_dims_rope=4/6/6")
WIDE = ("dit-flux:num_layers=2,num_single_layers=3,attention_head_dim=64,num_attention_heads=4,"
        "joint_attention_dim=32,pooled_projection_dim=16,in_channels=16,axes_dims_rope=8/28/28")
"""Weights large beside the activations at 64 px: where swapping shows on the device peak."""
BIG = ("dit-flux:num_layers=2,num_single_layers=3,attention_head_dim=128,num_attention_heads=8,"
       "joint_attention_dim=64,pooled_projection_dim=16,in_channels=16,axes_dims_rope=16/56/56")
BLOCKS = 5


def _frozen_bytes(spec: str, plan: Plan, count: int) -> int:
    """Bytes of the frozen parameters of the last ``count`` blocks, from a step built without swap."""
    step = build_step(load_workload(spec, resolution=64), plan, 1, "cpu")
    return sum(p.numel() * p.element_size() for b in model_blocks(step.model)[-count:]
               for p in b.parameters() if not p.requires_grad)


@pytest.mark.parametrize("fields", [{}, {"checkpointing": "blocks"}, {"base_weights": "fp8"},
                                    pytest.param({"offload": ("activations",)}, marks=pytest.mark.slow),
                                    pytest.param({"precision": "bf16"}, marks=pytest.mark.slow)])
def test_swapped_training_is_bit_exact(fields):
    wl = load_workload(FLUX, resolution=64)
    plain = run_steps(wl, Plan(adapter="lora:r=4", **fields), steps=2, batch_size=2, seq_len=None)
    swapped = run_steps(wl, Plan(adapter="lora:r=4", swap_blocks=BLOCKS, **fields), steps=2, batch_size=2,
                        seq_len=None)
    assert_same_training(plain, swapped)


def test_each_swapped_weight_is_copied_in_before_forward_and_backward_and_at_most_two_blocks_are_there():
    """Counted on a real step: every frozen weight of the 3 swapped blocks is copied to the device twice
    (forward, backward), and when any block starts, at most two swapped blocks' weights are not their
    host copies."""
    wl = load_workload(FLUX, resolution=64)
    step = build_step(wl, Plan(adapter="lora:r=4", swap_blocks=3), 2, "cpu")
    blocks = model_blocks(step.model)
    swapper = next(h.__self__ for h in step._before_update if isinstance(getattr(h, "__self__", None), BlockSwapper))
    hosts = {k: [(p, h.untyped_storage()._cdata) for p, h in pairs] for k, pairs in swapper.weights.items()}
    assert sorted(hosts) == [2, 3, 4] and all(not p.requires_grad for pairs in hosts.values() for p, _ in pairs)
    there_at_starts = []

    def count(*_):
        there_at_starts.append(sum(any(p.untyped_storage()._cdata != h for p, h in pairs) for pairs in hosts.values()))
    for b in blocks:
        b.register_forward_pre_hook(count)
        b.register_full_backward_pre_hook(count)
    copies = []
    to_device = swapper.placement.to_device
    swapper.placement.to_device = lambda host, device: copies.append(host.untyped_storage()._cdata) or \
        to_device(host, device)
    step(wl.batch(2))
    weights = sorted(h for pairs in hosts.values() for _, h in pairs)
    assert sorted(copies) == sorted(weights * 2)
    assert max(there_at_starts) <= 2 and len(there_at_starts) == 2 * len(blocks)
    assert all(p.untyped_storage()._cdata == h for pairs in hosts.values() for p, h in pairs)  # (all back after the step)


@pytest.mark.parametrize("fields", [{"swap_blocks": 3},  # (with fp8 base weights: slow, keeps the default suite under 10 minutes)
                                    pytest.param({"swap_blocks": BLOCKS, "base_weights": "fp8", "precision": "bf16-pure",
                                                  "checkpointing": "blocks"}, marks=pytest.mark.slow)])
def test_swap_predicted_within_1pct_of_the_profiler(fields):
    """On a CPU the host is the device: the profiler's peak is device and host bytes together."""
    r = profile(FLUX, Plan(adapter="lora:r=4", **fields), batch_size=2, resolution=128, repeats=0)
    assert r.predicted.method == "fake" and r.predicted.host_peak_bytes > 0
    assert abs(r.error_percent) <= 1.0, (fields, r.predicted.process_peak_bytes, r.peak_bytes)


def test_host_holds_the_swapped_weights_and_the_device_at_most_two_of_them():
    """On a GPU preset: host bytes are exactly the swapped blocks' frozen weights (counted from the model
    built without swap), and the device peak falls by at least those bytes less the two largest
    swapped blocks."""
    plan = Plan(adapter="lora:r=4", precision="bf16-pure")
    base = estimate(WIDE, plan, batch_size=1, resolution=64, device="rtx4090")
    sizes = [_frozen_bytes(WIDE, plan, n) - _frozen_bytes(WIDE, plan, n - 1) for n in range(1, BLOCKS + 1)]
    for n in (3, BLOCKS):
        r = estimate(WIDE, plan.replace(swap_blocks=n), batch_size=1, resolution=64, device="rtx4090")
        host = _frozen_bytes(WIDE, plan, n)
        assert r.host_peak_bytes == host
        assert r.peak_bytes <= base.peak_bytes - host + sum(sorted(sizes[:n])[-2:])
        assert base.host_peak_bytes == 0


def test_copies_are_priced_on_the_host_link_beside_compute():
    """The recorded step has one host-to-device copy per swapped weight in forward and in backward,
    the first block of each pass on the compute stream, the others fetched ahead on the side stream.
    More blocks swapped take longer; the copies cost at least their bytes at the link's bandwidth
    when they run on the compute stream, and less beside compute."""
    device = get_device("rtx4090")
    seconds = []
    for n in (0, 3, BLOCKS):  # (1024 wide, 4 x 768 tokens: the GPU, not the CPU issuing kernels, sets the pace)
        target = Target.resolve(BIG, Plan(adapter="lora:r=4", precision="bf16-pure", swap_blocks=n), 4, device,
                                resolution=256)
        report, time, ops = trace_step(target)
        copies = [op for op in ops if op.kind == H2D]
        assert sum(op.nbytes for op in copies) == 2 * report.host_peak_bytes
        seconds.append(time.seconds)
    side = [op for op in copies if op.flags & SIDE_STREAM]
    first = [op for op in copies if not op.flags & SIDE_STREAM]
    weights_per_block = [len([p for p in b.parameters() if not p.requires_grad])
                         for b in model_blocks(build_step(load_workload(FLUX, resolution=64),
                                                          Plan(adapter="lora:r=4"), 1, "cpu").model)]
    assert len(first) == weights_per_block[0] + weights_per_block[-1]  # forward's first block, backward's first
    assert len(side) == 2 * sum(weights_per_block) - len(first)
    assert seconds[0] < seconds[1] < seconds[2]
    serial = time_from_ops([op._replace(flags=op.flags & ~SIDE_STREAM) for op in ops], target)
    moved = sum(op.nbytes for op in copies)
    link = device.host_link_bandwidth * H100.link_eff  # (pinned copies: the link's fitted efficiency)
    assert serial.transfers == pytest.approx(moved / link + len(copies) * H100.copy_latency, rel=1e-6)
    assert seconds[2] < serial.seconds


def test_the_planner_searches_swap_where_the_weights_fill_the_budget():
    facts = model_facts(load_workload("dit-flux"))
    gpu, cpu = get_device("rtx4090"), get_device("cpu")
    assert default_space(facts, gpu, 1, budget_bytes=12 * 2**30).values["swap_blocks"] == [0, 19, 28, 38, 57]
    assert default_space(facts, gpu, 1, budget_bytes=12 * 2**30, base_weights="fp8").values["swap_blocks"] == \
        [0, 19, 28, 38, 57]
    assert default_space(facts, gpu, 1, budget_bytes=40 * 2**30, base_weights="fp8").values["swap_blocks"] == [0]
    assert default_space(facts, gpu, 1, budget_bytes=12 * 2**30, base_weights="nf4").values["swap_blocks"] == [0]
    assert default_space(facts, cpu, 1, budget_bytes=12 * 2**30).values["swap_blocks"] == [0]
    assert default_space(facts, gpu, 1).values["swap_blocks"] == [0]  # (no budget given)
    assert default_space(facts, gpu, 1, budget_bytes=21 * 2**30, base_weights="fp8").values["swap_blocks"] == [0]
    assert default_space(facts, gpu, 1, budget_bytes=40 * 2**30, base_weights="fp8", swap_everywhere=True).values[
        "swap_blocks"] == [0, 19, 28, 38, 57]  # (NOTE [ Swap searched when nothing fits ])
    assert default_space(facts, cpu, 1, budget_bytes=40 * 2**30, swap_everywhere=True).values["swap_blocks"] == [0]
    with_text = model_facts(load_workload("dit-flux:text_encoders=frozen"))  # (CLIP-L's 12 and T5's 24 layers first)
    assert default_space(with_text, gpu, 1, budget_bytes=12 * 2**30, base_weights="fp8").values["swap_blocks"] == \
        [0, 19, 28, 38, 57]  # (shares of the DiT's blocks, as without them: each but 28 keeps its shallow pair)
    llama = model_facts(load_workload("llama", seq_len=2048))  # (Llama-2-7B in bf16: 0.59 of a 24 GB card's budget)
    assert default_space(llama, gpu, 1, budget_bytes=int(0.9 * gpu.total_bytes)).values["swap_blocks"] == [0]


def test_the_planner_searches_swap_where_the_weights_and_the_checkpointed_block_inputs_fill_the_budget():
    """memfit.techniques.swap_blocks.WITH_INPUTS_OVER: FLUX.1-dev in fp8 takes 0.53 of a 21 GiB budget; with
    8 GiB of block inputs (a video model's tokens) swap is searched, with 1 GiB or none known it is not."""
    facts, gpu = model_facts(load_workload("dit-flux")), get_device("rtx4090")

    def space(inputs):
        return default_space(facts, gpu, 1, budget_bytes=21 * 2**30, base_weights="fp8",
                             block_inputs=lambda: inputs).values["swap_blocks"]
    assert space(8 * 2**30) == [0, 19, 28, 38, 57]
    assert space(1 * 2**30) == space(None) == [0]


def test_the_block_inputs_are_the_tokens_by_the_width_in_16_bits_over_the_blocks():
    """A tiny Wan at 33 frames and 64 px: 9 latent frames of (64 / 16)^2 patches, 2 x 16 wide, 2 blocks, batch 3."""
    wl = load_workload("dit-wan:num_layers=2,attention_head_dim=16,num_attention_heads=2,ffn_dim=64,text_dim=32,"
                       "freq_dim=32,frames=33", resolution=64)
    assert block_input_bytes(wl, model_facts(wl).model, 3) == 2 * 3 * 9 * 16 * 32 * 2
    assert block_input_bytes(load_workload("llama", seq_len=64), model_facts(load_workload("llama", seq_len=64)).model, 1) is None


def test_swapped_counts_of_one_stack_repeat_within_a_few_blocks():
    """NOTE [ Swapped counts the planner traces shallow ]: of 42 blocks, a third and two thirds (14 and 28:
    a period of 3 blocks) in place of a quarter and three quarters (10 and 31: periods of 21 and 42, each
    plan traced at full depth); of 32, the quarters as before. Each has a shallow pair."""
    gpu = get_device("rtx4090")
    for layers, counts, pairs in ((42, [0, 14, 21, 28, 42], [(6, 9), (4, 6), (3, 6), (2, 3)]),
                                  (32, [0, 8, 16, 24, 32], [(8, 12), (4, 6), (4, 8), (2, 3)])):
        facts = model_facts(load_workload(f"llama:num_hidden_layers={layers},hidden_size=256,intermediate_size=512,"
                                          "num_attention_heads=4,num_key_value_heads=4,vocab_size=500"))
        weights = least_weight_bytes(facts.model.parameters(), facts.model, "as-is")  # (what the search weighs)
        assert default_space(facts, gpu, 1, budget_bytes=int(1.1 * weights)).values["swap_blocks"] == counts
        assert [depths(Plan(swap_blocks=n), layers) for n in counts[1:]] == pairs


@pytest.mark.parametrize("spec,fields,problem", [
    (FLUX, {"swap_blocks": 6, "adapter": "lora:r=4"},
     "swap_blocks 6 exceeds the model's 5 repeated blocks (transformer_blocks: 2, single_transformer_blocks: 3); "
     "use swap_blocks <= 5"),
    ("cnn", {"swap_blocks": 1}, "swap_blocks 1: the model has no repeated blocks"),
    (FLUX, {"swap_blocks": 2}, "swap_blocks streams frozen weights, and block 3 has none (every weight trains)"),
])
def test_bad_swaps_get_one_line(spec, fields, problem):
    with pytest.raises(UserError, match=problem.replace("(", r"\(").replace(")", r"\)")) as e:
        build_step(load_workload(spec, resolution=64) if spec == FLUX else load_workload(spec), Plan(**fields), 1, "cpu")
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("fields,problem", [
    ({"swap_blocks": -1}, "swap_blocks must be a whole number >= 0"),
    ({"swap_blocks": 2, "base_weights": "nf4"}, "swap_blocks streams plain or fp8 weights"),
    ({"swap_blocks": 2, "compile": "blocks"}, "use compile: none with swap_blocks"),
])
def test_bad_swap_plans_get_one_line(fields, problem):
    with pytest.raises(UserError, match=problem):
        Plan(**fields)


def test_swap_above_the_blocks_exits_2_in_one_line():
    from memfit.cli.main import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["estimate", FLUX, "--resolution", "64", "--adapter", "lora:r=4", "--swap-blocks", "9"])
    lines = err.getvalue().strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "exceeds the model's 5 repeated blocks" in lines[0]


def test_a_given_swap_is_planned_with_the_given_adapter_and_refused_without_one():
    """``plan --adapter ... --swap-blocks N`` plans the swap with the adapter's frozen weights (built alone,
    every weight trains and no block has any to stream: it was refused); without an adapter, one line."""
    from memfit.cli.main import main
    args = ["plan", FLUX, "--resolution", "64", "--device", "rtx4090", "--swap-blocks", "2", "--precision", "bf16-pure",
            "--checkpointing", "none", "--json"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main([*args, "--adapter", "lora:r=4"]) == 0
    assert json.loads(out.getvalue())["chosen"]["plan"]["swap_blocks"] == 2
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err := io.StringIO()):
        assert main(args) == 2
    assert err.getvalue().strip().splitlines() == [
        "memfit plan: error: plan: swap_blocks streams frozen weights, and block 3 has none (every weight trains); "
        "train an adapter (adapter: lora:r=16) or use swap_blocks: 0"]


@pytest.mark.slow
def test_where_nothing_fits_unswapped_the_planner_searches_swap_after_all():
    """NOTE [ Swap searched when nothing fits ]: ai-toolkit's Z-Image Turbo example (adamw8bit, r=128, Qwen3-4B in
    the step) on a 16 GB card: its fp8 weights are 0.68 of the budget, so swap was not searched and nothing fit
    (16.74 GiB at the least); searched again with swap, 30 blocks swapped fit (13.59 GiB, 95 s on a 2-core AMD
    EPYC)."""
    import yaml

    from memfit.integrations.ai_toolkit import map_config
    from memfit.planner.search import plan
    path = Path(__file__).resolve().parents[2] / "data" / "ai_toolkit" / "train_lora_zimage_turbo_32gb.yaml"
    data = yaml.safe_load(path.read_text())
    data["config"]["process"][0]["train"]["optimizer"] = "adamw8bit"
    c = map_config(data, "z.yaml", get_device("rtx4060ti-16gb"))
    r = plan(c.workload, device="rtx4060ti-16gb", batch_size=c.batch_size, fixed=c.plan.changed())
    assert r.chosen is not None and r.chosen.plan.swap_blocks > 0 and "then searched" in r.notes[0]
