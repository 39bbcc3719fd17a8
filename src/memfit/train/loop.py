"""memfit.train: the training loop around the one TrainStep.

The loop is small on purpose: the step (with every technique) is ``build_step``; data, metrics
and checkpoints are separate modules. The allocator peak of the steady-state step is measured the
same way ``profile`` measures it (profiler allocator events from before the model is built through
step 2) and reported next to the plan's prediction; later steps report the process's peak
resident memory (CPU) or ``torch.cuda.max_memory_allocated`` (CUDA).
"""

from __future__ import annotations

import json
import random
import resource
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.memory.faketrace import STEADY_STEP
from memfit.plans import Plan
from memfit.step import build_step
from memfit.train import checkpoint
from memfit.train.data import ByteCorpus
from memfit.workload import Workload, load_workload


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    out_dir: str = ""
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    """Allocator peak of the steady-state step, measured (None when the run resumed past it)."""
    plan: dict = field(default_factory=dict)


def _out_dir(out: str | Path) -> Path:
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".memfit-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to --out {str(path)!r} ({e.strerror}); choose a writable folder") from None
    return path


def _process_peak_bytes(device_kind: str) -> int:
    if device_kind == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(workload: Workload | str, *, plan: Plan | str | None = None, budget: str | None = None, steps: int = 20,
          out: str | Path = "memfit-out", data: str | None = None, resume: bool = False, seed: int = 0,
          batch_size: int | None = None, seq_len: int | None = None, checkpoint_every: int = 10,
          progress: bool = True, inject_oom: set[int] | None = None) -> TrainResult:
    """Train ``workload`` for ``steps`` optimizer steps under ``plan`` (or the planner's plan for
    ``budget``), writing metrics.jsonl and checkpoints to ``out``.

    ``inject_oom``: steps whose first attempt raises ``torch.OutOfMemoryError`` in forward (tests).
    """
    wl = load_workload(workload, seq_len=seq_len)
    bs = batch_size or wl.default_batch_size
    if isinstance(plan, str):
        plan = Plan.load(plan)
    if plan is None and budget is not None:
        from memfit.planner.search import plan as make_plan
        found = make_plan(wl, budget=budget, batch_size=bs)
        if found.chosen is None:
            raise UserError(f"no plan fits the budget; the smallest footprint found is "
                            f"{found.smallest.used_bytes / 2**20:.0f} MiB with {found.smallest.plan.describe()}")
        plan = found.chosen.plan
    plan = plan or Plan()
    if steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
    out_dir = _out_dir(out)
    device = get_device("cpu")
    corpus = ByteCorpus(data) if wl.info.get("text_lm") else None
    if data is not None and corpus is None:
        raise UserError(f"--data applies to the built-in language models (gpt2, llama); {wl.name} makes its own "
                        "batches")
    from memfit.memory.estimate import estimate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted = estimate(wl, plan, batch_size=bs).process_peak_bytes
    torch.manual_seed(seed)
    random.seed(seed)
    prof = None
    if not resume:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        from memfit.memory.quiet import QuietProfiler
        prof = QuietProfiler(torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True))
        prof.__enter__()
    requested = plan
    if resume:
        state = checkpoint.read(out_dir)
        checkpoint.check(state, workload=wl.name, requested_plan=requested, batch_size=bs)
        step = build_step(wl, Plan.from_dict(state["adapted_plan"]), bs, device)
        start, position = checkpoint.restore(step, state)
    else:
        step = build_step(wl, plan, bs, device)
        start, position = 0, 0
    if inject_oom:
        step.loss_fn = _oom_injector(step.loss_fn, inject_oom)
    metrics = open(out_dir / "metrics.jsonl", "a" if resume else "w")
    result = TrainResult(steps=steps, out_dir=str(out_dir), predicted_peak_bytes=predicted, plan=plan.to_dict())
    seq = wl.info.get("seq_len")
    try:
        for i in range(start, steps):
            if corpus is not None:
                ids, position = corpus.batch(position, bs, seq - 1)
                batch = {"input_ids": ids, "labels": ids}
            else:
                batch = wl.batch(bs)
            if inject_oom:
                step.loss_fn.current_step = i + 1
            measuring = prof is not None and i + 1 == STEADY_STEP
            t0 = time.perf_counter()
            if measuring:
                from torch.profiler import record_function

                from memfit.memory.measure import STEP_RANGE
                with record_function(STEP_RANGE):
                    loss = _step_adapting(step, batch, i + 1, metrics, progress)
            else:
                loss = _step_adapting(step, batch, i + 1, metrics, progress)
            seconds = time.perf_counter() - t0
            if measuring:
                from memfit.memory.measure import profiler_peak
                prof.__exit__(None, None, None)
                result.measured_peak_bytes = profiler_peak(prof.prof)
                prof = None
            result.losses.append(loss)
            peak = result.measured_peak_bytes if measuring else _process_peak_bytes(device.kind)
            rate = {"tokens_per_second": bs * seq / seconds} if corpus is not None else \
                {"samples_per_second": bs / seconds}
            record = {"step": i + 1, "loss": loss, "seconds": seconds, **rate, "peak_bytes": peak,
                      "peak_kind": "allocator (profiler)" if measuring else "process RSS"}
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if progress:
                speed = next(iter(rate.values()))
                print(f"step {i + 1}/{steps}  loss {loss:.4f}  {speed:,.0f} {next(iter(rate))[:-11]}/s  "
                      f"peak {peak / 2**20:,.0f} MiB", file=sys.stderr, flush=True)
            if (checkpoint_every and (i + 1) % checkpoint_every == 0) or i + 1 == steps:
                checkpoint.save(out_dir, step, step_index=i + 1, data_position=position, workload=wl.name,
                                requested_plan=requested)
    finally:
        metrics.close()
        if prof is not None:
            prof.__exit__(None, None, None)
    return result


def _step_adapting(step, batch, index: int, metrics, progress: bool) -> float:
    """One step; on an out-of-memory error in forward/backward, adapt and retry the same step."""
    from memfit.train.adapt import adapt, free_failed_step
    rng = torch.get_rng_state()
    while True:
        try:
            return step(batch)
        except torch.OutOfMemoryError as e:
            if step.phase == "optimizer":
                raise UserError("out of memory inside the optimizer step, which cannot be retried safely; use a "
                                "plan with less optimizer memory (e.g. --optimizer adamw8bit)") from e
            phase = step.phase
            free_failed_step(step)
            change = adapt(step)
            torch.set_rng_state(rng)
            event = {"event": "oom", "step": index, "phase": phase, "cause": str(e).splitlines()[0][:200],
                     "adaptation": change}
            metrics.write(json.dumps(event) + "\n")
            if progress:
                print(f"step {index}: out of memory in {phase}; retrying with {change}", file=sys.stderr, flush=True)


def _oom_injector(loss_fn, steps: set[int]):
    """Raise OutOfMemoryError in the forward of the first attempt of the given steps (for tests)."""
    fired: set[int] = set()

    def wrapped(model, batch):
        step_no = wrapped.current_step
        if step_no in steps and step_no not in fired:
            fired.add(step_no)
            raise torch.OutOfMemoryError(f"injected out-of-memory error at step {step_no}")
        return loss_fn(model, batch)
    wrapped.current_step = 0
    return wrapped
