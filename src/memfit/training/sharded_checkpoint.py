"""Checkpoints of sharded runs: PyTorch's Distributed Checkpoint (DCP), resumable at any world size.

A sharded run (``memfit train --nproc N``) holds each parameter and optimizer state as a DTensor,
1/N of it per rank. Gathering them into one file would need the whole model in one process; DCP
instead has every rank write its own shards in parallel, with a metadata file that records which
piece of which tensor is where. Loading reads whatever pieces the loading ranks need, so a
checkpoint written by N ranks resumes on M ranks, or in one process, unchanged. The state dicts
are ``torch.distributed.checkpoint.state_dict``'s: keyed by parameter name (not by the
optimizer's parameter numbers), the same for a sharded and an unsharded model.

Atomic, like memfit.training.checkpoint: each save writes a new folder
(``checkpoint-dcp-<step>``: the ranks' shards, DCP's metadata, and rank 0's ``meta.pt`` with the
step, the samples seen, the plans and the RNG states), and only then does rank 0 point
``checkpoint-dcp.json`` at it (written to a temporary file and renamed). A run killed mid-save
leaves the pointer on the last good folder; older folders are removed after the pointer moves.

A one-process checkpoint (``checkpoint.pt``) resumes on N ranks too: its full state dicts are
renamed by parameter and sharded as they load (``set_state_dict`` with ``full_state_dict``).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from memfit.errors import UserError
from memfit.outputs import sync_dir, write_synced

POINTER = "checkpoint-dcp.json"
PREFIX = "checkpoint-dcp-"
FORMAT = 1


def exists(out_dir: Path) -> bool:
    return (out_dir / POINTER).is_file()


def save(out_dir: Path, step, ranks, meta: dict) -> Path:
    """Every rank: write its shards of ``step``'s model and optimizer; rank 0 adds ``meta`` and
    moves the pointer. Returns the checkpoint's folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = out_dir / f"{PREFIX}{meta['step']:08d}"
    model, optim = get_state_dict(step.model, _optimizers(step))
    with warnings.catch_warnings():  # (one process without a group: memfit's own tests)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.save({"model": model, "optim": optim, **_ema(step)}, checkpoint_id=str(folder))
    if ranks.is_main:
        write_synced(folder / "meta.pt", lambda f: torch.save({"format": FORMAT, **meta}, f))
        write_synced(out_dir / f".{POINTER}.tmp", lambda f: f.write(json.dumps(
            {"format": FORMAT, "folder": folder.name, "step": meta["step"]}).encode()))
        os.replace(out_dir / f".{POINTER}.tmp", out_dir / POINTER)
        sync_dir(out_dir)
        for old in out_dir.glob(f"{PREFIX}*"):
            if old.is_dir() and old.name != folder.name:
                shutil.rmtree(old, ignore_errors=True)
    ranks.barrier()
    return folder


def read(out_dir: Path) -> dict:
    """The checkpoint's metadata (step, samples seen, plans, RNG states), with ``folder``."""
    pointer = out_dir / POINTER
    try:
        folder = out_dir / json.loads(pointer.read_text())["folder"]
        meta = torch.load(folder / "meta.pt", map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any failure is a corrupt checkpoint
        raise UserError(f"checkpoint {str(pointer)!r} is corrupt or unreadable ({type(e).__name__}); delete it "
                        "and the checkpoint-dcp-* folders, or point --out to another folder") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"checkpoint {str(folder)!r} is not a memfit checkpoint of this version")
    return {**meta, "folder": str(folder)}


def load(step, state: dict) -> None:
    """Load a DCP checkpoint into ``step``, sharded over any number of ranks or in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = get_state_dict(step.model, _optimizers(step))  # (the layout to read into)
    into = {"model": model, "optim": optim, **_ema(step)}
    with warnings.catch_warnings():  # (that one process reads it is the point)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(into, checkpoint_id=state["folder"])
    set_state_dict(step.model, _optimizers(step), model_state_dict=model, optim_state_dict=optim)
    if "ema" in into:
        step.ema.load_sharded_state_dict(into["ema"])


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


def remove(out_dir: Path) -> None:
    """Drop a DCP checkpoint (a one-process checkpoint saved after it is the current one now)."""
    (out_dir / POINTER).unlink(missing_ok=True)
    for old in out_dir.glob(f"{PREFIX}*"):
        shutil.rmtree(old, ignore_errors=True)
