"""bench/offload_gpu.py (issue 15) on a tiny CPU case: the table's figures are the measured ones.

The GPU run cannot happen here; this checks the script's own arithmetic and plumbing on the smoke
path: the ratio is median(B) / median(A) of the interleaved steps, both memory columns come from
measurements and predictions, the "before" column is the recorded H100 pair, and (slow) a job run
in a fresh process returns its result.
"""

import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


from bench import offload_bound as BOUND  # noqa: E402
from bench import offload_gpu as BENCH  # noqa: E402

MIB = r"([\d.]+) MiB"


def test_recorded_before_figures_are_the_h100_pairs():
    rows = {r.id: r for r in BENCH.ROWS}
    llama = BENCH.recorded(rows["llama4-offopt"])
    assert llama["cases"] == ["t-llama4-bf16-b2", "t-llama4-offopt-b2"]  # the rows that ran alone
    assert llama["ratio"] == pytest.approx(0.36221 / 0.09476)
    # the host-step offload's "before" is the device-step offload the H100 recorded, also its own row's
    assert BENCH.recorded(rows["llama4-offopt-device-step"]) == llama
    ema = BENCH.recorded(rows["gpt2-ema-cpu"])
    assert ema["cases"] == ["gpt2-bf16", "gpt2-bf16-ema"]
    assert BENCH.recorded(BENCH.smoke_rows()[0]) == {}  # tiny configs were never recorded


def test_smoke_row_table_shows_the_measured_ratio_and_memory():
    row = next(r for r in BENCH.smoke_rows() if r.id == "gpt2-ema-cpu")
    before = BENCH.recorded(next(r for r in BENCH.ROWS if r.id == row.id))
    jobs = []

    def runner(job):
        jobs.append(job)
        return BENCH.measure(job)

    result = BENCH.run_row(row, "cpu", "cpu", repeats=1, runner=runner, before=before)
    assert "error" not in result, result.get("error")
    assert [j["first"] for j in jobs] == [row.plan_a, row.plan_b]  # A first, then B first
    assert len(result["times_a"]) == len(result["times_b"]) == 2 * (BENCH.STEPS_PER_TURN - 1)
    a, b = statistics.median(result["times_a"]), statistics.median(result["times_b"])
    assert (result["step_seconds_a"], result["step_seconds_b"]) == (a, b)
    assert result["ratio"] == b / a
    assert result["met"] is None  # a CPU time says nothing about the GPU target
    # The CPU EMA's shadow weights are extra live bytes, measured and predicted.
    assert result["peak_b"] > result["peak_a"] > 0 and result["predicted_b"] > result["predicted_a"] > 0

    line = BENCH.table([result]).splitlines()[2]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[0] == "gpt2-ema-cpu"
    assert cells[1] == f"{before['ratio']:.2f}x" == "3.39x"
    assert cells[2].startswith(f"{b / a:.2f}x (")
    assert cells[3] == "<= 1.1x" and cells[4] == "n/a (CPU)"
    measured = [float(x) for x in re.findall(MIB, cells[5])]
    predicted = [float(x) for x in re.findall(MIB, cells[6])]
    assert measured == [round(result["peak_a"] / 2**20, 1), round(result["peak_b"] / 2**20, 1)]
    assert predicted == [round(result["predicted_a"] / 2**20, 1), round(result["predicted_b"] / 2**20, 1)]


def test_a_failed_row_is_reported_in_the_table():
    row = BENCH.smoke_rows()[1]
    result = BENCH.run_row(row, "cpu", "cpu", repeats=1, runner=lambda job: {"error": "OutOfMemoryError: x"})
    assert "OutOfMemoryError: x" in result["error"]
    assert "failed: OutOfMemoryError: x" in BENCH.table([result])


@pytest.mark.slow  # a fresh process imports torch and transformers (~10 s); the smoke run covers it too
def test_a_job_runs_in_a_fresh_process():
    """The path the GPU run takes: the script re-runs itself with --child and prints its RESULT line."""
    row = next(r for r in BENCH.smoke_rows() if r.id == "gpt2-offact")
    job = {"workload": row.workload, "batch_size": row.batch_size, "seq_len": row.seq_len, "device": "cpu",
           "preset": "cpu", "repeats": 1, "first": row.plan_b, "second": row.plan_a}
    result = BENCH.run_child(job, timeout=120)
    assert "error" not in result, result.get("error")
    assert result["peak"] > 0 and result["predicted"] > 0
    assert len(result["times_first"]) == len(result["times_second"]) == BENCH.STEPS_PER_TURN - 1


def test_the_physical_bound_is_the_largest_of_compute_the_link_and_the_host_update():
    """What an offloaded step moves comes from memfit's recorded ops (no GPU): optimizer-state offload
    sends the gradients out and the updated weights back and reads and writes the states on the host;
    the bound is the largest of the three terms, each at its measured bandwidth."""
    wl = ("llama:num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,"
          "num_key_value_heads=1,vocab_size=256,max_position_embeddings=64")
    moved = BOUND.traffic(wl, 2, 64, {"precision": "bf16", "offload": ["optimizer_states"]}, "h100-80gb")
    import memfit
    with __import__("torch").device("meta"):
        n = sum(p.numel() for p in memfit.load_workload(wl, seq_len=64).model().parameters())
    assert moved["fused_host"] and moved["d2h_bytes"] >= 4 * n and moved["h2d_bytes"] >= 4 * n
    assert moved["host_bytes"] >= 16 * n  # (the weight, its gradient and two moments, read)
    terms = BOUND.bound(moved, 0.001, {"h2d": 1e9, "d2h": 1e9}, 1e9)
    assert terms["bound_s"] == max(terms["compute_s"], terms["link_s"], terms["host_s"]) == terms["host_s"]
    plain = BOUND.traffic(wl, 2, 64, {"precision": "bf16"}, "h100-80gb")
    assert plain["h2d_bytes"] == plain["d2h_bytes"] == plain["host_bytes"] == 0


def test_the_host_update_bandwidth_is_measured_here():
    assert BOUND.host_update_bandwidth(1 << 20) > 1e8 and BOUND.host_update_bandwidth(1 << 20, fused=False) > 1e8


def test_the_host_bandwidth_counts_bytes_as_the_steps_ops_do():
    """NOTE [ One count of host bytes ]: the bound's host term is the ops' bytes over the bandwidth measured
    with :data:`UPDATE_BYTES`; the two counts must be one (a fused AdamW over fp32 weights, the EMA's lerp)."""
    import memfit
    wl = "llama:num_hidden_layers=1,hidden_size=256,intermediate_size=512,num_attention_heads=4,vocab_size=1000"
    n = sum(p.numel() for p in memfit.load_workload(wl, seq_len=64).model().parameters())
    offloaded = BOUND.traffic(wl, 2, 64, {"precision": "bf16", "offload": ["optimizer_states"]}, "h200-141gb")
    ema = BOUND.traffic(wl, 2, 64, {"precision": "bf16", "ema": {"decay": 0.999, "device": "cpu"}}, "h200-141gb")
    assert offloaded["host_bytes"] == pytest.approx(BOUND.UPDATE_BYTES["adamw"] * n, rel=1e-4)
    assert ema["host_bytes"] == pytest.approx(BOUND.UPDATE_BYTES["lerp"] * n, rel=1e-4)


def test_an_activation_offloads_link_term_is_out_then_back():
    """NOTE [ Out in forward, back in backward ]: activation offload sends in forward and fetches in backward
    (the two directions one after the other); offloaded optimizer states send and fetch in backward."""
    wl = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=64"
    act = BOUND.traffic(wl, 2, 64, {"precision": "bf16", "offload": ["activations"]}, "h200-141gb")
    assert act["d2h_bytes"] > 0 and act["d2h_forward_bytes"] == act["d2h_bytes"]
    assert act["h2d_backward_bytes"] == act["h2d_bytes"] > 0
    link = {"h2d": 1e9, "d2h": 1e9}
    assert BOUND.bound(act, 0.0, link, None)["link_s"] == pytest.approx((act["d2h_bytes"] + act["h2d_bytes"]) / 1e9)
    states = BOUND.traffic(wl, 2, 64, {"precision": "bf16", "offload": ["optimizer_states"]}, "h200-141gb")
    assert states["d2h_forward_bytes"] == 0
    assert BOUND.bound(states, 0.0, link, None)["link_s"] == pytest.approx(max(states["d2h_bytes"], states["h2d_bytes"]) / 1e9)
