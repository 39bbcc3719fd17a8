"""CUDA caching-allocator snapshots of memfit's steady-state step, and a digest a CPU can read.

A fake-tensor trace sees the tensors that ATen ops return. Kernels also allocate through the
caching allocator behind the op's back: flash-attention backward's fp32 ``dq_accum`` and
``softmax_d``, memory-efficient attention's scratch, cuBLAS workspaces (one per handle: per thread
and stream), cuDNN convolution workspaces, the cuDNN RNN reserve space and workspace. Only the
allocator's own history shows them. For each case this script, in a fresh process:

- records the allocator history (``torch.cuda.memory._record_memory_history``, Python and C++ stacks)
  from before the model is built through two steps (the first creates the optimizer states, the
  second is the steady state), marking each step's phases (zero_grad, forward, backward, optimizer)
  with wall-clock times (the trace's ``time_us`` clock);
- writes the raw snapshot (``snap-CASE.pickle.gz``; pytorch.org/memory_viz reads the unzipped file)
  and a digest ``CASE.json.gz``: every allocation and free of the steady-state step with its size,
  phase, thread (main or autograd's device thread), the ATen op and the C++ frame that allocated it,
  the autograd node, and the innermost Python frame; the blocks live at the step's peak; and a
  table of allocations by origin (op, C++ frame, phase). ``CASE.txt`` is the same in brief.

    python -m tools.gpu.snapshots --out-dir snaps               # the built-in cases, on a GPU
    python -m tools.gpu.snapshots --only lstm --out-dir snaps
    python -m tools.gpu.snapshots --cases tools/gpu/finetune_cases.json --only 4bit --no-pickle --out-dir snaps
    python -m tools.gpu.snapshots --digest snap-x.pickle        # digest an existing snapshot (CPU is fine)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CASES = [
    {"case": "gpt2-bf16-flash-dropout", "workload": "gpt2:n_layer=2", "batch_size": 2, "seq_len": 1024,
     "plan": {"precision": "bf16"}},
    {"case": "gpt2-fp32-memeff", "workload": "gpt2:n_layer=2", "batch_size": 2, "seq_len": 1024, "plan": {}},
    {"case": "timm-resnet50-bf16", "workload": "memfit.workloads.gpu_cases:resnet50", "batch_size": 16, "seq_len": None,
     "plan": {"precision": "bf16"}},
    {"case": "lstm_lm-fp32", "workload": "memfit.workloads.gpu_cases:lstm_lm", "batch_size": 8, "seq_len": None,
     "plan": {}},
    {"case": "lstm-fp32", "workload": "lstm", "batch_size": 32, "seq_len": None, "plan": {}},
    # reserved-peak misses of 2026-11-23 (allocated within 0.2%, reserved off by 5-9%)
    {"case": "rsv-vit_small-bf16-blocks", "workload": "memfit.workloads.gpu_cases:vit_small", "batch_size": 128,
     "seq_len": None, "plan": {"precision": "bf16", "checkpointing": "blocks"}},
    {"case": "rsv-unet-bf16-blocks", "workload": "memfit.workloads.gpu_cases:unet", "batch_size": 16, "seq_len": None,
     "plan": {"precision": "bf16", "checkpointing": "blocks"}},
    {"case": "rsv-unet-fp32", "workload": "memfit.workloads.gpu_cases:unet", "batch_size": 16, "seq_len": None,
     "plan": {}},
    {"case": "rsv-convnext_tiny-fp32", "workload": "memfit.workloads.gpu_cases:convnext_tiny", "batch_size": 64,
     "seq_len": None, "plan": {}},
    {"case": "rsv-lstm_lm-fp32", "workload": "memfit.workloads.gpu_cases:lstm_lm", "batch_size": 32, "seq_len": None,
     "plan": {}},
    {"case": "rsv-lstm_lm-bf16", "workload": "memfit.workloads.gpu_cases:lstm_lm", "batch_size": 32, "seq_len": None,
     "plan": {"precision": "bf16"}},
    {"case": "rsv-resnet50-bf16-blocks", "workload": "memfit.workloads.gpu_cases:resnet50", "batch_size": 64,
     "seq_len": None, "plan": {"precision": "bf16", "checkpointing": "blocks"}},
]

# -- the digest (pure Python: runs on any machine) -------------------------------------------------

PLUMBING = (
    "torch::unwind", "torch::CapturedTraceback", "torch::cuda::(anonymous namespace)::gather",
    "c10::cuda::CUDACachingAllocator", "at::detail::empty", "at::native::empty", "at::empty", "at::zeros",
    "at::native::zeros", "at::native::full", "at::native::new_", "at::native::resize", "at::cuda::detail::empty",
    "at::(anonymous namespace)::(anonymous namespace)::wrapper_", "at::(anonymous namespace)::wrapper_",
    "at::(anonymous namespace)::create_out", "at::native::(anonymous namespace)::create_out",
    "at::(anonymous namespace)::structured_", "at::(anonymous namespace)::(anonymous namespace)::structured_",
    "c10::impl::", "at::_ops::", "c10::Dispatcher", "c10::BoxedKernel", "c10::KernelFunction", "at::TensorBase::",
    "at::Tensor::", "c10::TensorImpl", "c10::StorageImpl", "at::TensorIteratorBase", "at::meta::",
    "torch::autograd::VariableType", "torch::ADInplaceOrView", "at::functionalization", "at::autocast::",
    "c10::detail::", "std::", "at::native::empty_like", "c10::cuda::CUDAAllocator", "c10::Allocator",
)
ALLOC_OPS = {"empty", "empty_memory_format", "empty_strided", "empty_like", "zeros", "zeros_like", "new_empty",
             "new_empty_strided", "new_zeros", "resize_", "full", "full_like", "ones", "ones_like", "fill_", "zero_"}
OP_RE = re.compile(r"at::_ops::(\w+)::(?:call|redispatch)")
NODE_RE = re.compile(r"torch::autograd::generated::(\w+)::apply|torch::autograd::CppNode<([\w:]+)>|"
                     r"torch::autograd::(PyNode)::apply")


def _is_py(f: dict) -> bool:
    return f["filename"].endswith(".py")


def _short_path(path: str) -> str:
    for marker in ("site-packages/", "/src/", "/bench/", "/tools/"):
        if marker in path:
            return (marker[1:] if marker in ("/bench/", "/tools/") else "") + path.split(marker, 1)[1]
    return path


def origin(frames: list[dict]) -> dict:
    """Where an allocation came from: ATen op, C++ frame, autograd node, thread, Python frames."""
    op = cpp = node = py = user = None
    thread = "main"
    for f in frames:
        name = f["name"]
        if _is_py(f):
            where = f"{_short_path(f['filename'])}:{f['line']}:{name}"
            py = py or where
            if user is None and "/torch/" not in f["filename"]:
                user = where
            continue
        if op is None:
            m = OP_RE.search(name)
            if m and m.group(1) not in ALLOC_OPS:
                op = m.group(1)
        if cpp is None and name and not name.startswith(("_Py", "Py", "??")) and not name.startswith(PLUMBING):
            cpp = name[:160]
        if node is None:
            m = NODE_RE.search(name)
            if m:
                node = next(g for g in m.groups() if g)
        if "Engine::thread_main" in name:
            thread = "autograd"
    return {"op": op, "cpp": cpp, "node": node, "thread": thread, "py": py, "user_py": user}


def marks_from_annotations(snapshot: dict) -> list[dict]:
    """Step phases of a snapshot recorded without a PhaseClock, from the optimizer's record_function
    annotations (``Optimizer.zero_grad#...`` and ``Optimizer.step#...``, START and END): step i runs
    from its zero_grad to the end of its optimizer step; between them lies "forward/backward", which
    :func:`digest` splits by thread (autograd's device thread: backward; the main thread: forward)."""
    ann = sorted(snapshot.get("external_annotations") or [], key=lambda a: a["time_us"])
    spans: dict[str, list] = {"zero_grad": [], "optimizer": []}
    opened: dict[str, int] = {}
    for a in ann:
        kind = "zero_grad" if a["name"].startswith("Optimizer.zero_grad") else \
            "optimizer" if a["name"].startswith("Optimizer.step") else None
        if kind is None:
            continue
        if a["stage"] == "START":
            opened[kind] = a["time_us"]
        elif kind in opened:
            spans[kind].append((opened.pop(kind), a["time_us"]))
    marks = []
    for i, ((z0, z1), (o0, o1)) in enumerate(zip(spans["zero_grad"], spans["optimizer"]), start=1):
        marks += [{"step": i, "phase": "zero_grad", "start_us": z0, "end_us": z1},
                  {"step": i, "phase": "forward/backward", "start_us": z1, "end_us": o0},
                  {"step": i, "phase": "optimizer", "start_us": o0, "end_us": o1}]
    return marks


def digest(snapshot: dict, marks: list[dict] | None = None, steady: int = 2, meta: dict | None = None) -> dict:
    """Every allocator event of the steady-state step, with its origin; live blocks at the peak.

    ``marks``: [{"step", "phase", "start_us", "end_us"}] from the run (see :class:`PhaseClock` and
    :func:`marks_from_annotations`); without them the whole trace is the window."""
    trace = [e for e in snapshot["device_traces"][0] if e["action"] != "free_requested"]
    window = [m for m in (marks or []) if m["step"] == steady]
    t0 = min(m["start_us"] for m in window) if window else -1
    t1 = max(m["end_us"] for m in window) if window else float("inf")

    def phase_of(t):
        if not window:
            return "trace"
        for m in window:
            if m["start_us"] <= t <= m["end_us"]:
                return m["phase"]
        return "between"

    strings: dict[str, int] = {}

    def s(x):
        if x is None:
            return None
        return strings.setdefault(x, len(strings))

    live: dict[int, tuple] = {}   # addr -> (size, block id, origin, phase, t)
    allocated = reserved = 0
    before = None
    peak, peak_at, peak_live = -1, None, None
    events, ids = [], 0
    by_origin: dict[tuple, list] = collections.defaultdict(lambda: [0, 0, 0, 0])  # count, bytes, max, freed in step
    for e in trace:
        t, act, size = e["time_us"], e["action"], e["size"]
        inside = t0 <= t <= t1
        if inside and before is None:
            before = {"allocated": allocated, "reserved": reserved}
        if t > t1:
            break
        if act == "alloc":
            o = origin(e["frames"])
            ids += 1
            ph = phase_of(t) if inside else "setup"
            if ph == "forward/backward":
                ph = "backward" if o["thread"] == "autograd" else "forward"
            live[e["addr"]] = (size, ids, o, ph, t)
            allocated += size
        elif act == "free_completed":
            rec = live.pop(e["addr"], None)
            allocated -= size
            o = rec[2] if rec else {}
        elif act == "segment_alloc":
            reserved += size
            o = {}
        elif act == "segment_free":
            reserved -= size
            o = {}
        else:
            continue
        if not inside:
            continue
        ph = live[e["addr"]][3] if act == "alloc" else phase_of(t)
        block = live[e["addr"]][1] if act == "alloc" else (rec[1] if act == "free_completed" and rec else None)
        events.append([len(events), round((t - t0) / 1000, 3), act, size, block, ph, o.get("thread"),
                       s(o.get("op")), s(o.get("cpp")), s(o.get("node")), s(o.get("py")), s(o.get("user_py")),
                       allocated])
        if act == "alloc":
            k = (ph, o.get("op"), o.get("cpp"), o.get("node"), o.get("thread"))
            agg = by_origin[k]
            agg[0] += 1
            agg[1] += size
            agg[2] = max(agg[2], size)
        elif act == "free_completed" and rec and rec[3] != "setup":
            k = (rec[3], rec[2].get("op"), rec[2].get("cpp"), rec[2].get("node"), rec[2].get("thread"))
            by_origin[k][3] += 1
        if allocated > peak:
            peak, peak_at = allocated, len(events) - 1
            peak_live = dict(live)
    if before is None:  # nothing happened in the window
        before = {"allocated": allocated, "reserved": reserved}
    groups: dict[tuple, list] = collections.defaultdict(lambda: [0, 0])
    for size, _, o, ph, _t in (peak_live or {}).values():
        g = groups[(ph if ph in ("setup", "trace") else f"step{steady}:{ph}", o.get("op"), o.get("cpp"), o.get("node"),
                    o.get("user_py"))]
        g[0] += 1
        g[1] += size
    names = {v: k for k, v in strings.items()}
    return {
        **(meta or {}),
        "window": "steady-state step" if window else "whole trace",
        "before_step": before,
        "peak_allocated_in_step": peak, "peak_event": peak_at,
        "peak_phase": events[peak_at][5] if peak_at is not None else None,
        "live_at_peak": [{"phase": k[0], "op": k[1], "cpp": k[2], "node": k[3], "user_py": k[4], "count": v[0],
                          "bytes": v[1]} for k, v in sorted(groups.items(), key=lambda kv: -kv[1][1])],
        "allocs_by_origin": [{"phase": k[0], "op": k[1], "cpp": k[2], "node": k[3], "thread": k[4], "count": v[0],
                              "bytes": v[1], "max_bytes": v[2], "freed_in_step": v[3]}
                             for k, v in sorted(by_origin.items(), key=lambda kv: -kv[1][1])],
        "event_columns": ["i", "ms", "action", "size", "block", "phase", "thread", "op", "cpp", "node", "py",
                          "user_py", "allocated_after"],
        "strings": [names[i] for i in range(len(names))],
        "events": events,
    }


def text_summary(d: dict, top: int = 40) -> str:
    """The digest in brief: peak, what is live at it, and the largest allocations by origin."""
    mib = 2**20
    lines = [f"# {d.get('case', '?')}  {json.dumps(d.get('spec') or d.get('source'))}",
             "sizes are the bytes each allocation requested (the allocator rounds blocks up to 512 B); "
             f"phases: {d.get('phases_from', 'time stamps of the TrainStep phases')}",
             f"window: {d['window']}; allocated before the step {d['before_step']['allocated'] / mib:.1f} MiB, "
             f"reserved {d['before_step']['reserved'] / mib:.1f} MiB; peak in the step "
             f"{d['peak_allocated_in_step'] / mib:.1f} MiB during {d['peak_phase']}"
             + (f" (max_memory_allocated {d['max_memory_allocated'] / mib:.1f} MiB)" if d.get("max_memory_allocated")
                else ""),
             "", "## live at the peak (by origin)", "MiB | n | phase | op | C++ frame | node | user Python"]
    for g in d["live_at_peak"][:top]:
        lines.append(f"{g['bytes'] / mib:9.2f} | {g['count']} | {g['phase']} | {g['op']} | {g['cpp']} | {g['node']} | "
                     f"{g['user_py']}")
    lines += ["", "## allocations in the step (by origin)", "MiB | n | max MiB | freed | phase | thread | op | C++ | node"]
    for g in d["allocs_by_origin"][:top]:
        lines.append(f"{g['bytes'] / mib:9.2f} | {g['count']} | {g['max_bytes'] / mib:.2f} | {g['freed_in_step']} | "
                     f"{g['phase']} | {g['thread']} | {g['op']} | {g['cpp']} | {g['node']}")
    return "\n".join(lines) + "\n"


KERNEL_KEYS = {"cublas_workspace": "setWorkspaceForHandle", "cublaslt_workspace": "getCUDABlasLtWorkspace",
               "conv_workspace": "run_conv_plan", "attention": "attention", "rnn": "rnn", "foreach": "_foreach_"}


def kernel_facts(d: dict) -> dict:
    """What a digest says about kernel-side allocations: per kind, each distinct (phase, thread, op,
    C++ frame) with its count and sizes; and the foreach temporaries live at the peak."""
    out: dict = {"case": d.get("case"), "peak_allocated_in_step": d["peak_allocated_in_step"],
                 "peak_phase": d["peak_phase"]}
    sizes: dict[tuple, list] = collections.defaultdict(list)
    strings = d["strings"]
    for ev in d["events"]:
        _, _, action, size, _, phase, thread, op, cpp, node, *_ = ev
        if action == "alloc":
            sizes[(phase, thread, strings[op] if op is not None else None,
                   strings[cpp] if cpp is not None else None, strings[node] if node is not None else None)].append(size)
    for g in d["live_at_peak"]:
        if g["phase"] == "setup":  # allocated before the step and still live at its peak (e.g. workspaces)
            sizes[("before the step", None, g["op"], g["cpp"], g["node"])].append(g["bytes"])
    for kind, key in KERNEL_KEYS.items():
        rows = [{"phase": k[0], "thread": k[1], "op": k[2], "cpp": (k[3] or "")[:120], "node": k[4], "count": len(v),
                 "sizes": sorted(set(v))[:8]}
                for k, v in sizes.items() if key in f"{k[2]} {k[3]}"]
        if rows:
            out[kind] = rows
    foreach = [g for g in d["live_at_peak"] if (g["op"] or "").startswith("_foreach_")]
    if foreach:
        out["foreach_live_at_peak_bytes"] = sum(g["bytes"] for g in foreach)
    return out


def write_digest(d: dict, out_dir: Path, case: str) -> None:
    with gzip.open(out_dir / f"{case}.json.gz", "wt") as f:
        json.dump(d, f, separators=(",", ":"))
    (out_dir / f"{case}.txt").write_text(text_summary(d))


# -- the capture (in a fresh process on a GPU) -----------------------------------------------------

class PhaseClock:
    """A TrainStep observer that time-stamps each phase (the allocator trace's clock: unix µs)."""

    def __init__(self):
        self.step = 0
        self.marks: list[dict] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        import torch
        torch.cuda.synchronize()
        setter = getattr(torch.cuda.memory, "_set_memory_metadata", None)
        if setter:
            setter(f"step{self.step}:{name}")
        start = time.time_ns() // 1000
        try:
            yield
        finally:
            torch.cuda.synchronize()
            self.marks.append({"step": self.step, "phase": name, "start_us": start, "end_us": time.time_ns() // 1000})

    def host(self, tensors) -> None:
        pass


def capture(case: dict, out_dir: Path, keep_pickle: bool = True) -> dict:
    import torch

    import memfit
    from memfit.step import make_batch
    from tools.gpu.ground_truth import resolve_workload, versions

    torch.cuda.mem_get_info()
    if case.get("memory_limit_bytes"):  # a smaller card, as tools/gpu/ground_truth.py caps it
        from memfit.training.enforce import limit_cuda_allocator
        limit_cuda_allocator(case["memory_limit_bytes"])
    torch.manual_seed(0)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    wl = resolve_workload(case)
    dev = memfit.get_device("cuda")
    clock = PhaseClock()
    step = memfit.build_step(wl, memfit.Plan(**case["plan"]), case["batch_size"], device=dev, observer=clock)
    batch = make_batch(step.target)
    at_start = {}
    for i in (1, 2):
        clock.step = i
        torch.cuda.synchronize()
        if i == 2:
            torch.cuda.reset_peak_memory_stats()
        at_start[i] = torch.cuda.memory_allocated()
        step(batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    t = time.perf_counter()
    snap = torch.cuda.memory._snapshot()
    snap_s = time.perf_counter() - t
    torch.cuda.memory._record_memory_history(enabled=None)
    meta = {"case": case["case"], "spec": case, "marks": clock.marks, "allocated_at_step_start": at_start,
            "max_memory_allocated": peak, "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "snapshot_seconds": round(snap_s, 2), "versions": versions()}
    d = digest(snap, clock.marks, 2, meta)
    write_digest(d, out_dir, case["case"])
    if keep_pickle:
        with gzip.open(out_dir / f"snap-{case['case']}.pickle.gz", "wb", compresslevel=6) as f:
            pickle.dump(snap, f)
    return {"case": case["case"], "peak": peak, "digest_peak": d["peak_allocated_in_step"],
            "allocated_at_step2_start": at_start[2], "digest_before": d["before_step"]["allocated"],
            "events": len(d["events"]), "snapshot_seconds": round(snap_s, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=".", help="where digests (and pickles) go")
    ap.add_argument("--only", metavar="REGEX", help="only cases whose id matches")
    ap.add_argument("--cases", metavar="FILE.json", help="cases of tools/gpu/ground_truth.py's format instead of the "
                                                         "built-in ones (memory_limit_bytes honoured)")
    ap.add_argument("--no-pickle", action="store_true", help="write the digest only")
    ap.add_argument("--digest", metavar="SNAPSHOT.pickle", help="digest an existing snapshot (its steps found from the "
                                                                "optimizer's annotations)")
    ap.add_argument("--steady", type=int, default=None, help="with --digest: the step to digest (default: the last)")
    ap.add_argument("--facts", metavar="FILE.json", help="summarise the kernel-side allocations of every digest in "
                                                          "--out-dir into this file")
    ap.add_argument("--one", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.facts:
        facts = [kernel_facts(json.load(gzip.open(p, "rt"))) for p in sorted(out.glob("*.json.gz"))]
        Path(args.facts).write_text(json.dumps(facts, indent=1) + "\n")
        print(json.dumps(facts, indent=1)[:4000])
        return 0
    if args.digest:
        opener = gzip.open if args.digest.endswith(".gz") else open
        with opener(args.digest, "rb") as f:
            snap = pickle.load(f)
        name = Path(args.digest).name.split(".")[0]
        marks = marks_from_annotations(snap)
        steady = args.steady or (max(m["step"] for m in marks) if marks else 2)
        meta = {"case": name, "source": str(args.digest), "marks": marks,
                "phases_from": "optimizer record_function annotations; forward/backward split by thread"}
        write_digest(digest(snap, marks, steady, meta=meta), out, name)
        print((out / f"{name}.txt").read_text()[:3000])
        return 0
    if args.one:
        print("RESULT " + json.dumps(capture(json.loads(args.one), out, not args.no_pickle)), flush=True)
        return 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    failed = 0
    for case in (json.loads(Path(args.cases).read_text()) if args.cases else CASES):
        if args.only and not re.search(args.only, case["case"]):
            continue
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "tools.gpu.snapshots", "--one", json.dumps(case), "--out-dir", str(out)]
        if args.no_pickle:
            cmd.append("--no-pickle")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
            result = next((ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        except subprocess.TimeoutExpired:
            p, result = None, None
        if result is None:
            failed += 1
            print(f"{case['case']}: FAILED {(p.stderr[-1500:] if p else 'timed out')}", flush=True)
        else:
            print(f"{result}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
