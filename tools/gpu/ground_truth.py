"""Measure memfit's training steps on the local CUDA GPU: ground truth for GPU-preset predictions.

Each case (workload, batch size, sequence length, plan) runs in a fresh Python process, so no
case inherits another's caching-allocator state, cuBLAS handles or cuDNN plans. In that process:

1. ``device_used_before_model``: ``total - free`` from ``torch.cuda.mem_get_info()`` before the model
   is built (the CUDA context alone);
2. the step is built with ``memfit.build_step`` (the same TrainStep estimate traces) and run twice:
   the first step creates the optimizer states, the second reaches the steady state;
3. ``torch.cuda.reset_peak_memory_stats()``, one step, then ``max_memory_allocated`` /
   ``max_memory_reserved`` (the steady-state peak) and ``device_used_after_step`` (``total - free``:
   the CUDA context and library handles included);
4. ``step_seconds_median``: the median of 5 more steps, each synchronised.

Rows are appended to ``--out`` as JSON lines in the schema of ``tests/data/h100.jsonl`` plus the
machine and versions (GPU, driver, torch, CUDA, cuDNN, transformers, timm, bitsandbytes, memfit
commit). A case that fails records ``error`` (and the end of its traceback) instead of aborting.

    python -m tools.gpu.ground_truth --list                       # the built-in cases
    python -m tools.gpu.ground_truth --out h100-new.jsonl         # all built-in cases
    python -m tools.gpu.ground_truth --only 'resnet|unet' --out x.jsonl
    python -m tools.gpu.ground_truth --cases my_cases.json --out x.jsonl
    python -m tools.gpu.ground_truth --device cpu --cases tiny.json   # smoke test, no GPU (no memory figures)
    python -m tools.gpu.ground_truth --jobs 4 --predict --out x.jsonl   # 4 cases overlap; predictions too

``--jobs N`` overlaps N cases' CPU work (imports, model building, predictions); their GPU phases
(build_step through the timed steps) take turns under a file lock, so the peaks and step times are
those of a case alone on the GPU. ``device_used_*`` (``total - free``) would count the other cases'
CUDA contexts, so with ``--jobs`` above 1 they are left out and the row records ``overlapped_jobs``.
``--predict`` adds what memfit predicts for the case in the same process, after the measurement,
with the same library versions: ``predicted_cuda`` (``device="cuda"``, the local card) and
``predicted_preset`` (the preset ``--preset`` names), each ``{"allocated", "reserved"}``.

A case file is a JSON list of objects ``{"case": id, "workload": spec, "batch_size": n,
"seq_len": t or null, "plan": {Plan fields}}`` and optionally ``"memory_limit_bytes": n`` (the caching
allocator is capped there with ``torch.cuda.set_per_process_memory_fraction``: a smaller card, as
``memfit train --budget`` enforces it; the row records the fraction); ``"leave_bytes": n`` leaves only n bytes of the card free
(a ballast outside PyTorch's allocator, :func:`ballast`); ``workload`` is a built-in name,
``package.module:NAME`` or ``path/to/file.py:NAME`` (memfit's user formats); ``"load": "built"`` builds a
built-in on the device instead of loading it as a checkpoint; ``"kwargs": {...}`` calls NAME with them (tiny
sizes for a smoke test); ``"profile": true`` adds the step's top CUDA kernels by time (``kernels``). Set
``MEMFIT_COMMIT`` where the checkout has no ``.git``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WARMUP_STEPS = 2
TIMED_STEPS = 5


# -- the child: one case in this process -----------------------------------------------------------

def resolve_workload(case: dict):
    """The case's Workload: a built-in, ``package.module:NAME`` or ``file.py:NAME`` (NAME called with
    ``kwargs`` when given)."""
    from memfit.workloads import load_workload
    spec, kwargs = case["workload"], case.get("kwargs")
    if not kwargs:
        wl = load_workload(spec, seq_len=case.get("seq_len"))
        if case.get("load") == "built":  # built on the device, as rows before 2026-11-28 ran (tools/gpu/rows.py)
            import dataclasses
            wl = dataclasses.replace(wl, from_checkpoint=False)
        return wl
    import importlib
    import importlib.util
    where, _, name = spec.partition(":")
    if where.endswith(".py"):
        mod_spec = importlib.util.spec_from_file_location(f"memfit_gt_{Path(where).stem}", ROOT / where)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)(**kwargs)


def versions() -> dict:
    """The machine and library versions a row was measured with (no package is imported for it)."""
    import importlib.metadata as md

    import torch
    out: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                 "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    for pkg in ("transformers", "timm", "bitsandbytes"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
    from tools.gpu.host_probe import cpu_model
    out["host_cpu"], out["host_cores"] = cpu_model(), os.cpu_count()  # NOTE [ One kind of machine, several hosts ]
    out["memfit_commit"] = memfit_commit()
    return out


def memfit_commit() -> str | None:
    if os.environ.get("MEMFIT_COMMIT"):
        return os.environ["MEMFIT_COMMIT"]
    try:
        r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@contextlib.contextmanager
def gpu_turn():
    """Hold the GPU alone while inside (``MEMFIT_GT_LOCK`` names the lock file; unset: no lock)."""
    path = os.environ.get("MEMFIT_GT_LOCK")
    if not path:
        yield
        return
    import fcntl
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def predict_here(case: dict, device: str) -> dict:
    """memfit's prediction for the case on ``device`` (a preset name or ``cuda``), in this process
    (a fresh workload: the measured one's model has been prepared by build_step)."""
    import memfit
    try:
        report = memfit.estimate(resolve_workload(case), memfit.Plan(**case["plan"]), batch_size=case["batch_size"], device=device)
        return {"allocated": report.peak_bytes, "reserved": report.reserved_bytes, "managed": report.managed_bytes}
    except Exception as e:  # noqa: BLE001 - recorded; the measurement stands
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


_BALLAST: list[int] = []


def ballast(leave_bytes: int) -> int:
    """Take the card's free memory down to ``leave_bytes`` with an allocation outside PyTorch's caching
    allocator (the CUDA driver's ``cuMemAlloc`` in the context torch made current, held until the process
    ends): a smaller card, whose allocator meets the card's end, not only a per-process cap (DESIGN.md).
    Device memory is committed when allocated, so what is left is physical memory: managed (paged)
    memory and the CUDA context are outside the allocator's cap, not outside this. The driver library
    comes with the NVIDIA driver: no wheel to carry (CuPy, used before, was not on the device machine).
    Returns the bytes taken."""
    import ctypes

    import torch
    free, _ = torch.cuda.mem_get_info()  # (creates torch's context and makes it current here)
    taken = max(0, free - leave_bytes)
    if taken:
        driver = ctypes.CDLL("libcuda.so.1")
        pointer = ctypes.c_uint64()
        status = driver.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(taken))
        if status != 0:
            raise RuntimeError(f"ballast: cuMemAlloc_v2 of {taken} bytes failed (CUresult {status})")
        _BALLAST.append(pointer.value)
    return taken


def managed_bytes() -> int:
    """Bytes of CUDA managed (unified) tensors alive in this process: bitsandbytes' paged optimizer
    states (``is_paged``), which are outside the caching allocator and its max_memory_* figures."""
    import gc
    import warnings
    import weakref

    import torch
    proxies = (weakref.ProxyType, weakref.CallableProxyType)  # (isinstance on a dead one raises ReferenceError)
    with warnings.catch_warnings():  # (isinstance on deprecated objects torch keeps warns)
        warnings.simplefilter("ignore")
        return sum(o.numel() * o.element_size() for o in gc.get_objects()
                   if type(o) not in proxies and isinstance(o, torch.Tensor) and getattr(o, "is_paged", False))


def measure_case(case: dict, device: str = "cuda", predict: str | None = None) -> dict:
    """Run one case here (see the module docstring); returns its row (``error`` on failure)."""
    import statistics
    import warnings

    import torch

    import memfit
    from memfit.step import make_batch

    row = {k: case.get(k) for k in ("case", "workload", "batch_size", "seq_len", "plan")}
    started = time.perf_counter()
    cuda = device == "cuda"
    overlapped = int(os.environ.get("MEMFIT_GT_JOBS", "1")) > 1
    turn = contextlib.ExitStack()
    try:
        torch.manual_seed(0)
        wl = resolve_workload(case)
        row["load"] = "checkpoint" if wl.from_checkpoint else "built"  # tools/gpu/rows.py: workload_of
        turn.enter_context(gpu_turn())
        if cuda:
            free0, total = torch.cuda.mem_get_info()  # creates the CUDA context
            if case.get("memory_limit_bytes"):  # a smaller card: the allocator's own per-process cap
                from memfit.training.enforce import limit_cuda_allocator
                row["memory_limit_bytes"] = case["memory_limit_bytes"]
                row["memory_fraction"] = limit_cuda_allocator(case["memory_limit_bytes"])
            if case.get("leave_bytes"):  # a smaller card: its memory, outside the allocator too
                row["leave_bytes"], row["ballast_bytes"] = case["leave_bytes"], ballast(case["leave_bytes"])
        dev = memfit.get_device(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = memfit.build_step(wl, memfit.Plan(**case["plan"]), case["batch_size"], device=dev)
            batch = make_batch(step.target)
            _progress(f"built the step in {time.perf_counter() - started:.1f} s")
            for i in range(WARMUP_STEPS):
                t0 = time.perf_counter()
                step(batch)
                if i == 0:  # the first step: optimizer states, cuDNN/cuBLAS plans, compilation
                    row["first_step_seconds"] = round(time.perf_counter() - t0, 3)
                _progress(f"warm-up step {i + 1}: {time.perf_counter() - t0:.1f} s")
        notes = sorted({str(w.message).splitlines()[0][:200] for w in caught
                        if not issubclass(w.category, (DeprecationWarning, FutureWarning))})
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        loss = step(batch)  # float(): synchronises
        if cuda:
            torch.cuda.synchronize()
            row["max_memory_allocated"] = torch.cuda.max_memory_allocated()
            row["max_memory_reserved"] = torch.cuda.max_memory_reserved()
            if overlapped:
                row["overlapped_jobs"] = int(os.environ["MEMFIT_GT_JOBS"])
            else:
                row["device_used_after_step"] = total - torch.cuda.mem_get_info()[0]
                row["device_used_before_model"] = total - free0
            row["allocated_after_step"] = torch.cuda.memory_allocated()
            row["managed_bytes"] = managed_bytes()  # (paged states: not in max_memory_reserved)
            if row.get("leave_bytes"):
                row["free_after_step"] = torch.cuda.mem_get_info()[0]  # (what the ballast left, still free)
            stats = torch.cuda.memory_stats()
            row["alloc_retries"] = stats.get("num_alloc_retries", 0)
        times = []
        for _ in range(TIMED_STEPS):
            t0 = time.perf_counter()
            step(batch)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            _progress(f"timed step {len(times)}: {times[-1]:.2f} s")
        row["step_seconds_median"] = round(statistics.median(times), 5)
        if case.get("profile") and cuda:  # one more step under the profiler: where the GPU time goes
            row["kernels"] = profile_kernels(step, batch)
        if case.get("seq_len"):
            row["tokens_per_second"] = round(case["batch_size"] * case["seq_len"] / statistics.median(times), 1)
        row["loss"] = loss
        if notes:
            row["warnings"] = notes[:4]
    except Exception as e:  # noqa: BLE001 - recorded per case; the driver carries on
        import traceback
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        row["traceback"] = traceback.format_exc()[-1500:]
    finally:
        step = batch = wl = None  # noqa: F841 - frees the model before the next case's GPU turn
        if cuda:
            import gc
            gc.collect()
            torch.cuda.empty_cache()
        turn.close()
    if predict and "error" not in row:  # the measurement first: a prediction that runs past the timeout keeps it
        print("MEASURED " + json.dumps({**row, **versions()}), flush=True)
        row["predicted_cuda"] = predict_here(case, "cuda")
        if predict != "none":
            row["predicted_preset"] = {"preset": predict, **predict_here(case, predict)}
    row.update(versions())
    return row


def profile_kernels(step, batch, top: int = 25) -> list[dict]:
    """One step under torch.profiler: the ``top`` CUDA kernels by total time ({name, calls, ms}) and
    the GPU time of all, for a case whose step time the time model misses (``"profile": true``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(batch)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    time_of = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    rows.sort(key=time_of, reverse=True)
    total = sum(time_of(e) for e in rows)
    return [{"name": "(all kernels)", "calls": sum(e.count for e in rows), "ms": round(total / 1e3, 2)}] + \
        [{"name": e.key[:160], "calls": e.count, "ms": round(time_of(e) / 1e3, 2)} for e in rows[:top]]


def _progress(text: str) -> None:
    """A line on stderr: what a case that runs past its timeout had done (the driver keeps it)."""
    print(f"progress: {text}", file=sys.stderr, flush=True)


# -- the driver: each case in a fresh process ------------------------------------------------------

def run_case(case: dict, device: str, timeout: float, predict: str | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("MEMFIT_COMMIT", memfit_commit() or "")
    cmd = [sys.executable, "-m", "tools.gpu.ground_truth", "--one", json.dumps(case), "--device", device]
    if predict:
        cmd += ["--predict", "--preset", predict]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        for line in out.splitlines():  # measured, then timed out predicting: the row without its prediction
            if line.startswith("MEASURED "):
                return {**json.loads(line[len("MEASURED "):]), "prediction": f"timed out after {timeout:.0f} s"}
        done = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        done = "\n".join(line for line in done.splitlines() if line.startswith("progress: "))
        return {**_ids(case), "error": f"timed out after {timeout:.0f} s", "traceback": done[-1500:] or "no progress"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {**_ids(case), "error": f"process exited {p.returncode} without a result",
            "traceback": (p.stderr or p.stdout)[-1500:]}


def _ids(case: dict) -> dict:
    return {k: case.get(k) for k in ("case", "workload", "batch_size", "seq_len", "plan")}


def load_cases(path: str | None) -> list[dict]:
    if not path:
        from tools.gpu.builtin_cases import BUILTIN
        return list(BUILTIN)
    cases = json.loads(Path(path).read_text())
    if not isinstance(cases, list) or not all(isinstance(c, dict) and {"case", "workload", "batch_size"} <= c.keys()
                                              for c in cases):
        raise SystemExit(f"{path}: expected a JSON list of {{case, workload, batch_size, seq_len, plan}} objects")
    for c in cases:
        c.setdefault("seq_len", None)
        c.setdefault("plan", {})
    return cases


def _predicted(row: dict) -> str:
    out = ""
    for key in ("predicted_cuda", "predicted_preset"):
        p = row.get(key) or {}
        if isinstance(p.get("allocated"), int) and isinstance(row.get("max_memory_allocated"), int):
            out += f"  {key[10:]} {100 * (p['allocated'] / row['max_memory_allocated'] - 1):+.2f}%"
        elif p.get("error"):
            out += f"  {key[10:]} failed: {p['error'][:80]}"
    return out


def _gib(n) -> str:
    return f"{n / 2**30:7.3f}" if isinstance(n, int) else "      -"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", metavar="FILE.json", help="cases to run instead of the built-in list")
    ap.add_argument("--only", metavar="REGEX", help="only cases whose id matches")
    ap.add_argument("--out", metavar="FILE.jsonl", help="append one JSON line per case here")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke test, no memory figures")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per case")
    ap.add_argument("--deadline", type=float, default=None, help="start no case after this many seconds")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--jobs", type=int, default=1, help="overlap this many cases (their GPU phases take turns)")
    ap.add_argument("--predict", action="store_true", help="also record memfit's predictions (local card, preset)")
    ap.add_argument("--preset", default="h100-80gb", help="the preset --predict predicts for")
    ap.add_argument("--no-lock", action="store_true",
                    help="with --jobs: no GPU turns (a warm-up pass that fills torch.compile's caches in parallel)")
    ap.add_argument("--one", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        result = measure_case(json.loads(args.one), args.device, args.preset if args.predict else None)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    cases = load_cases(args.cases)
    if args.only:
        cases = [c for c in cases if re.search(args.only, c["case"])]
    if args.list:
        for c in cases:
            print(json.dumps(c))
        return 0
    t_start, failed, skipped = time.perf_counter(), 0, []
    if args.jobs > 1:
        os.environ["MEMFIT_GT_JOBS"] = str(args.jobs)
        if not args.no_lock:
            os.environ["MEMFIT_GT_LOCK"] = str(Path(tempfile.gettempdir()) / f"memfit-gt-{os.getpid()}.lock")
    lock = threading.Lock()

    def one(c: dict) -> None:
        nonlocal failed
        if args.deadline is not None and time.perf_counter() - t_start > args.deadline:
            skipped.append(c["case"])
            return
        t0 = time.perf_counter()
        row = run_case(c, args.device, args.timeout, args.preset if args.predict else None)
        with lock:
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            if "error" in row:
                failed += 1
                done = row.get("traceback", "").splitlines()[-1:] if "timed out" in row["error"] else []
                print(f"{c['case']:34s} FAILED {row['error'][:300]}{' (last: ' + done[0] + ')' if done else ''}",
                      flush=True)
            else:
                print(f"{c['case']:34s} allocated {_gib(row.get('max_memory_allocated'))} GiB  reserved "
                      f"{_gib(row.get('max_memory_reserved'))} GiB  step {row['step_seconds_median'] * 1e3:8.1f} ms  "
                      f"({time.perf_counter() - t0:.0f} s){_predicted(row)}", flush=True)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(one, cases))
    if skipped:
        print(f"skipped (deadline): {' '.join(skipped)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
