"""Checkpoints: everything a run needs to continue exactly, written atomically, read without running code.

A checkpoint holds the model, the optimizer (8-bit and per-parameter optimizers through their
``state_dict``), the grad scaler, the EMA, the RNG states (CPU, CUDA, Python), the number of
samples seen, the step and the plan. It is written to a temporary file in the same folder, flushed
and fsync'ed, then renamed to ``checkpoint-<step>.pt``: a process killed mid-save leaves the
checkpoints saved before it (and a temporary file, which the next run removes). A write that fails
(a full disk, an I/O error) removes the temporary file and stops the run in one line with the path
and the free space. The run keeps its newest K checkpoints (memfit.training.retention).

Loading is ``torch.load(weights_only=True)`` with the allowlist of memfit.training.safe_load: a
file naming any other type is refused unread. Resuming tries the complete checkpoints newest first
and takes the first that loads, saying which it skipped and why. Loading checks that the
checkpoint belongs to this model (parameter names and shapes) and this plan.

A sharded run (several ranks) writes PyTorch's Distributed Checkpoint instead
(memfit.training.sharded_checkpoint). Either kind resumes at any world size: the plan must be the
same but for how it is sharded (its ``shard`` keys), and the batch the same global batch.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from memfit.errors import UserError
from memfit.outputs import os_error, sync_dir, write_failed, write_synced
from memfit.plans import Plan
from memfit.secrets import redact
from memfit.techniques.sharding import TECHNIQUE as SHARDING
from memfit.training import retention, sharded_checkpoint

FORMAT = 2


def rng_state() -> dict:
    """The RNG states a checkpoint keeps (CPU, Python, CUDA when in use)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}


def step_state(step) -> dict:
    """What a step holds that training must keep: the state dicts of the model, the optimizer (8-bit
    and per-parameter optimizers too), the grad scaler and the EMA. They reference the step's own
    tensors (no copies). ``modules``: the Python state of workload modules that keep some between steps
    (``memfit_state()``: which of Wan 2.2's experts ran last, memfit.workloads.wan_experts), by module name."""
    return {"model": step.model.state_dict(), "optimizer": step.optimizer.state_dict(),
            "scaler": step.scaler.state_dict(), "ema": step.ema.state_dict(),
            "modules": {name: m.memfit_state() for name, m in step.model.named_modules() if hasattr(m, "memfit_state")}}


def load_step_state(step, state: dict) -> None:
    """Load :func:`step_state`'s dicts into ``step`` (built for the same model; its plan may differ
    in how it runs, e.g. after an OOM adaptation)."""
    step.model.load_state_dict(state["model"])
    step.optimizer.load_state_dict(state["optimizer"])
    step.scaler.load_state_dict(state["scaler"])
    step.ema.load_state_dict(state["ema"])
    modules = dict(step.model.named_modules())
    for name, module_state in state.get("modules", {}).items():  # (checkpoints before 2026-12-05 hold none)
        if hasattr(modules.get(name), "memfit_restore"):
            modules[name].memfit_restore(module_state)


def save(out_dir: Path, step, *, step_index: int, samples_seen: int, workload: str, requested_plan,
         rng: dict | None = None, ranks=None, previous: int | None = None) -> Path:
    """Write the checkpoint of ``step_index`` atomically; ``rng``: the RNG states to save (default:
    the current ones). ``ranks`` (memfit.training.distributed.Ranks): a sharded run's, every rank
    calls this. ``previous``: the step of the run's last complete checkpoint (for the message
    when the write fails). Older checkpoints are left to the caller (memfit.training.retention)."""
    meta = {
        "workload": redact(workload), "step": step_index, "samples_seen": samples_seen,
        "plan": requested_plan.to_dict(), "adapted_plan": step.plan.to_dict(), "batch_size": step.batch_size,
        "shapes": {n: tuple(p.shape) for n, p in step.model.named_parameters()},  # (a DTensor's are the whole's)
        "rng": rng or rng_state(),
    }
    if ranks is not None:
        return sharded_checkpoint.save(out_dir, step, ranks, meta, failed=lambda e, path: _write_failed(
            e, path, step_index, previous))
    state = {"format": FORMAT, **meta, **step_state(step)}
    path = out_dir / retention.whole_name(step_index)
    tmp = out_dir / f".{path.name}.tmp-{os.getpid()}"
    renamed = False
    try:
        write_synced(tmp, lambda f: torch.save(state, f))
        os.replace(tmp, path)
        renamed = True
        sync_dir(out_dir)
    except (OSError, RuntimeError) as e:  # the folder is left as it was: no temporary file, no new checkpoint
        error = os_error(e)
        if error is None:
            raise
        (path if renamed else tmp).unlink(missing_ok=True)
        raise _write_failed(error, tmp, step_index, previous) from None
    return path


def _write_failed(e: OSError, path: Path, step_index: int, previous: int | None) -> UserError:
    kept = (f"the checkpoint of step {previous} is intact: --resume continues from it" if previous
            else "no checkpoint of this run was complete yet")
    return write_failed(e, path, f"cannot save the checkpoint of step {step_index}",
                        f"free space there or choose another --out; {kept}")


def read(out_dir: Path) -> dict:
    """The newest checkpoint of ``out_dir`` that loads: a one-process one (its tensors loaded) or a
    sharded one (its metadata; ``restore`` reads the shards), with ``skipped``: the newer ones that
    did not load, as (name, why). A checkpoint naming a type memfit never writes stops the resume
    (memfit.training.safe_load.UnsafeCheckpoint): the folder was tampered with."""
    found = retention.complete(out_dir)
    if not found:
        raise UserError(f"--resume: no checkpoint in {str(out_dir)!r}; run without --resume to start")
    skipped = []
    for entry in found:
        try:
            state = sharded_checkpoint.read(entry.path) if entry.kind == "dcp" else retention.load_record(entry.path, FORMAT)
        except retention.Unreadable as e:
            skipped.append((entry.name, str(e)))
            continue
        return {**state, "kind": entry.kind, "path": str(entry.path), "skipped": skipped}
    raise UserError(f"--resume: no checkpoint in {str(out_dir)!r} loads ("
                    + "; ".join(f"{name}: {why}" for name, why in skipped)
                    + "); restore them from a copy, or start a new run in another --out folder")


def skipped_note(state: dict) -> str | None:
    """The one line a resume says about the newer checkpoints it skipped (None: it took the newest)."""
    if not state.get("skipped"):
        return None
    names = "; ".join(f"{name} ({why})" for name, why in state["skipped"])
    return f"resume: skipped {names}; continuing from {Path(state['path']).name} (step {state['step']})"


def check(state: dict, *, workload: str, requested_plan, batch_size: int) -> None:
    if state["workload"] != redact(workload):
        raise UserError(f"the checkpoint in --out is from another model ({state['workload']}); "
                        "use a fresh --out folder for this workload")
    # compared as plans: a key this version added since the checkpoint was written takes its default
    written = _plan(laid_out_as(state["plan"], requested_plan))
    if written != requested_plan or state["batch_size"] != batch_size:
        raise UserError("the checkpoint in --out was written with another plan or batch size; resume with the "
                        "same --plan/--batch-size (the world size may differ), or start a new run in another --out "
                        "folder")


def laid_out_as(values: dict, plan: Plan) -> dict:
    """A checkpoint's plan ``values`` with the sharding of ``plan``: a run may resume at another
    world size."""
    mine = plan.to_dict()
    return {**values, **{k.name: mine[k.name] for k in SHARDING.keys if k.name in mine}}


def resumed_plan(state: dict, requested_plan: Plan) -> Plan:
    """The plan a resumed run continues with: the checkpoint's adapted plan, sharded as this run is."""
    return Plan.from_dict(laid_out_as(state["adapted_plan"], requested_plan), source="the checkpoint's plan")


def _plan(data: dict):
    try:
        return Plan.from_dict(data, source="the checkpoint's plan")
    except UserError:
        return None  # a key this version does not know: not the same plan


def restore(step, state: dict) -> tuple[int, int]:
    """Load ``state`` into ``step`` (built with the checkpoint's adapted plan); (steps done, samples seen)."""
    shapes = {n: tuple(p.shape) for n, p in step.model.named_parameters()}
    if state["shapes"] != shapes:
        raise UserError(f"the checkpoint in --out is from another model ({state['workload']}); "
                        "use a fresh --out folder for this workload")
    sharded = step.plan.config("shard").fsdp2
    if state["kind"] == "dcp":
        sharded_checkpoint.load(step, state)
    elif sharded:
        sharded_checkpoint.load_whole(step, state)
    else:
        load_step_state(step, state)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if state["rng"].get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"], state["samples_seen"]


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Delete temporary files left by saves that were killed (their process is gone)."""
    removed = []
    for tmp in [*out_dir.glob(".checkpoint*.tmp-*"), *out_dir.glob("checkpoint-dcp-*/.*.tmp-*")]:
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exists(out_dir: Path) -> bool:
    return bool(retention.complete(out_dir))


def drop_records_after(path: Path, step: int) -> None:
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
