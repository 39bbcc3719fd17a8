"""Loading checkpoints without running their code: an allowlist of the types memfit writes.

A pickle is a program: unpickling may call any function the file names (``os.system`` through an
object's ``__reduce__``), so ``torch.load(..., weights_only=False)`` of a checkpoint someone shared,
or one on a shared filesystem, runs whatever was put in it. PyTorch's answer, the default since
2.6, is ``weights_only=True``: an unpickler that builds tensors, containers and numbers and refuses
any other global unless it is allowlisted (``torch.serialization.safe_globals``).

NOTE [ What a checkpoint may hold ]: memfit writes dicts, lists, tuples, strings, numbers and
tensors (the model's, the optimizers' states, the grad scaler's and the EMA's, the RNG states as
byte tensors and Python's ``random.getstate()`` tuple), all within PyTorch's default allowlist,
plus torchao's low-bit optimizer states, which are tensor subclasses (:data:`TENSOR_SUBCLASSES`;
bitsandbytes' 8-bit states are plain tensors). The globals a file names are read first, without
running it (``torch.serialization.get_unsafe_globals_in_checkpoint`` disassembles the pickle); a
name outside the allowlist is refused in one line that names it, and the file is never unpickled.
A library may widen PyTorch's allowlist for its own types (torchao registers its subclasses when
imported); nothing else is added.

DCP checkpoints (memfit.training.sharded_checkpoint) are read through the same rules: DCP's
``.metadata`` is a plain pickle (``FileSystemReader.read_metadata`` calls ``pickle.load``), read
here by an unpickler that resolves only DCP's own metadata classes (the ``find_class`` recipe of
Python's pickle documentation); and DCP's non-tensor values (an optimizer's hyperparameters), which
its default planner reads with ``weights_only=False``, are read with :func:`load_file`'s rules.
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path

import torch

from memfit.errors import UserError

TENSOR_SUBCLASSES = {
    "torchao.optim.subclass_8bit.OptimState8bit": "torchao",
    "torchao.optim.subclass_4bit.OptimState4bit": "torchao",
    "torchao.optim.subclass_fp8.OptimStateFp8": "torchao",
}
"""Globals beyond PyTorch's default allowlist that memfit's checkpoints hold: torchao's optimizer
states (optimizer: adamw8bit-ao, adamw4bit-ao, adamwfp8-ao), with the package each needs."""

DCP_METADATA = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}
"""What DCP's ``.metadata`` pickle names: its metadata dataclasses, sizes, dtypes (:func:`_dcp_global`),
layouts and the checkpoint's path."""


class UnsafeCheckpoint(UserError):
    """A checkpoint names a type memfit never writes: it was not made by memfit (or was changed)."""


def refusal(path: Path | str, name: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"checkpoint {str(path)!r} names {name}, which memfit never writes; refused unread (nothing in it ran). "
        "Delete it if you did not put it there, or resume from a checkpoint you trust")


def load_file(path: Path | str):
    """``torch.load`` of a checkpoint file written by memfit (CPU tensors), by the allowlist of
    NOTE [ What a checkpoint may hold ]. Raises :class:`UnsafeCheckpoint` for a name outside it;
    other failures (a truncated or corrupt file) are PyTorch's exceptions."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    return _load(path, names, lambda: torch.load(path, map_location="cpu", weights_only=True))


def load_bytes(data: io.BytesIO, where: str):
    """The same as :func:`load_file` for a ``torch.save`` stream in memory (DCP's non-tensor values)."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(data)
    data.seek(0)
    return _load(where, names, lambda: torch.load(data, map_location="cpu", weights_only=True))


def _load(where, names: list[str], load):
    unknown = sorted(n for n in names if n not in TENSOR_SUBCLASSES)
    if unknown:
        raise refusal(where, unknown[0])
    allowed = [_resolve(where, n) for n in sorted(names)]
    try:
        with torch.serialization.safe_globals(allowed):
            return load()
    except pickle.UnpicklingError as e:  # the weights-only unpickler refused something else (an opcode, a call)
        why = (str(e).strip().splitlines() or ["refused"])[-1]
        raise UnsafeCheckpoint(f"checkpoint {str(where)!r} was refused by PyTorch's weights-only loader ({why[:200]}); "
                               "nothing in it ran. Delete it if you did not put it there") from None


def _resolve(where, name: str):
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError:
        raise UserError(f"checkpoint {str(where)!r} holds {TENSOR_SUBCLASSES[name]}'s optimizer states and "
                        f"{TENSOR_SUBCLASSES[name]} is not installed here; pip install {TENSOR_SUBCLASSES[name]}") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Python's "Restricting Globals" unpickler: DCP's metadata classes and nothing else."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA or _dcp_global(module, name):
            return super().find_class(module, name)
        raise refusal(self.where, f"{module}.{name}")


def _dcp_global(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))


def load_dcp_metadata(path: Path):
    """DCP's ``.metadata`` of a checkpoint folder, unpickled by the allowlist above."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f, str(path)).load()


def dcp_reader(folder: Path | str):
    """A ``FileSystemReader`` for ``folder`` that reads its metadata by the allowlist above."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = load_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def dcp_planner():
    """DCP's default load planner, reading non-tensor values by the allowlist above."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # (as the default planner does)

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = load_bytes(value, f"a DCP value ({fqn})")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafePlanner()
