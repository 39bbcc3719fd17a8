"""memory_viz snapshots (memfit.memory.snapshot): the pickle holds what PyTorch's viewer reads, loads
through torch.cuda._memory_viz's own functions, and says what the report says: the trace's peak in
the steady-state step is the predicted peak, the blocks live at that point add up to it (split by
category as in the report's breakdown), and a GPU preset's segments add up to the reserved bytes.

The viewer itself (torch/utils/viz/MemoryViz.js) is not in the installed torch; what it reads is
pinned here: the opcodes its unpickler knows, blocks that tile their segment, the keys it uses.
"""

import base64
import contextlib
import io
import pickle
import pickletools
import re
import types

import pytest
import torch
import torch.cuda._memory_viz as memory_viz
from torch import nn

from memfit.cli.main import main
from memfit.devices import cpu_device
from memfit.memory.categories import CATEGORIES
from memfit.memory.estimate import estimate
from memfit.memory.measure import _profile_cuda, profile
from memfit.plans import Plan
from memfit.target import Target
from memfit.workload import Workload

GPT2 = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128"
MHA = "mha:dim=32,heads=2,layers=1,vocab=100"

# The opcodes MemoryViz.js's unpickle() handles (protocols 2-4); anything else throws "UNKNOWN OPCODE".
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWTRUE", "NEWFALSE",
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
}
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "snapshot"}


def _estimated(tmp_path_factory, device, plan=None):
    path = tmp_path_factory.mktemp("snap") / "s.pickle"
    report = estimate(GPT2, plan or Plan(), batch_size=2, seq_len=64, device=device, snapshot=str(path))
    return report, path.read_bytes()


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    return _estimated(tmp_path_factory, "cpu")


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    return _estimated(tmp_path_factory, "a100-40gb", Plan(precision="bf16"))


def _frames_ok(frames):
    return isinstance(frames, list) and all(
        isinstance(f["filename"], str) and isinstance(f["line"], int) and isinstance(f["name"], str) for f in frames)


@pytest.mark.parametrize("which", ["cpu", "gpu"])
def test_pickle_holds_what_memory_viz_reads(which, request):
    report, raw = request.getfixturevalue(which)
    ops = {op.name for op, _, _ in pickletools.genops(raw)}
    assert ops <= VIEWER_OPCODES, f"the viewer cannot unpickle {ops - VIEWER_OPCODES}"
    assert raw[:2] == b"\x80\x04"  # protocol 4
    snap = pickle.loads(raw)
    assert {"segments", "device_traces"} <= set(snap) and len(snap["device_traces"]) == 1
    assert snap["segments"]
    for seg in snap["segments"]:
        assert seg["device"] == 0 and seg["stream"] == 0 and seg["segment_type"] in ("small", "large")
        assert 0 < seg["address"] < 2**53 and _frames_ok(seg["frames"])
        addr = seg["address"]
        for b in seg["blocks"]:  # the viewer places each block after the ones before it
            assert b["address"] == addr and b["state"] in ("active_allocated", "inactive")
            assert 0 <= b["requested_size"] <= b["size"] and _frames_ok(b["frames"])
            addr += b["size"]
        assert addr == seg["address"] + seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    trace = snap["device_traces"][0]
    assert trace[-1]["action"] == "snapshot" and trace[-1]["category"] == "unknown"
    for e in trace:
        assert e["action"] in ACTIONS and _frames_ok(e["frames"])
        assert isinstance(e["addr"], int) and isinstance(e["size"], int) and e["stream"] == 0
    # a free is requested then completed, as the viewer pairs them
    for i, e in enumerate(trace):
        if e["action"] == "free_completed":
            assert trace[i - 1]["action"] == "free_requested" and trace[i - 1]["addr"] == e["addr"]
    assert {e["category"] for e in trace if e["action"] == "alloc"} <= set(CATEGORIES)
    assert snap["memfit"]["kind"] == "prediction" and snap["memfit"]["report_peak_bytes"] == report.peak_bytes


@pytest.mark.parametrize("which", ["cpu", "gpu"])
def test_loads_through_torch_memory_viz(which, request):
    _, raw = request.getfixturevalue(which)
    snap = pickle.loads(raw)
    lines = memory_viz.memory(snap, format_flamegraph=lambda text: text)
    assert "GPT2LMHeadModel.transformer.h.1.mlp.c_fc.weight:0:parameters" in lines
    assert "step:2:backward;GPT2LMHeadModel.transformer.h.1.mlp.c_fc.weight.grad:0:gradients;op:0:" in lines
    by_segment = memory_viz.segments(snap, format_flamegraph=lambda text: text)
    assert by_segment.count("seg_") >= len(snap["segments"])
    with contextlib.redirect_stdout(io.StringIO()):
        assert memory_viz.compare(snap["segments"], snap["segments"][1:], format_flamegraph=lambda t: t)
    stats = memory_viz.segsum(snap)  # asserts its own accounting of every segment
    assert f"segments: {len(snap['segments'])}" in stats
    text = memory_viz.trace(snap)
    assert text.startswith("Device 0") and f"{len(snap['device_traces'][0])} entries" in text
    for html in (memory_viz.trace_plot(snap), memory_viz.trace_plot(snap, plot_segments=True),
                 memory_viz.segment_plot(snap)):
        encoded = re.search(r'"base64": "([^"]+)"', html).group(1)
        assert pickle.loads(base64.b64decode(encoded).rstrip(b"\x00")) == snap
    with contextlib.redirect_stdout(io.StringIO()):
        filtered = memory_viz.filter_alloc_free_pairs(pickle.loads(raw))
    assert all(e["action"] not in ("free_requested", "free_completed") for e in filtered["device_traces"][0])


def _replay(trace):
    """Allocated bytes after each entry, from alloc and free_completed (what the viewer plots)."""
    live, out = 0, []
    for e in trace:
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        out.append(live)
    return out


def _live_blocks_after(snap, k):
    """addr -> (size, category) of the blocks live just after entry ``k``, walked back from the
    segments at the end as the viewer's Allocator State History does; each must lie in a segment."""
    blocks = {b["address"]: (b["size"], None) for s in snap["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated"}
    segments = {s["address"]: s["total_size"] for s in snap["segments"]}
    trace = snap["device_traces"][0]
    category = {}
    for e in trace[:k + 1]:
        if e["action"] == "alloc":
            category[e["addr"]] = e["category"]
    for e in reversed(trace[k + 1:]):
        if e["action"] == "alloc":
            del blocks[e["addr"]]
        elif e["action"] == "free_completed":
            blocks[e["addr"]] = (e["size"], e["category"])
        elif e["action"] == "segment_alloc":
            del segments[e["addr"]]
        elif e["action"] == "segment_free":
            segments[e["addr"]] = e["size"]
    for addr, (size, _) in blocks.items():
        assert any(s <= addr and addr + size <= s + n for s, n in segments.items()), f"block {addr} outside segments"
    return {a: (size, cat or category[a]) for a, (size, cat) in blocks.items()}, segments


@pytest.mark.parametrize("which", ["cpu", "gpu"])
def test_snapshot_says_what_the_report_says(which, request):
    report, raw = request.getfixturevalue(which)
    snap = pickle.loads(raw)
    trace, first = snap["device_traces"][0], snap["memfit"]["steady_step_first_entry"]
    assert 0 < first < len(trace)
    allocated = _replay(trace)
    peak = max(allocated[first:])
    assert peak == report.peak_bytes
    at = first + allocated[first:].index(peak)
    blocks, segments = _live_blocks_after(snap, at)
    assert sum(size for size, _ in blocks.values()) == report.peak_bytes
    if which == "cpu":  # storage bytes: the category split is the report's breakdown
        by_category = dict.fromkeys(CATEGORIES, 0)
        for size, cat in blocks.values():
            by_category[cat] += size
        assert by_category == report.breakdown
    else:  # the caching allocator's segments at the end of the step are the reserved bytes
        assert sum(s["total_size"] for s in snap["segments"]) == report.reserved_bytes
        assert any(b["state"] == "inactive" for s in snap["segments"] for b in s["blocks"])
        assert any(b["requested_size"] < b["size"] for s in snap["segments"] for b in s["blocks"])


def test_frames_name_the_module_the_category_and_the_phase(cpu):
    snap = pickle.loads(cpu[1])
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    names = {(f["filename"], f["name"]) for e in allocs for f in e["frames"]}
    modules = {f for f, cat in names if cat == "activations"}
    assert any(m.startswith("GPT2LMHeadModel.transformer.h.1.") for m in modules)  # a block's submodule
    assert "Global" not in modules
    params = {f for f, cat in names if cat == "parameters"}
    assert "GPT2LMHeadModel.transformer.h.0.attn.c_attn.weight" in params
    states = {f for f, cat in names if cat == "optimizer_states"}
    assert {"GPT2LMHeadModel.transformer.h.0.attn.c_attn.weight.exp_avg",
            "GPT2LMHeadModel.transformer.h.0.attn.c_attn.weight.exp_avg_sq"} <= states
    phases = {(f["line"], f["name"]) for e in allocs for f in e["frames"] if f["filename"] == "step"}
    assert {(2, "forward"), (2, "backward"), (2, "optimizer"), (0, "setup")} <= phases
    for e in allocs:
        assert [f["filename"] for f in e["frames"]][0] == "op" and e["frames"][1]["name"] == e["category"]


def test_profile_writes_the_measured_run(tmp_path):
    path = tmp_path / "measured.pkl"
    result = profile(GPT2, Plan(), batch_size=2, seq_len=64, repeats=0, snapshot=str(path))
    snap = pickle.loads(path.read_bytes())
    assert snap["memfit"]["kind"] == "measurement" and snap["memfit"]["method"] == "real"
    first = snap["memfit"]["steady_step_first_entry"]
    assert max(_replay(snap["device_traces"][0])[first:]) == result.tracker_peak_bytes
    # the profiler sees kernel scratch the tracker cannot: the two agree within 1%
    assert abs(result.tracker_peak_bytes - result.peak_bytes) <= 0.01 * result.peak_bytes


def test_profile_on_cuda_writes_the_allocators_own_snapshot(tmp_path):
    """On a GPU the snapshot is torch.cuda.memory._snapshot() of the steady step (a stand-in here)."""
    log = []
    real = {"segments": [{"device": 0, "address": 1 << 40, "total_size": 2 << 20, "stream": 0, "blocks": []}],
            "device_traces": [[{"action": "alloc", "addr": 1 << 40, "size": 512, "stream": 0, "frames": []}]]}
    cuda = types.SimpleNamespace(
        synchronize=lambda: None, reset_peak_memory_stats=lambda: None, memory_allocated=lambda: 0,
        memory_reserved=lambda: 0, max_memory_allocated=lambda: 1 << 20, max_memory_reserved=lambda: 2 << 20,
        mem_get_info=lambda: (1 << 30, 2 << 30),
        memory=types.SimpleNamespace(_record_memory_history=lambda enabled="all", **kw: log.append(enabled),
                                     _snapshot=lambda: log.append("snapshot") or real))
    wl = Workload(model=lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)),
                  batch=lambda n: torch.randn(n, 32), loss=lambda m, x: m(x).pow(2).mean(), name="toy")
    predicted = estimate(wl, Plan(), batch_size=2, device="h100-80gb")
    path = tmp_path / "cuda.pickle"
    _profile_cuda(Target.resolve(wl, Plan(), 2, cpu_device()), predicted, 0, None, cuda=cuda, snapshot=str(path))
    assert log == ["all", "snapshot", None]  # recorded around the steady step only
    snap = pickle.loads(path.read_bytes())
    assert snap["segments"] == real["segments"] and snap["device_traces"] == real["device_traces"]
    assert snap["memfit"]["kind"] == "measurement" and snap["memfit"]["report_peak_bytes"] == 1 << 20


def _cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_cli_flag_writes_the_file(tmp_path):
    path = tmp_path / "mha.pickle"
    code, out, err = _cli(["estimate", MHA, "--batch-size", "2", "--seq-len", "16", "--snapshot", str(path)])
    assert code == 0, err
    assert f"snapshot written to {path}" in out
    snap = pickle.loads(path.read_bytes())
    assert memory_viz.segsum(snap) and snap["memfit"]["workload"].startswith("mha")


@pytest.mark.parametrize("command", ["estimate", "profile"])
@pytest.mark.parametrize("bad, says", [
    ("{d}", "is a folder; give a file name, e.g. --snapshot"),
    ("{d}/missing/s.pickle", "does not exist; create it first"),
    ("{d}/s.png", "cannot write a .png file; give a name ending in .pickle"),
    ("/proc/memfit-snapshot.pickle", "cannot write --snapshot"),
])
def test_cli_bad_path_is_one_line_and_exit_2(tmp_path, command, bad, says):
    code, out, err = _cli([command, MHA, "--batch-size", "2", "--seq-len", "16",
                           "--snapshot", bad.format(d=tmp_path)])
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"memfit {command}: error: ") and says in err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


def test_library_refuses_an_unwritable_path_before_tracing(tmp_path, monkeypatch):
    from memfit.errors import UserError
    from memfit.memory import estimate as estimate_module
    monkeypatch.setattr(estimate_module, "run_tracked", lambda *a, **k: pytest.fail("traced before the path check"))
    with pytest.raises(UserError, match="--snapshot .* is a folder"):
        estimate(MHA, batch_size=2, seq_len=16, snapshot=str(tmp_path))


def test_segments_released_by_empty_cache_leave_the_snapshot():
    """A segment empty_cache gives back (FSDP2 after sharding a model built whole) is freed in the
    trace, and the segments at the end are the allocator model's reserved bytes."""
    from memfit.memory import allocator
    from memfit.memory.report import step_window
    from memfit.memory.snapshot import tracker_snapshot
    from memfit.memory.tracker import MemoryTracker

    tracker = MemoryTracker()
    with tracker:
        tracker.mark("step")
        whole = torch.empty(3 << 20, dtype=torch.uint8)  # its own 20 MiB segment
        kept = torch.empty(1 << 10, dtype=torch.uint8)  # a 2 MiB small-pool segment
        del whole
        tracker.mark("empty_cache")
        tracker.mark("step")
        later = torch.empty(5 << 20, dtype=torch.uint8)  # a new 20 MiB segment
        del later
        tracker.mark("end")
    snap = tracker_snapshot(tracker, "cpu", cached=True)
    trace = snap["device_traces"][0]
    made = [(e["addr"], e["size"]) for e in trace if e["action"] == "segment_alloc"]
    freed = [(e["addr"], e["size"]) for e in trace if e["action"] == "segment_free"]
    assert [size for _, size in made] == [20 << 20, 2 << 20, 20 << 20] and freed == [made[0]]
    released = next(i for i, e in enumerate(trace) if e["action"] == "segment_free")
    assert released < snap["memfit"]["steady_step_first_entry"]  # before step 2, where the mark was
    _, reserved, _ = allocator.replay(tracker, "cpu", step_window(tracker, 2))
    assert sorted((s["address"], s["total_size"]) for s in snap["segments"]) == sorted(made[1:])
    assert sum(s["total_size"] for s in snap["segments"]) == reserved == (22 << 20)
    _live_blocks_after(snap, 0)  # walking back to the start meets every segment again
    assert memory_viz.segsum(snap) and kept.numel() == 1 << 10
