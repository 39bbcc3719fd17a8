"""memfit.train: the training loop around the one TrainStep.

The loop is small on purpose: the step (with every technique) is ``build_step``; data, OOM
adaptation, checkpoints, progress and the end-of-run report are modules of their own. What the
loop adds:

- the plan: given, or the planner's fastest plan for the budget;
- the budget, enforced: on a CPU by the :class:`~memfit.memory.guard.BudgetGuard`, which raises
  CUDA's out-of-memory error when live device memory would pass it; on a GPU by the caching
  allocator's per-process limit;
- out-of-memory adaptation: a new plan, and the step rebuilt for it (memfit.training.adapt);
- the steady-state peak measured the way ``profile`` measures it (:class:`PeakWindow`: profiler
  allocator events from before the model is built on a CPU, the CUDA allocator's peak on a GPU)
  over step 2, or the first later step that needed no adaptation, next to the plan's prediction;
  other steps report the guard's peak (CPU with a budget), the process's resident peak (CPU) or
  the CUDA allocator's peak;
- checkpoints (memfit.training.saver: the last K kept), Ctrl-C that keeps the steps done, SIGTERM
  and SIGUSR1 that end the run after its step with a checkpoint (memfit.training.preemption), and
  a resume that takes the newest checkpoint that loads and drops what a crashed run logged after
  it;
- several ranks (``memfit train --nproc N``, memfit.training.distributed): this process is one
  of them when torchrun's environment says so; rank 0 writes what is written once.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.errors import UserError
from memfit.memory.adapters import fsdp_resizes
from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.measure import PeakWindow
from memfit.planner.space import model_facts
from memfit.plans import Plan
from memfit.secrets import redact, tokens
from memfit.step import TrainStep, build_step, make_batch
from memfit.target import Target
from memfit.training import checkpoint, distributed, preemption, setup
from memfit.training.adapt import FitPredictor, OutOfAdaptations, run_adapting
from memfit.training.data import ByteCorpus, text_batches
from memfit.training.enforce import arm, enforce, step_peak
from memfit.training.progress import Progress
from memfit.training.rebuild import rebuild
from memfit.training.report import final_report
from memfit.training.saver import DEFAULT_KEEP, Saver
from memfit.units import fmt_bytes
from memfit.workload import Workload
from memfit.workloads import load_workload


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    out_dir: str = ""
    predicted_peak_bytes: int | None = None
    """The estimate's peak for the plan that ran step 2 (what ``measured_peak_bytes`` checks)."""
    measured_peak_bytes: int | None = None
    """Allocator peak of the steady-state step, measured (None when the run resumed past it); rank 0's
    when sharded."""
    measured_peak_bytes_per_rank: list[int] | None = None
    """Each rank's measured peak, in rank order (a sharded run's; the prediction is per rank)."""
    world_size: int = 1
    plan: dict = field(default_factory=dict)
    """The plan asked for."""
    adapted_plan: dict = field(default_factory=dict)
    """The plan at the end, after any out-of-memory adaptation."""
    adaptations: list[dict] = field(default_factory=list)
    budget_bytes: int | None = None
    guard_peak_bytes: int | None = None
    report: dict = field(default_factory=dict)
    stopped_by: str | None = None
    """The signal that ended the run early (SIGTERM, SIGUSR1), after a checkpoint; None when it ran
    to ``steps``."""
    last_checkpoint: str | None = None
    """The newest complete checkpoint the run leaves."""
    last_step: int = 0
    """The last step done (``steps``, or where a signal stopped the run)."""


@dataclass(frozen=True)
class RunOptions:
    """How a run goes (everything but what it trains)."""

    steps: int
    out_dir: Path
    resume: bool
    seed: int
    workers: int | None
    checkpoint_every: int
    progress: bool
    report: bool
    keep_checkpoints: int = DEFAULT_KEEP


def train(workload: Workload | str, *, plan: Plan | str | None = None, budget: str | int | None = None,
          steps: int = 20, out: str | Path = "memfit-out", data: str | None = None, resume: bool = False,
          overwrite: bool = False, seed: int = 0, batch_size: int | None = None, seq_len: int | None = None,
          device: str = "auto", workers: int | None = None, checkpoint_every: int = 10, progress: bool = True,
          report: bool = True, keep_checkpoints: int = DEFAULT_KEEP) -> TrainResult:
    """Train ``workload`` for ``steps`` optimizer steps under ``plan`` (or the planner's plan for
    ``budget``), writing metrics.jsonl, checkpoints and (``report``) report.json with a memory
    timeline to ``out``. With both a plan and a budget, the plan is kept and the budget enforced.

    ``device``: auto (cuda when available), cpu or cuda. ``workers``: DataLoader worker processes
    for text data (default: 2 on a GPU, 0 on a CPU). ``keep_checkpoints``: how many of the newest
    checkpoints stay in ``out``. SIGTERM or SIGUSR1 ends the run after its current step, with a
    checkpoint (``stopped_by`` says which).
    """
    ranks = distributed.current()
    if ranks is not None and plan is None and budget is not None:
        raise UserError("a rank started by torchrun would plan alone (the ranks must train one plan): give the plan "
                        "(memfit plan ... --out plan.yaml, then --plan plan.yaml), or launch with memfit train --nproc "
                        "N, which plans once for all ranks")
    prepared = prepare(workload, plan=plan, budget=budget, steps=steps, out=out, data=data, resume=resume,
                       overwrite=overwrite, seed=seed, batch_size=batch_size, seq_len=seq_len, device=device,
                       workers=workers, checkpoint_every=checkpoint_every, progress=progress, report=report,
                       world_size=ranks.world_size if ranks else 1, keep_checkpoints=keep_checkpoints)
    return _Run(*prepared, ranks).go()


def prepare(workload: Workload | str, *, plan, budget, steps, out, data, resume, overwrite, seed, batch_size, seq_len,
            device, workers, checkpoint_every, progress, report, world_size: int = 1,
            keep_checkpoints: int = DEFAULT_KEEP) -> tuple[Target, Budget | None, ByteCorpus | None, RunOptions]:
    """Everything a run is checked and planned with before it starts (in each rank, and in the
    command that launches them): its target (the plan sharded over ``world_size`` ranks), the
    budget, the text and the options."""
    wl = load_workload(workload, seq_len=seq_len)
    dev = setup.training_device(device)
    if steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
    if keep_checkpoints < 1:
        raise UserError(f"--keep-checkpoints must be >= 1 (the newest checkpoints kept), got {keep_checkpoints}")
    out_dir = setup.out_dir(out)
    if checkpoint.exists(out_dir) and not resume and not overwrite:
        raise UserError(f"--out {str(out_dir)!r} already holds a run's checkpoint; add --resume to continue it, "
                        "--overwrite to start over, or choose another --out folder")
    corpus = setup.corpus(wl, data)
    target = Target.resolve(wl, None, batch_size, dev)
    target, budget_obj = setup.choose_plan(target, plan, budget, world_size=world_size)
    options = RunOptions(steps=steps, out_dir=out_dir, resume=resume, seed=seed, workers=workers,
                         checkpoint_every=checkpoint_every, progress=progress, report=report,
                         keep_checkpoints=keep_checkpoints)
    return target, budget_obj, corpus, options


class _Run:
    """One training run: the loop, its enforcement and its measurement."""

    def __init__(self, target: Target, budget: Budget | None, corpus, options: RunOptions,
                 ranks: distributed.Ranks | None = None):
        self.requested = target.plan
        self.ranks = ranks
        self.main = ranks is None or ranks.is_main
        self.grouped = False
        """Whether this rank is in its process group now (fake traces cannot run then)."""
        self.state = None
        self.resume_note = None
        if options.resume:
            self.state = checkpoint.read(options.out_dir)
            self.resume_note = checkpoint.skipped_note(self.state)
            checkpoint.check(self.state, workload=target.workload.name, requested_plan=self.requested,
                             batch_size=target.batch_size)
            target = target.with_plan(checkpoint.resumed_plan(self.state, self.requested))
        self.target, self.budget, self.corpus, self.options = target, budget, corpus, options
        if self.main:
            checkpoint.remove_stale_temporaries(options.out_dir)
        self.saver = Saver(options.out_dir, keep=options.keep_checkpoints, workload=target.workload.name,
                           requested=self.requested, ranks=ranks, resumed=self.state)
        self.stop: preemption.Stop | None = None
        """Set by SIGTERM / SIGUSR1 while the loop runs."""
        self.secrets = tokens()
        """The Hugging Face tokens nothing written may hold (memfit.secrets)."""
        self.stopping = False
        """Whether this rank (every rank: they agree after each step) ends the run after this step."""
        self.result = TrainResult(steps=options.steps, out_dir=str(options.out_dir),
                                  predicted_peak_bytes=setup.predicted_peak(target), plan=self.requested.to_dict(),
                                  budget_bytes=budget.bytes if budget else None,
                                  world_size=ranks.world_size if ranks else 1)
        torch.manual_seed(options.seed)
        random.seed(options.seed)
        self.step: TrainStep | None = None
        """The step running now (a new one after each adaptation)."""
        self.guard = enforce(budget)
        self.window = PeakWindow(target.device) if not options.resume else None
        self.fits = None
        if budget is not None or target.device.is_gpu:
            # OOM remedies are traced on fake tensors; not while the measurement window's profiler runs
            self.fits = FitPredictor(target, budget or Budget.of_device(target.device),
                                     paused=self.guard.paused if self.guard is not None else None,
                                     blocked=lambda: self.grouped or (self.window is not None
                                                                      and self.window.prof is not None))
            if self._expects_oom:
                # OOMs are expected: trace their remedy before the window opens
                self.fits.precompute(target.plan, model_facts(target.workload).model)

    @property
    def _expects_oom(self) -> bool:
        return self.budget is not None and self.result.predicted_peak_bytes > self.budget.bytes

    def go(self) -> TrainResult:
        try:
            with preemption.catching() as self.stop:
                return self._go()
        finally:
            self.stop = None

    def _go(self) -> TrainResult:
        result, options = self.result, self.options
        try:
            if self.ranks is None:
                measured_plan = self._train()
            else:
                with distributed.process_group(self.ranks, self.target.device.kind):
                    self.grouped = True
                    try:
                        measured_plan = self._train()
                    except torch.distributed.DistError as e:
                        raise distributed.out_of_step(e, self.options.out_dir) from e
                    finally:
                        self.grouped = False
        except OutOfAdaptations as e:
            raise setup.out_of_adaptations(e, self.target, self.budget) from None
        if measured_plan != self.target.plan:  # adapted before the measured step: compare with its own prediction
            result.predicted_peak_bytes = setup.predicted_peak(self.target.with_plan(measured_plan))
        result.adapted_plan = self.step.plan.to_dict()
        result.last_checkpoint = str(self.saver.kept[-1]) if self.saver.kept else None
        if options.report and self.main and result.stopped_by is None:  # (stopping: no time for a report)
            result.report = final_report(self.step, options.out_dir, result)
        return result

    def _train(self) -> Plan:
        """The loop; returns the plan of the step whose peak was measured."""
        result, options, main = self.result, self.options, self.main
        measured_plan = self.target.plan
        with contextlib.ExitStack() as stack:
            if self.window is not None:
                stack.enter_context(self.window)
            if self.guard is not None:
                stack.enter_context(self.guard)
                self.guard.armed = False  # the budget applies to steps; building is checked once, below
                if self.target.plan.config("shard").fsdp2:  # (FSDP2 frees its gathered buffers by resizing)
                    stack.enter_context(fsdp_resizes(self.guard.storages))
            self.step = build_step(self.target, observer=self.guard)
            start, samples_seen = checkpoint.restore(self.step, self.state) if options.resume else (0, 0)
            self.state = None  # tensors the checkpoint held that the step did not take are freed here
            if self.guard is not None:
                arm(self.guard, self.step)
            if options.resume and main:
                checkpoint.drop_records_after(options.out_dir / "metrics.jsonl", start)
            metrics = (stack.enter_context(open(options.out_dir / "metrics.jsonl", "a" if options.resume else "w"))
                       if main else None)
            bar = stack.enter_context(Progress(options.steps, start=start, budget_bytes=result.budget_bytes,
                                               enabled=options.progress and main, quiet=not main))
            if self._expects_oom and self.guard is not None:
                bar.note(f"note: the plan's predicted peak {fmt_bytes(result.predicted_peak_bytes)} is over the "
                         f"budget {fmt_bytes(self.budget.bytes)}; expect adaptations")
            result.last_step = start
            if self.resume_note:
                bar.note(self.resume_note)
            batches = self._batches(first_sample=samples_seen, count=options.steps - start)
            for i in range(start, options.steps):
                index = i + 1
                batch = next(batches)
                rng_at_start = checkpoint.rng_state()
                try:
                    loss, seconds, measured = self._step(batch, index, bar)
                except KeyboardInterrupt:
                    if self.ranks is not None:  # (the other ranks may be inside a collective)
                        bar.note(f"interrupted; the checkpoint of step {self.saver.last_saved} is current: --resume "
                                 "continues")
                        raise
                    self.saver.on_interrupt(self.step, done=i, samples_seen=samples_seen, rng=rng_at_start,
                                            note=bar.note)
                    raise
                samples_seen += self.target.batch_size
                if measured:
                    measured_plan = self.step.plan
                self._record(metrics, bar, index, loss, seconds, measured)
                result.last_step = index
                if (options.checkpoint_every and index % options.checkpoint_every == 0) or index == options.steps \
                        or self.stopping:
                    self.saver.save(self.step, index=index, samples_seen=samples_seen)
                if self.stopping:
                    result.stopped_by = (self.stop.signal if self.stop is not None else None) or "a signal to a rank"
                    bar.note(f"{result.stopped_by}: stopped after step {index}; saved its checkpoint")
                    break
        return measured_plan

    def _step(self, batch, index: int, bar: Progress) -> tuple[float, float, bool]:
        """Run step ``index``, adapting on out-of-memory errors (``self.step`` is then the adapted
        step): (loss, seconds, whether its peak was measured)."""
        guard, result = self.guard, self.result
        if guard is not None:
            guard.watch(batch)  # (made in a worker process, the guard did not see it)
            guard.reset_peak()
        # the steady state: step 2, or the first later step that needed no adaptation
        measuring = self.window is not None and index >= STEADY_STEP
        adaptations_before = len(result.adaptations)

        def adapted(event):
            if guard is not None:
                guard.reset_peak()  # the failed attempt's memory is freed; count the retry
            event = {"step": index, **event}
            result.adaptations.append(event)
            bar.note(f"step {index}: out of memory in {event['phase']} ({event['cause']}); "
                     f"retrying the same batch with {event['adaptation']}")

        t0 = time.perf_counter()
        with self.window.step(index) if measuring else contextlib.nullcontext():
            loss, self.step = run_adapting(self.step, batch, adapted, self.fits, rebuild_step=self._rebuild,
                                           decide=self.ranks.decide if self.ranks else None)
        asked = self.stop is not None and self.stop.requested
        if self.ranks is not None:  # (equal shares: the global batch's loss); every rank stops if one was asked
            loss, self.stopping = self.ranks.mean_and_any(loss, asked)
        else:
            self.stopping = asked
        seconds = time.perf_counter() - t0
        measuring = measuring and len(result.adaptations) == adaptations_before
        if measuring:
            result.measured_peak_bytes = self.window.finish(index)
            self.window = None
            if self.ranks is not None:
                result.measured_peak_bytes_per_rank = self.ranks.gather(result.measured_peak_bytes)
        result.losses.append(loss)
        if guard is not None:
            result.guard_peak_bytes = max(result.guard_peak_bytes or 0, guard.peak_bytes)
        return loss, seconds, measuring

    def _rebuild(self, step: TrainStep, plan: Plan) -> TrainStep:
        """The step for an adapted plan; under a guard, building is not a step (not enforced)."""
        if self.guard is not None:
            self.guard.armed = False
        try:
            self.step = rebuild(step, plan, observer=self.guard)
        finally:
            if self.guard is not None:
                self.guard.armed = True
        return self.step

    def _record(self, metrics, bar: Progress, index: int, loss: float, seconds: float, measured: bool) -> None:
        result, info, bs = self.result, self.target.workload.info, self.target.batch_size
        peak, kind = step_peak(result.measured_peak_bytes if measured else None, self.guard, self.target.device)
        rate, unit = (bs * info.seq_len / seconds, "tokens") if self.corpus is not None else (bs / seconds, "samples")
        record = {"step": index, "loss": loss, "seconds": seconds, "time": time.time(),
                  f"{unit}_per_second": rate, "peak_bytes": peak, "peak_kind": kind}
        mine = [a for a in result.adaptations if a["step"] == index]
        if mine:  # this step's, with their causes
            record["adaptations"] = mine
        if measured and result.measured_peak_bytes_per_rank:
            record["peak_bytes_per_rank"] = result.measured_peak_bytes_per_rank
        if metrics is not None:
            line = json.dumps(record)
            metrics.write((redact(line, self.secrets) if self.secrets else line) + "\n")
            metrics.flush()
        bar.update(index, loss=loss, rate=rate, unit=unit, peak_bytes=peak)

    def _batches(self, *, first_sample: int, count: int):
        """The step's batches: the whole batch, or a rank's share of each global batch."""
        target, ranks = self.target, self.ranks
        for batch in self._global_batches(first_sample=first_sample, count=count):
            yield batch if ranks is None else distributed.rank_share(batch, ranks, target.rank_batch_size)

    def _global_batches(self, *, first_sample: int, count: int):
        target, workers = self.target, self.options.workers
        if self.corpus is None:
            while True:
                yield make_batch(target, whole=True)
        on_gpu = target.device.is_gpu
        workers = (2 if on_gpu else 0) if workers is None else workers
        for batch in text_batches(self.corpus, target.workload.info.seq_len - 1, target.batch_size,
                                  first_sample=first_sample, num_batches=count, workers=workers, pin_memory=on_gpu):
            if on_gpu:
                batch = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
            yield batch
