"""Checkpoints of sharded runs: PyTorch's Distributed Checkpoint (DCP), resumable at any world size.

A sharded run (``memfit train --nproc N``) holds each parameter and optimizer state as a DTensor,
1/N of it per rank. Gathering them into one file would need the whole model in one process; DCP
instead has every rank write its own shards in parallel, with a metadata file that records which
piece of which tensor is where. Loading reads whatever pieces the loading ranks need, so a
checkpoint written by N ranks resumes on M ranks, or in one process, unchanged. The state dicts
are ``torch.distributed.checkpoint.state_dict``'s: keyed by parameter name (not by the
optimizer's parameter numbers), the same for a sharded and an unsharded model.

NOTE [ A DCP save is complete when rank 0 says so ]: each save writes a new folder
(``checkpoint-dcp-<step>``). Every rank writes its shards (DCP's ``save`` is collective: its
coordinator, rank 0, writes DCP's ``.metadata`` once every rank's writes have returned, each file
fsync'ed); then all ranks meet at a barrier, and only then does rank 0 write ``meta.pt`` (the
step, the samples seen, the plans, the RNG states; to a temporary file, fsync'ed, renamed), the
mark of a complete save. A run killed mid-save leaves a folder without ``meta.pt``, which resume
never reads, and the checkpoints before it. Which are kept: memfit.training.retention.

Reading runs no code from the folder (memfit.training.safe_load): ``meta.pt`` and DCP's non-tensor
values go through the weights-only allowlist, DCP's ``.metadata`` through an unpickler that knows
DCP's metadata classes only. Before a resume takes a folder, every shard file its metadata names
is checked to be there and long enough (a save cut short by a full disk on one rank).

A one-process checkpoint (``checkpoint-<step>.pt``) resumes on N ranks too: its full state dicts
are renamed by parameter and sharded as they load (``set_state_dict`` with ``full_state_dict``).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from memfit.errors import UserError
from memfit.outputs import os_error, sync_dir, write_synced
from memfit.training import retention, safe_load

FORMAT = 1
_DCP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def save(out_dir: Path, step, ranks, meta: dict, *, failed) -> Path:
    """Every rank: write its shards of ``step``'s model and optimizer; rank 0 adds ``meta``, the
    mark of a complete save (NOTE [ A DCP save is complete when rank 0 says so ]). Returns the
    checkpoint's folder. ``failed(error, path)``: the UserError for a write that failed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = out_dir / retention.dcp_name(meta["step"])
    if ranks.is_main and folder.exists():  # (a save of this step cut short, or a run passed over: rewritten)
        shutil.rmtree(folder, ignore_errors=True)
    ranks.barrier()
    model, optim = get_state_dict(step.model, _optimizers(step))
    try:
        with warnings.catch_warnings():  # (one process without a group: memfit's own tests)
            warnings.filterwarnings("ignore", message=_DCP_WARNING)
            dcp.save({"model": model, "optim": optim, **_ema(step)}, checkpoint_id=str(folder))
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = _os_error(e)
        if error is None:
            raise
        if ranks.is_main:
            shutil.rmtree(folder, ignore_errors=True)
        raise failed(error, Path(error.filename) if error.filename else folder) from None
    ranks.barrier()  # every rank's shards are written
    if ranks.is_main:
        tmp = folder / f".{retention.DCP_MARK}.tmp-{os.getpid()}"
        try:
            write_synced(tmp, lambda f: torch.save({"format": FORMAT, **meta}, f))
            os.replace(tmp, folder / retention.DCP_MARK)
            sync_dir(folder)
            sync_dir(out_dir)
        except (OSError, RuntimeError) as e:
            if os_error(e) is None:
                raise
            shutil.rmtree(folder, ignore_errors=True)
            raise failed(os_error(e), tmp) from None
    return folder


def _os_error(e: BaseException) -> OSError | None:
    """The OSError (a full disk, an I/O error) behind a failed DCP save, on any rank."""
    for exc_pair in (getattr(e, "failures", None) or {}).values():
        found = os_error(exc_pair[0] if isinstance(exc_pair, tuple) else exc_pair)
        if found is not None:
            return found
    return os_error(e)


def read(folder: Path) -> dict:
    """A complete DCP checkpoint's metadata (step, samples seen, plans, RNG states), with
    ``folder``; memfit.training.retention.Unreadable when it does not load."""
    meta, metadata = retention.load_record(folder / retention.DCP_MARK, FORMAT,
                                           lambda: safe_load.load_dcp_metadata(folder / ".metadata"))
    short = _short_shard(folder, metadata)
    if short:
        raise retention.Unreadable(f"shard file {short} is missing or cut short")
    return {**meta, "folder": str(folder)}


def _short_shard(folder: Path, metadata) -> str | None:
    """The first shard file that DCP's metadata names and that is missing or too short."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = folder / name
        if not path.is_file() or path.stat().st_size < size:
            return name
    return None


def load(step, state: dict) -> None:
    """Load a DCP checkpoint into ``step``, sharded over any number of ranks or in one process."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = get_state_dict(step.model, _optimizers(step))  # (the layout to read into)
    into = {"model": model, "optim": optim, **_ema(step)}
    load_folder(into, state["folder"])
    set_state_dict(step.model, _optimizers(step), model_state_dict=model, optim_state_dict=optim)
    if "ema" in into:
        step.ema.load_sharded_state_dict(into["ema"])


def load_folder(into: dict, folder: str) -> None:
    """``dcp.load`` of ``folder`` into the state dict ``into``, by the allowlist of
    memfit.training.safe_load; a failure is one line."""
    import torch.distributed.checkpoint as dcp
    try:
        with warnings.catch_warnings():  # (that one process reads it is the point)
            warnings.filterwarnings("ignore", message=_DCP_WARNING)
            dcp.load(into, storage_reader=safe_load.dcp_reader(folder), planner=safe_load.dcp_planner())
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        cause = _first_failure(e)
        if isinstance(cause, UserError):
            raise cause from None
        raise UserError(f"checkpoint {folder!r} could not be read ({type(cause).__name__}: "
                        f"{str(cause).strip()[:150]}); move it away to resume from the checkpoint before it") from None


def _first_failure(e: BaseException) -> BaseException:
    for exc_pair in (getattr(e, "failures", None) or {}).values():
        return exc_pair[0] if isinstance(exc_pair, tuple) else exc_pair
    return e


def load_whole(step, state: dict) -> None:
    """Load a one-process checkpoint (memfit.training.checkpoint's full state dicts) into a sharded
    ``step``: each rank keeps its shards of the full tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    _check_plain_optimizer(step)
    optim = by_name(step, state["optimizer"])
    set_state_dict(step.model, step.optimizer, model_state_dict=state["model"], optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True))
    if hasattr(step.ema, "load_whole_state_dict"):
        step.ema.load_whole_state_dict(state["ema"])


def by_name(step, optim_state: dict) -> dict:
    """An optimizer state dict keyed by parameter number (``Optimizer.state_dict``) keyed by
    parameter name instead, for ``step``'s optimizer (numbers go through its groups in order, as
    in the optimizer that wrote them: both were built by ``build_step`` for the same model)."""
    names = {id(p): n for n, p in step.model.named_parameters()}
    order = [names[id(p)] for group in step.optimizer.param_groups for p in group["params"]]
    return {"state": {order[i]: s for i, s in optim_state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optim_state["param_groups"]]}


def _ema(step) -> dict:
    """The EMA's part of a DCP checkpoint (none without an EMA)."""
    return {"ema": step.ema.sharded_state_dict()} if hasattr(step.ema, "sharded_state_dict") else {}


def _optimizers(step):
    """What DCP's state-dict functions take for ``step``'s optimizer: the optimizer, or the
    per-parameter optimizers of optimizer-in-backward (one state dict keyed by parameter name)."""
    per_param = getattr(step.optimizer, "optimizers", None)
    return list(per_param.values()) if per_param is not None else step.optimizer


def _check_plain_optimizer(step) -> None:
    if not isinstance(step.optimizer, torch.optim.Optimizer):
        raise UserError(f"the plan {step.plan.describe()} keeps optimizer state that a checkpoint moved between world "
                        "sizes cannot carry; resume with the world size that wrote it")
