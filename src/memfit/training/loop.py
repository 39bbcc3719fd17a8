"""memfit.train: the training loop around the one TrainStep.

The loop is small on purpose: the step (with every technique) is ``build_step``; data, OOM
adaptation, checkpoints, progress and the end-of-run report are modules of their own. What the
loop adds:

- the plan: given, or the planner's fastest plan for the budget;
- the budget, enforced: on a CPU by the :class:`~memfit.memory.guard.BudgetGuard`, which raises
  CUDA's out-of-memory error when live device memory would pass it; on a GPU by the caching
  allocator's per-process limit;
- the steady-state peak measured the way ``profile`` measures it (:class:`PeakWindow`: profiler
  allocator events from before the model is built on a CPU, the CUDA allocator's peak on a GPU)
  over step 2, or the first later step that needed no adaptation, next to the plan's prediction;
  other steps report the guard's peak (CPU with a budget), the process's resident peak (CPU) or
  the CUDA allocator's peak;
- Ctrl-C that keeps the steps done, and a resume that drops what a crashed run logged after its
  last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import random
import resource
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.devices import Device, get_device
from memfit.errors import UserError
from memfit.memory.faketrace import STEADY_STEP
from memfit.memory.measure import PeakWindow
from memfit.plans import Plan
from memfit.step import TrainStep, build_step, make_batch
from memfit.training import checkpoint
from memfit.training.adapt import FitPredictor, OutOfAdaptations, run_adapting
from memfit.training.data import ByteCorpus, text_batches
from memfit.training.progress import Progress
from memfit.training.report import final_report
from memfit.units import fmt_bytes
from memfit.workload import Workload, load_workload


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    out_dir: str = ""
    predicted_peak_bytes: int | None = None
    """The estimate's peak for the plan that ran step 2 (what ``measured_peak_bytes`` checks)."""
    measured_peak_bytes: int | None = None
    """Allocator peak of the steady-state step, measured (None when the run resumed past it)."""
    plan: dict = field(default_factory=dict)
    """The plan asked for."""
    adapted_plan: dict = field(default_factory=dict)
    """The plan at the end, after any out-of-memory adaptation."""
    adaptations: list[dict] = field(default_factory=list)
    budget_bytes: int | None = None
    guard_peak_bytes: int | None = None
    report: dict = field(default_factory=dict)


def train(workload: Workload | str, *, plan: Plan | str | None = None, budget: str | int | None = None,
          steps: int = 20, out: str | Path = "memfit-out", data: str | None = None, resume: bool = False,
          overwrite: bool = False, seed: int = 0, batch_size: int | None = None, seq_len: int | None = None,
          device: str = "auto", workers: int | None = None, checkpoint_every: int = 10, progress: bool = True,
          report: bool = True, inject_oom: set[int] | None = None) -> TrainResult:
    """Train ``workload`` for ``steps`` optimizer steps under ``plan`` (or the planner's plan for
    ``budget``), writing metrics.jsonl, checkpoints and (``report``) report.json with a memory
    timeline to ``out``. With both a plan and a budget, the plan is kept and the budget enforced.

    ``device``: auto (cuda when available), cpu or cuda. ``workers``: DataLoader worker processes
    for text data (default: 2 on a GPU, 0 on a CPU). ``inject_oom``: steps whose first attempt
    raises ``torch.OutOfMemoryError`` in forward (tests).
    """
    wl = load_workload(workload, seq_len=seq_len)
    bs = batch_size or wl.default_batch_size
    dev = _training_device(device)
    if steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
    out_dir = _out_dir(out)
    if checkpoint.exists(out_dir) and not resume and not overwrite:
        raise UserError(f"--out {str(out_dir)!r} already holds a run's checkpoint; add --resume to continue it, "
                        "--overwrite to start over, or choose another --out folder")
    if wl.info.get("text_lm") and wl.info.get("vocab_size", 256) < 256:  # the corpus's token ids are bytes
        raise UserError(f"{wl.name}: vocab_size={wl.info['vocab_size']} is below 256, and training text is "
                        f"tokenized as bytes (ids 0-255); override {wl.name}:vocab_size=256 or more")
    corpus = ByteCorpus(data) if wl.info.get("text_lm") else None
    if data is not None and corpus is None:
        raise UserError(f"--data applies to the built-in language models (gpt2, llama); {wl.name} makes its own "
                        "batches")
    plan, budget_bytes = _choose_plan(wl, plan, budget, bs, dev)
    requested = plan
    state = None
    if resume:
        state = checkpoint.read(out_dir)
        checkpoint.check(state, workload=wl.name, requested_plan=requested, batch_size=bs)
        plan = Plan.from_dict(state["adapted_plan"])
    checkpoint.remove_stale_temporaries(out_dir)
    predicted = _predicted_peak(wl, plan, bs, dev)
    torch.manual_seed(seed)
    random.seed(seed)

    result = TrainResult(steps=steps, out_dir=str(out_dir), predicted_peak_bytes=predicted, plan=requested.to_dict(),
                         budget_bytes=budget_bytes)
    guard = _guard(budget_bytes, dev)
    measured_plan = plan
    window = PeakWindow(dev) if not resume else None
    fits = None
    if (guard is not None or dev.kind == "cuda") and not inject_oom:
        # OOM remedies are traced on fake tensors; not while the measurement window's profiler runs
        fits = FitPredictor(wl, bs, dev, guard, budget_bytes, blocked=lambda: window is not None and window.prof is not None)
        if budget_bytes and predicted > budget_bytes:
            fits.precompute(plan)  # OOMs are expected: trace their remedy before the window opens
    try:
        with contextlib.ExitStack() as stack:
            if window is not None:
                stack.enter_context(window)
            if guard is not None:
                stack.enter_context(guard)
                guard.armed = False  # the budget applies to steps; building is checked once, below
            step = build_step(wl, plan, bs, dev)
            if guard is not None:
                step.observer = guard  # (restored host copies, e.g. the EMA shadow, are reported to it)
            start, samples_seen = checkpoint.restore(step, state) if resume else (0, 0)
            del state  # tensors the checkpoint held that the step did not take are freed here
            if guard is not None:
                _arm(guard, step)
            if inject_oom:
                step.loss_fn = _oom_injector(step.loss_fn, inject_oom)
            if resume:
                _drop_records_after(out_dir / "metrics.jsonl", start)
            metrics = stack.enter_context(open(out_dir / "metrics.jsonl", "a" if resume else "w"))
            bar = stack.enter_context(Progress(steps, start=start, budget_bytes=budget_bytes, enabled=progress))
            if budget_bytes and predicted > budget_bytes and guard is not None:
                bar.note(f"note: the plan's predicted peak {fmt_bytes(predicted)} is over the budget "
                         f"{fmt_bytes(budget_bytes)}; expect adaptations")
            last_saved = start
            batches = _batches(wl, corpus, bs, dev, first_sample=samples_seen, count=steps - start, workers=workers)
            for i in range(start, steps):
                index = i + 1
                batch = next(batches)
                if guard is not None:
                    guard.watch(batch)  # (made in a worker process, the guard did not see it)
                    guard.reset_peak()
                if inject_oom:
                    step.loss_fn.current_step = index
                # the steady state: step 2, or the first later step that needed no adaptation
                measuring = window is not None and index >= STEADY_STEP
                adaptations_before = len(result.adaptations)

                def adapted(event, index=index, bar=bar):
                    if guard is not None:
                        guard.reset_peak()  # the failed attempt's memory is freed; count the retry
                    event = {"step": index, **event}
                    result.adaptations.append(event)
                    bar.note(f"step {index}: out of memory in {event['phase']} ({event['cause']}); "
                             f"retrying the same batch with {event['adaptation']}")

                t0 = time.perf_counter()
                rng_at_start = checkpoint.rng_state()
                try:
                    with window.step(index) if measuring else contextlib.nullcontext():
                        loss = run_adapting(step, batch, adapted, fits)
                except KeyboardInterrupt:
                    _save_on_interrupt(out_dir, step, i, last_saved, samples_seen, rng_at_start, wl.name, requested,
                                       bar)
                    raise
                seconds = time.perf_counter() - t0
                samples_seen += bs
                measuring = measuring and len(result.adaptations) == adaptations_before
                if measuring:
                    result.measured_peak_bytes = window.finish(index)
                    window = None
                    measured_plan = step.plan
                result.losses.append(loss)
                if guard is not None:
                    result.guard_peak_bytes = max(result.guard_peak_bytes or 0, guard.peak_bytes)
                peak, kind = _step_peak(result.measured_peak_bytes if measuring else None, guard, dev)
                seq = wl.info.get("seq_len")
                rate, unit = (bs * seq / seconds, "tokens") if corpus is not None else (bs / seconds, "samples")
                record = {"step": index, "loss": loss, "seconds": seconds, "time": time.time(),
                          f"{unit}_per_second": rate, "peak_bytes": peak, "peak_kind": kind}
                if len(result.adaptations) > adaptations_before:  # this step's, with their causes
                    record["adaptations"] = result.adaptations[adaptations_before:]
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                bar.update(index, loss=loss, rate=rate, unit=unit, peak_bytes=peak)
                if (checkpoint_every and index % checkpoint_every == 0) or index == steps:
                    checkpoint.save(out_dir, step, step_index=index, samples_seen=samples_seen, workload=wl.name,
                                    requested_plan=requested)
                    last_saved = index
    except OutOfAdaptations as e:
        raise _out_of_adaptations(e, wl, bs, dev, budget_bytes) from None
    if measured_plan != plan:  # adapted before the measured step: compare with its own prediction
        result.predicted_peak_bytes = _predicted_peak(wl, measured_plan, bs, dev)
    result.adapted_plan = step.plan.to_dict()
    if report:
        result.report = final_report(wl, step, bs, dev, out_dir, result)
    return result


# -- pieces of the loop -------------------------------------------------------------------------

def _training_device(name: str) -> Device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r}: training runs on this machine; choose auto, cpu or cuda "
                        "(GPU presets are for estimate and plan)")
    return get_device(name)


def _choose_plan(wl: Workload, plan, budget, bs: int, dev: Device) -> tuple[Plan, int | None]:
    from memfit.planner.search import resolve_budget
    if isinstance(plan, str):
        plan = Plan.load(plan)
    budget_bytes = resolve_budget(budget, dev) if budget is not None else None
    if plan is None and budget is not None:
        from memfit.planner.search import plan as make_plan
        found = make_plan(wl, budget=budget, batch_size=bs, device=dev)
        if found.chosen is None:
            smallest = found.smallest
            hint = (f"; the smallest footprint found is {fmt_bytes(smallest.used_bytes)} with "
                    f"{smallest.plan.describe()}: give a budget of at least that, or a smaller --batch-size"
                    if smallest is not None else "; give a larger budget or a smaller --batch-size")
            raise UserError(f"no plan fits the budget of {fmt_bytes(budget_bytes)}{hint}")
        plan = found.chosen.plan
    return plan or Plan(), budget_bytes


def _predicted_peak(wl: Workload, plan: Plan, bs: int, dev: Device) -> int:
    """What the run's measurement sees: on a CPU the whole process heap, on a GPU allocated bytes."""
    from memfit.memory.estimate import estimate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return estimate(wl, plan, batch_size=bs, device=dev).measurable_peak_bytes


def _drop_records_after(path: Path, step: int) -> None:
    """A run that died after its last checkpoint logged steps that the resumed run does again:
    keep the records up to the checkpoint's step, so each step has one record."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the crash
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def _save_on_interrupt(out_dir: Path, step: TrainStep, done: int, last_saved: int, samples_seen: int, rng: dict,
                       workload: str, requested: Plan, bar: Progress) -> None:
    """Ctrl-C: keep the steps done. If nothing of the interrupted step was applied yet (no optimizer
    update, no EMA or scaler update), save the checkpoint of the last completed step, with the RNG
    as it was when the interrupted step began, so ``--resume`` continues exactly."""
    untouched = step.phase in ("idle", "zero_grad", "forward") or (
        step.phase == "backward" and not step.plan.optimizer_in_backward)
    if done <= last_saved:
        bar.note(f"interrupted in step {done + 1}; the checkpoint of step {last_saved} is current: --resume continues")
    elif untouched:
        checkpoint.save(out_dir, step, step_index=done, samples_seen=samples_seen, workload=workload,
                        requested_plan=requested, rng=rng)
        bar.note(f"interrupted in step {done + 1} ({step.phase}); saved the checkpoint of step {done}: --resume "
                 "continues exactly")
    else:
        bar.note(f"interrupted inside step {done + 1}'s parameter update; the checkpoint of step {last_saved} stays: "
                 "--resume continues from it")


def _out_of_adaptations(e: OutOfAdaptations, wl: Workload, bs: int, dev: Device, budget: int | None) -> UserError:
    """The run cannot go on: say what the most frugal plan it reached needs, and what to do."""
    from memfit.memory.estimate import estimate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        need = estimate(wl, e.plan, batch_size=bs, device=dev).peak_bytes
    limit = f"the budget of {fmt_bytes(budget)}" if budget else f"the {dev.name}'s memory"
    return UserError(f"out of memory with every adaptation applied ({e.plan.describe()}): the step needs "
                     f"{fmt_bytes(need)} (predicted) and {limit} is smaller; give at least that, a smaller "
                     "--batch-size, or let the planner search every technique (memfit plan WORKLOAD --budget ...)")


def _guard(budget_bytes: int | None, dev: Device):
    """Enforce the budget: on a CPU with the BudgetGuard, on a GPU with the caching allocator's own
    per-process limit (it raises torch.OutOfMemoryError past it)."""
    if budget_bytes is None:
        return None
    if dev.kind == "cuda":
        limit_cuda_allocator(budget_bytes)
        return None
    from memfit.memory.guard import BudgetGuard
    return BudgetGuard(budget_bytes)


def limit_cuda_allocator(budget_bytes: int) -> float:
    """Cap what PyTorch's CUDA allocator may reserve at ``budget_bytes``; returns the fraction set."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = min(1.0, budget_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def _arm(guard, step: TrainStep) -> None:
    """Count what the step holds (also what a checkpoint restored), refuse a budget it already
    exceeds, and start enforcing."""
    guard.watch([list(step.model.parameters()), list(step.model.buffers()), step.optimizer.state_dict()])
    if guard.live_bytes > guard.budget_bytes:
        raise UserError(f"the budget {fmt_bytes(guard.budget_bytes)} is below what the model and optimizer hold "
                        f"before the first step ({fmt_bytes(guard.live_bytes)}); give a larger budget, or let "
                        "memfit choose a plan (memfit plan WORKLOAD --budget ...)")
    guard.reset_peak()
    guard.armed = True


def _batches(wl: Workload, corpus, bs: int, dev: Device, *, first_sample: int, count: int, workers: int | None):
    if corpus is None:
        while True:
            yield make_batch(wl, bs, dev)
    on_gpu = dev.kind == "cuda"
    workers = (2 if on_gpu else 0) if workers is None else workers
    for batch in text_batches(corpus, wl.info["seq_len"] - 1, bs, first_sample=first_sample, num_batches=count,
                              workers=workers, pin_memory=on_gpu):
        if on_gpu:
            batch = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
        yield batch


def _step_peak(measured: int | None, guard, dev: Device) -> tuple[int, str]:
    if measured is not None:
        return measured, "allocator (profiler)" if dev.kind == "cpu" else "allocator (cuda)"
    if guard is not None:
        return guard.peak_bytes, "device (budget guard)"
    if dev.kind == "cuda":
        return torch.cuda.max_memory_allocated(), "allocator (cuda, run peak)"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS"


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
