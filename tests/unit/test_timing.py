"""The GPU step-time model: what each technique costs comes from the ops the step runs.

Mechanism tests trace small configs for the H100 preset (seconds each); the ratio tests replay
recorded H100 rows (tests/data/h100.jsonl: memfit's own steps measured there).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from memfit.devices import get_device
from memfit.planner.ops import (
    AFTER_COMPUTE,
    ATTENTION,
    COMM,
    COMPILED,
    CUSTOM,
    D2H,
    FOREACH,
    FUSED_HOST,
    H2D,
    HOST,
    MATMUL,
    MEMORY,
    OUT_STREAM,
    PHASES,
    PY_MODE,
    RECOMPUTE,
    SIDE_STREAM,
    SYNC_AFTER,
    VIEW,
    WAIT,
    WORKER,
    Op,
)
from memfit.planner.timing import H100, Constants, Rates, record_ops, simulate, step_seconds, time_from_ops
from memfit.plans import Plan
from memfit.target import Target

GPT2 = "gpt2:n_layer=2,n_embd=128,n_head=4,vocab_size=1000,n_positions=256"
DEVICE = get_device("h100-80gb")
ROWS = {r["case"]: r for r in map(json.loads, (Path(__file__).parent.parent / "data" / "h100.jsonl").read_text()
                                  .splitlines())}
_CACHE: dict = {}


def ops_of(plan: dict, batch: int = 4, seq: int = 64, spec: str = GPT2) -> tuple[Target, list[Op]]:
    key = (spec, json.dumps(plan, sort_keys=True), batch, seq)
    if key not in _CACHE:
        target = Target.resolve(spec, Plan(**plan), batch, DEVICE, seq_len=seq)
        _CACHE[key] = target, record_ops(target)
    return _CACHE[key]


def n_params(target: Target) -> int:
    import torch
    with torch.device("meta"):
        return sum(p.numel() for p in target.workload.model().parameters())


def compute_flops(ops, recompute: bool) -> float:
    return sum(o.flops for o in ops if o.kind in (MATMUL, ATTENTION) and bool(o.flags & RECOMPUTE) == recompute)


# -- recompute ----------------------------------------------------------------------------------------
def test_block_checkpointing_recomputes_every_block_matmul_once():
    """Recompute = the forward FLOPs of the blocks: the whole forward but the LM head."""
    t, plain = ops_of({"precision": "bf16"})
    _, blocks = ops_of({"precision": "bf16", "checkpointing": "blocks"})
    head = 2 * 4 * 64 * 128 * 1000  # tokens x hidden x vocab, one matmul
    forward = sum(o.flops for o in plain if o.kind in (MATMUL, ATTENTION) and o.phase == 2)
    assert compute_flops(blocks, recompute=True) == pytest.approx(forward - head, rel=1e-9)
    assert compute_flops(plain, recompute=True) == 0
    assert compute_flops(blocks, recompute=False) == pytest.approx(compute_flops(plain, recompute=False), rel=1e-9)
    a, b = simulate(plain, DEVICE), simulate(blocks, DEVICE)
    assert b.recompute > 0 and b.seconds > a.seconds


def test_selective_checkpointing_recomputes_no_matmul_and_pays_for_its_python_mode():
    _, plain = ops_of({"precision": "bf16"})
    _, sel = ops_of({"precision": "bf16", "checkpointing": "selective"})
    assert compute_flops(sel, recompute=True) == 0
    assert any(o.flags & RECOMPUTE for o in sel)  # pointwise ops run again
    assert sum(bool(o.flags & PY_MODE) for o in sel) > 50  # forward and recompute through SAC's modes
    assert not any(o.flags & PY_MODE for o in plain)
    assert simulate(sel, DEVICE).cpu_seconds > simulate(plain, DEVICE).cpu_seconds


def test_loss_chunks_recompute_the_head():
    _, plain = ops_of({"precision": "bf16"})
    _, chunked = ops_of({"precision": "bf16", "loss_chunks": 4})
    head_fwd = 2 * 4 * 64 * 128 * 1000  # every position's logits, as the model's own loss (the last is ignored)
    assert compute_flops(chunked, recompute=True) == pytest.approx(head_fwd, rel=1e-9)
    assert simulate(chunked, DEVICE).kernels > simulate(plain, DEVICE).kernels


# -- host transfers -------------------------------------------------------------------------------------
def test_offloaded_activations_cross_the_link_both_ways_and_cost_their_bytes():
    _, small = ops_of({"precision": "bf16", "offload": ["activations"]}, batch=2)
    _, large = ops_of({"precision": "bf16", "offload": ["activations"]}, batch=8)
    for ops in (small, large):
        out = sum(o.nbytes for o in ops if o.kind == D2H)
        back = sum(o.nbytes for o in ops if o.kind == H2D)
        assert out == back > 0
    ratio = sum(o.nbytes for o in large if o.kind == D2H) / sum(o.nbytes for o in small if o.kind == D2H)
    assert 3.0 < ratio < 4.0  # activations scale with the batch; the bf16 weight copies autograd saves do not
    rates = Rates.of(DEVICE, H100)
    for ops in (small, large):
        copies = [o for o in ops if o.kind in (D2H, H2D)]
        expected = sum(o.nbytes for o in copies) / rates.link + len(copies) * H100.copy_latency
        assert simulate(ops, DEVICE).transfers == pytest.approx(expected, rel=1e-9)


def test_offloaded_optimizer_states_step_on_the_host_beside_backward():
    """Gradients go out on their own stream, the update runs on the worker's clock, parameters come
    back on another stream: the step costs less than the same copies and updates in turn."""
    t, ops = ops_of({"precision": "bf16", "offload": ["optimizer_states"]})
    weights = 4 * n_params(t)  # fp32 gradients out, fp32 parameters in
    assert sum(o.nbytes for o in ops if o.kind == D2H and o.flags & OUT_STREAM) == weights
    assert sum(o.nbytes for o in ops if o.kind == H2D and o.flags & WORKER) == weights
    assert sum(o.host_bytes for o in ops if o.kind == HOST and o.flags & WORKER) >= 4 * weights  # p, g, m, v
    assert not [o for o in ops if o.kind in (D2H, H2D, HOST) and not o.flags & (OUT_STREAM | WORKER)]
    slow = Constants(link_eff=H100.link_eff / 100)  # the copies set the time
    one_way = weights / Rates.of(DEVICE, slow).link
    without = simulate([o for o in ops if not o.flags & (OUT_STREAM | WORKER)], DEVICE, slow).seconds
    overlapped = simulate(ops, DEVICE, slow).seconds
    in_turn = simulate([o._replace(flags=o.flags & ~(OUT_STREAM | WORKER)) for o in ops], DEVICE, slow).seconds
    # at least one way of copies after the step's own work, and well under both ways in turn
    assert without + one_way <= overlapped < in_turn - 0.75 * one_way


def test_the_host_update_is_timed_at_torch_s_fused_host_rate():
    """The host optimizer's update is torch's fused CPU AdamW (FUSED_HOST), timed at ``host_fused_bw``
    (fitted to an H100 machine's host: bench/results/offload_gpu_h100.jsonl), not at the EMA's ``host_bw``."""
    import dataclasses
    t, ops = ops_of({"precision": "bf16", "offload": ["optimizer_states"]})
    fused = [o for o in ops if o.kind == HOST and o.flags & FUSED_HOST]
    assert fused and all(o.flags & WORKER for o in fused)
    assert sum(o.host_bytes for o in fused) >= 4 * 4 * n_params(t)  # p, g, m, v in fp32
    slow_fused = dataclasses.replace(H100, host_fused_bw=H100.host_fused_bw / 1000)
    slow_other = dataclasses.replace(H100, host_bw=H100.host_bw / 1000)
    base = simulate(ops, DEVICE).seconds
    assert simulate(ops, DEVICE, slow_fused).seconds > 10 * base
    assert simulate(ops, DEVICE, slow_other).seconds == pytest.approx(base)


def test_the_device_step_variant_prefetches_states_on_a_side_stream():
    t, ops = ops_of({"precision": "bf16", "offload": ["optimizer_states:step=device"]})
    states = 2 * 4 * n_params(t)  # AdamW's two fp32 moments
    assert sum(o.nbytes for o in ops if o.kind == H2D and o.flags & SIDE_STREAM) == states
    assert sum(o.nbytes for o in ops if o.kind == D2H) == states
    slow = Constants(link_eff=H100.link_eff / 100)  # the copies set the time
    one_way = states / Rates.of(DEVICE, slow).link
    before = simulate([o for o in ops if o.phase != 4], DEVICE, slow).seconds
    prefetched = simulate(ops, DEVICE, slow).seconds
    in_turn = simulate([o._replace(flags=o.flags & ~SIDE_STREAM) for o in ops], DEVICE, slow).seconds
    # every state goes out on the compute stream (one way at least); the next parameter's states come
    # back meanwhile on the side stream, which beats copying them back on the compute stream
    assert one_way < prefetched - before < in_turn - before < 2.5 * one_way


def test_ema_on_the_host_copies_the_weights_and_updates_there():
    """The weights are copied device -> host into the EMA's buffers, then averaged on the host (in
    memfit's background thread; the time model still counts both as blocking the step)."""
    t, ops = ops_of({"precision": "bf16", "ema": {"decay": 0.999, "device": "cpu", "every": 1}})
    out = [o for o in ops if o.kind == D2H]
    assert sum(o.nbytes for o in out) == 4 * n_params(t)  # fp32 weights, device -> host
    assert [o for o in ops if o.kind == HOST] and simulate(ops, DEVICE).host > 0


# -- micro-batches, the optimizer, the clocks -----------------------------------------------------------
def test_only_bitsandbytes_optimizer_updates_synchronise_and_its_dequantisation_is_memory_bound():
    """bitsandbytes' 8-bit optimizer synchronises after each parameter's update (compute-bound: its
    quantisation map); QLoRA's dequantize_4bit in every forward and backward is a plain memory-bound
    kernel. Priced like the update, the H100's QLoRA row was predicted +137% (+118% after)."""
    pytest.importorskip("bitsandbytes")
    llama = "llama:num_hidden_layers=1,hidden_size=256,intermediate_size=512,num_attention_heads=4,num_key_value_heads=2"
    _, qlora = ops_of({"precision": "bf16", "base_weights": "nf4", "adapter": "lora:r=8"}, spec=llama)
    assert not any(o.flags & SYNC_AFTER for o in qlora)
    dequant = [o for o in qlora if o.flags & CUSTOM and o.kind == MEMORY]
    rates = Rates.of(DEVICE, H100)
    assert all(rates.gpu(o) == pytest.approx(o.nbytes / rates.bw + H100.kernel) for o in dequant)
    _, adam8 = ops_of({"precision": "bf16", "optimizer": "adamw8bit"})
    update = [o for o in adam8 if o.flags & CUSTOM and o.kind == MEMORY]
    assert update and all(o.flags & SYNC_AFTER for o in update)


def test_qloras_gemms_are_the_lora_plans_gemms_in_bf16():
    """NOTE [ The 4-bit matmul under autocast ]: under bf16 autocast a 4-bit layer's forward GEMM (an
    ``F.linear`` inside bitsandbytes' kernel, autocast) and its backward GEMM (in the gradient's
    dtype) run in bf16, as the LoRA plan's over unquantized weights: the same FLOPs, all on tensor cores
    (before 2026-12-07 backward added the first block's input gradients: memfit's k-bit preparation made the
    embeddings' output require grad, which peft does only for its reentrant checkpointing). The trace had
    fp32 backward GEMMs and no forward ones (the H100's QLoRA row +118%)."""
    pytest.importorskip("bitsandbytes")
    llama = "llama:num_hidden_layers=1,hidden_size=256,intermediate_size=512,num_attention_heads=4,num_key_value_heads=2"
    flops = {}
    for weights in ("as-is", "nf4"):
        _, ops = ops_of({"precision": "bf16", "base_weights": weights, "adapter": "lora:r=8"}, batch=4, seq=512,
                        spec=llama)
        matmuls = [o for o in ops if o.kind == MATMUL]
        assert {o.dtype for o in matmuls} == {"half"}, weights
        flops[weights] = {phase: sum(o.flops for o in matmuls if PHASES[o.phase] == phase)
                          for phase in ("forward", "backward")}
    assert flops["nf4"]["forward"] == pytest.approx(flops["as-is"]["forward"], rel=1e-6)
    assert flops["nf4"]["backward"] == pytest.approx(flops["as-is"]["backward"], rel=1e-6)


def test_a_compiled_qlora_steps_own_ops_count_its_4bit_gemms_as_the_eager_steps():
    """NOTE [ The modes again, in order ] (memfit.techniques.fake_wrapper): a compiled region's forward
    runs under the modes of its call in their order, so bitsandbytes' 4-bit matmul reaches the op
    recorder as the GEMM it is (dequantize, ``F.linear``), as in the eager step and in the region's
    backward. The forward re-entered them upside down: the recorder saw one memory-bound custom op,
    and an 8B QLoRA's compiled step lost 114 of its 185 TFLOP (tools.fit.compiled_ops: QLoRA priced
    below LoRA)."""
    pytest.importorskip("bitsandbytes")
    llama = "llama:num_hidden_layers=2,hidden_size=256,intermediate_size=512,num_attention_heads=4,num_key_value_heads=2"
    forward = {}
    for compile_mode in ("none", "blocks"):
        target = Target.resolve(llama, Plan(precision="bf16-pure", base_weights="nf4", adapter="lora:r=8",
                                            compile=compile_mode), 2, "rtx4090", seq_len=256)
        ops = record_ops(target, as_planned=True)
        forward[compile_mode] = sum(o.flops for o in ops if o.kind == MATMUL and PHASES[o.phase] == "forward")
    assert forward["blocks"] == pytest.approx(forward["none"], rel=1e-6)


def test_micro_batches_launch_more_kernels_and_cost_cpu_time():
    _, whole = ops_of({"precision": "bf16"})
    _, micro = ops_of({"precision": "bf16", "micro_batch_size": 1})
    a, b = simulate(whole, DEVICE), simulate(micro, DEVICE)
    assert b.kernels > 3 * a.kernels * 0.8 and b.cpu_seconds > 3 * a.cpu_seconds * 0.8
    assert b.seconds > a.seconds


def test_optimizer_step_is_memory_bound_foreach():
    t, ops = ops_of({"precision": "bf16"})
    update = [o for o in ops if o.phase == 4 and o.kind == FOREACH]
    assert update and all(o.flops == 0 for o in update)
    assert sum(o.nbytes for o in update) >= 16 * n_params(t)  # weights, gradients, two states: read and written


def test_two_clocks_small_ops_are_cpu_bound_a_large_matmul_gpu_bound():
    tiny = [Op(MATMUL if i % 2 else 3, 2, 1e3, 1024, "half", 1, 0) for i in range(1000)]
    st = simulate(tiny, DEVICE)
    assert st.seconds == pytest.approx(1000 * H100.cpu_forward, rel=0.01)
    assert st.cpu_bound > 0.5 * st.seconds  # the GPU waits for launches most of the time
    flops = 1e15
    big = [Op(MATMUL, 2, flops, 1 << 20, "half", 1, 0)]
    expected = flops / (DEVICE.peak_flops["bfloat16"] * H100.mm_eff_half) + H100.mm_overhead + H100.cpu_forward
    assert simulate(big, DEVICE).seconds == pytest.approx(expected, rel=1e-9)
    fp32 = simulate([big[0]._replace(dtype="fp32")], DEVICE).seconds
    assert fp32 > 10 * simulate(big, DEVICE).seconds  # fp32 matmuls on CUDA cores, not TF32


# -- collectives (NOTE [ Collectives ]) ------------------------------------------------------------
def test_a_collective_overlaps_the_compute_issued_before_its_wait():
    link = DEVICE.interconnect_bandwidth * H100.comm_eff
    comm = Op(COMM, 2, 0.0, int(link * 0.010), "", 1, 0, 0)  # 10 ms on the link
    work = [Op(MATMUL, 2, 1e13, 1 << 20, "half", 1, 0) for _ in range(4)]  # ~13 ms of matmuls
    wait = Op(WAIT, 2, 0.0, 0, "", 1, 0, 0)
    compute = simulate(work, DEVICE).seconds
    hidden = simulate([comm, *work, wait], DEVICE)
    assert hidden.seconds == pytest.approx(compute + H100.cpu_forward, rel=0.01)
    assert hidden.communication == 0.0
    exposed = simulate([comm, wait, *work], DEVICE)  # waited for at once: nothing to hide it behind
    assert exposed.seconds == pytest.approx(compute + 0.010 + H100.comm_latency, rel=0.01)
    assert exposed.communication == pytest.approx(0.010 + H100.comm_latency, rel=0.01)
    reduce = simulate([*work, comm._replace(flags=AFTER_COMPUTE), wait], DEVICE)  # after the gradients
    assert reduce.seconds == pytest.approx(compute + 0.010 + H100.comm_latency, rel=0.01)


def test_a_sharded_rank_sends_its_share_of_the_parameters_and_gradients():
    """Against the model's own parameter count: FSDP2's all-gathers send (N-1)/N of the parameters
    in forward and again in backward (resharded after forward), in the gathered dtype, and its
    reduce-scatters (N-1)/N of the gradients; keeping the gathered parameters (reshard_after_forward
    false) leaves out the backward's all-gathers. A slow enough link shows in the step time (this
    small model's step is otherwise bound by the CPU issuing it)."""
    n, spec = 4, GPT2
    target, ops = ops_of({"world_size": n, "shard_param_dtype": "bf16", "shard_reduce_dtype": "fp32"}, batch=8,
                         spec=spec)
    params = n_params(target)
    sent = lambda phase: sum(o.nbytes for o in ops if o.kind == COMM and o.phase == phase)  # noqa: E731
    share = (n - 1) / n
    # (FSDP2 pads each parameter's shard to a multiple of the world size: within 1%)
    assert sent(2) == pytest.approx(share * 2 * params, rel=0.01)  # forward: bf16 parameters
    assert sent(3) == pytest.approx(share * (2 * params + 4 * params), rel=0.01)  # backward: again, + fp32 grads
    _, kept = ops_of({"world_size": n, "reshard_after_forward": False, "shard_param_dtype": "bf16",
                      "shard_reduce_dtype": "fp32"}, batch=8, spec=spec)
    assert sum(o.nbytes for o in kept if o.kind == COMM and o.phase == 3) == pytest.approx(share * 4 * params,
                                                                                           rel=0.01)
    assert any(o.kind == WAIT for o in ops)
    pcie = Target.resolve(spec, target.plan, 8, get_device("rtx4090"), seq_len=64)
    fast = time_from_ops(ops, pcie, Constants(comm_eff=1e9, comm_latency=0.0))
    slow = time_from_ops(ops, pcie, Constants(comm_eff=1e-3))
    assert slow.communication > fast.communication
    link = pcie.device.interconnect_bandwidth * 1e-3
    assert slow.seconds > fast.seconds + 0.5 * sum(o.nbytes for o in ops if o.kind == COMM) / link


def test_a_sharded_plans_shallow_traces_extrapolate_to_its_full_trace():
    """The planner measures plans at two shallow depths and extrapolates their ops: with sharding
    the collectives and their waits must line up block by block and give the full trace's time."""
    from memfit.planner.shallow import extrapolate_ops
    plan = {"world_size": 4, "shard_param_dtype": "bf16", "shard_reduce_dtype": "fp32"}
    spec = "gpt2:n_layer={},n_embd=128,n_head=4,vocab_size=1000,n_positions=64"
    (_, two), (_, three), (full, four) = (ops_of(plan, batch=8, spec=spec.format(n)) for n in (2, 3, 4))
    ops = extrapolate_ops(two, three, 2, 3, 4)
    assert ops is not None
    slow_link = Constants(comm_eff=0.002)  # the collectives matter
    expected = time_from_ops(four, full, slow_link)
    assert expected.communication > 0.2 * expected.seconds
    assert time_from_ops(ops, full, slow_link).seconds == pytest.approx(expected.seconds, rel=1e-6)


def test_torchaos_update_costs_a_compiled_call_and_its_kernels_per_parameter():
    """torchao's low-bit AdamW runs one compiled call per parameter; its kernels do not dispatch on fake
    tensors, so they used to cost nothing (GPT-2 on the H100: 1.69x torch's AdamW, predicted 0.99x)."""
    pytest.importorskip("torchao")
    target, ops = ops_of({"precision": "bf16-pure", "optimizer": "adamw8bit-ao"})
    import torch
    with torch.device("meta"):
        params = list(target.workload.model().parameters())
    optimizer = PHASES.index("optimizer")
    calls = [o for o in ops if o.flags & COMPILED and o.kind == VIEW]
    kernels = [o for o in ops if o.flags & COMPILED and o.kind == MEMORY]
    assert len(calls) == len(params)  # (GPT2 ties its head to the embedding)
    assert len(kernels) >= len(params) and all(o.nbytes > 0 for o in kernels)
    assert sum(o.nbytes for o in kernels) >= 2 * sum(p.numel() for p in params)  # bf16 weights, at least read
    assert {o.phase for o in calls + kernels} == {optimizer}  # the recorder's phase survives the wrapper
    rates = Rates.of(DEVICE, H100)
    assert sum(rates.cpu(o) for o in calls) == pytest.approx(len(params) * H100.cpu_compiled_call)
    free = dataclasses.replace(H100, cpu_compiled_call=0.0)
    assert simulate(ops, DEVICE).cpu_seconds - simulate(ops, DEVICE, free).cpu_seconds == pytest.approx(
        len(params) * H100.cpu_compiled_call)


def test_a_compiled_update_in_backward_is_not_scaled_as_the_models_graph():
    """torchao's update stepped in backward runs Inductor's code already: ``compile: blocks|full``
    scales the model's own forward and backward ops, not the update's calls."""
    call = Op(VIEW, PHASES.index("backward"), 0.0, 0, "", 1, COMPILED)
    for fused in (1.0, H100.compile_fusion):
        st = simulate([call] * 10, DEVICE, fused=fused)
        assert st.cpu_seconds == pytest.approx(10 * H100.cpu_compiled_call)
        assert st.seconds == pytest.approx(10 * H100.cpu_compiled_call)


def test_compiled_plans_scale_the_eager_step():
    target = Target.resolve(GPT2, Plan(precision="bf16", compile="blocks"), 4, DEVICE, seq_len=64)
    _, eager_ops = ops_of({"precision": "bf16"})
    eager = time_from_ops(eager_ops, target.with_plan(Plan(precision="bf16")))
    compiled = time_from_ops(eager_ops, target)
    assert compiled.seconds < eager.seconds and compiled.notes
    whole = time_from_ops(eager_ops, target.with_plan(Plan(precision="bf16", compile="full")))
    assert whole.seconds < compiled.seconds  # blocks keep the eager code between them (H100: 0.79x vs 0.44x)


# -- recorded H100 rows -------------------------------------------------------------------------------
@functools.cache
def predicted(case: str) -> float:
    r = ROWS[case]
    return step_seconds(Target.resolve(r["workload"], Plan(**r["plan"]), r["batch_size"], DEVICE,
                                       seq_len=r["seq_len"])).seconds


def ratio_error(case: str, baseline: str) -> float:
    measured = ROWS[case]["step_seconds_median"] / ROWS[baseline]["step_seconds_median"]
    return predicted(case) / predicted(baseline) / measured - 1


def test_llama_block_checkpointing_ratio_matches_the_h100():
    """4 Llama layers at 7B width, batch 2 x 2048: blocks cost 1.16x bf16 on the H100 (held out of the fit)."""
    assert abs(ratio_error("t-llama4-blocks-b2", "t-llama4-bf16-b2")) < 0.15


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gpt2-fp32", "gpt2-bf16-blocks", "gpt2-bf16-selective", "gpt2-bf16-mb2",
                                  "gpt2-bf16-offopt", "gpt2-bf16-blocks-chunks"])
def test_gpt2_ratios_match_the_h100(case):
    assert abs(ratio_error(case, "gpt2-bf16")) < 0.15


@pytest.mark.slow
@pytest.mark.parametrize("case, baseline", [
    ("p-choice16-chosen-purebf16-8bit-ao", "p-choice16-alt-purebf16-adamw"),  # (fitted: cpu_compiled_call)
    ("choice8-toobig-purebf16-every2-8bit-ao", "choice8-alt-purebf16-every2-adamw"),  # held out
])
def test_torchaos_update_against_torchs_adamw_matches_the_h100(case, baseline):
    """GPT-2 124M, bf16-pure, batch 8 x 1024: torchao's 8-bit AdamW is 1.69x (1.78x with blocks:every=2)
    the step with torch's AdamW on the H100: a CPU-bound update of 148 compiled calls."""
    pytest.importorskip("torchao")
    assert abs(ratio_error(case, baseline)) < 0.15


@pytest.mark.slow
@pytest.mark.parametrize("case", ["c-gpt2-bf16-blocks",  # fitted: compile_fusion_blocks
                                  "c-gpt2-bf16-full", "c-gpt2-bf16-full-chunks"])  # held out (full: another recording)
def test_compiled_gpt2_ratios_match_the_h100(case):
    """memfit's own GPT-2 bf16 step compiled, against its eager step in the same session."""
    assert abs(ratio_error(case, "c-gpt2-bf16-eager")) < 0.15


@pytest.mark.slow
def test_qlora_step_time_matches_the_h200():
    """A 3B Llama's QLoRA step (nf4, LoRA r=16, bf16 autocast, blocks, batch 4 x 2048) alone on an H200:
    533 ms, every GEMM a bf16 tensor-core kernel (tests/data/h200.jsonl, profiled). Predicted +118% on
    the H100 before NOTE [ The 4-bit matmul under autocast ]."""
    pytest.importorskip("bitsandbytes")
    row = next(r for r in map(json.loads, (Path(__file__).parent.parent / "data" / "h200.jsonl").read_text()
                              .splitlines()) if r["case"] == "p-llama3b-qlora-nf4-bf16-blocks")
    target = Target.resolve(row["workload"], Plan(**row["plan"]), row["batch_size"], get_device("h200-141gb"),
                            seq_len=row["seq_len"])
    assert step_seconds(target).seconds / row["step_seconds_median"] - 1 == pytest.approx(0, abs=0.15)


def test_cpu_targets_are_refused():
    with pytest.raises(ValueError, match="step_seconds: the op-level time model is for GPU targets"):
        step_seconds(Target.resolve(GPT2, Plan(), 2, "cpu", seq_len=32))


def test_a_storage_fetched_ahead_and_freed_unread_is_forgotten():
    """A side-stream copy's storage freed before any op read it must not make a later storage at its
    address wait for that copy (the recorder finds storages by address)."""
    import gc

    import torch

    from memfit.planner.op_links import Prefetched
    keys = Prefetched()
    freed, kept = torch.empty(16), torch.empty(16)
    address = freed.untyped_storage()._cdata
    keys.copied(freed, 1, in_optimizer=False)  # (as a side-stream copy into each records them)
    keys.copied(kept, 2, in_optimizer=False)
    del freed
    gc.collect()
    assert address not in keys._unread and address not in keys._keys
    assert keys.first_read([kept]) == 2  # its first reader waits for the copy, once
    assert keys.first_read([kept]) == 0


def test_an_optimizer_op_on_a_storage_no_copy_wrote_waits_for_none():
    """NOTE [ Keys, not addresses ]: in the optimizer phase an op waits for the copy that wrote its
    first input; a storage no copy wrote, even at the address of a freed prefetched one, gives key 0,
    and a prefetched state gives its copy's serial number, not its address."""
    import gc

    import torch

    from memfit.planner.op_links import Prefetched
    keys = Prefetched()
    state = torch.empty(64)
    keys.copied(state, 7, in_optimizer=True)
    assert keys.key_of(state) == 7 and keys.key_of(state[8:]) == 7
    address = state.untyped_storage()._cdata
    del state
    gc.collect()
    assert address not in keys._keys
    other = torch.empty(64)
    assert keys.key_of(other) == 0
