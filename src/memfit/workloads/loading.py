"""Loading a workload from what the user names: a Workload, ``path/to/file.py:NAME``, an importable
module's ``package.module:NAME``, a local
Hugging Face model folder (``./dir`` or ``hf:./dir``, built from its config.json), a hub id
(``org/name[@revision]``, its config.json alone: NOTE [ Hub ids ] in :mod:`memfit.workloads.hub`)
or a built-in. An existing folder always wins over a hub id of the same name."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from memfit.errors import UserError
from memfit.workload import Workload
from memfit.workloads.builtin import builtin_names, builtin_workload, folder_workload, hub_workload
from memfit.workloads.config_overrides import split_overrides
from memfit.workloads.hub import is_hub_id


def load_workload(spec: str | Workload, *, seq_len: int | None = None,
                  resolution: int | tuple[int, int] | None = None) -> Workload:
    """Resolve a workload spec: a Workload, ``file.py:NAME``, ``package.module:NAME``, a model folder (``./dir``, ``hf:./dir``,
    ``./dir/config.json``), a hub id (``org/name``, ``org/name@rev``, ``hf:name``) or a built-in name
    with overrides. ``seq_len`` sizes built-ins, folders and hub models; ``resolution`` the
    image-generation built-ins: pixels on a side, or ``(width, height)`` (NOTE [ A resolution's width ]
    in memfit.workloads.checks)."""
    if isinstance(spec, Workload):
        _builtin_sizes_only(seq_len, resolution, "set it inside your workload")
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise UserError("no workload given; name a built-in (e.g. gpt2), a file (path/to/file.py:NAME), "
                        "a model folder (./dir holding config.json) or a hub id (org/name)")
    spec = spec.strip()
    sizes = {"seq_len": seq_len, "resolution": resolution, "load": load_workload}
    if spec[:3].lower() == "hf:":
        name, overrides = split_overrides(spec[3:].strip())
        if not _is(Path(name).expanduser(), "exists") and is_hub_id(name, bare_names=True):
            return hub_workload(name, **sizes, overrides=overrides)
        return folder_workload(name, **sizes, overrides=overrides)
    head = spec.split(":", 1)[0]
    if Path(head).suffix.lower() in (".yml", ".yaml"):
        raise UserError(f"{head} is not a workload; an axolotl config is read with --from: memfit estimate --from "
                        f"{head} (or plan --from)")
    base, overrides = split_overrides(spec)  # NOTE [ Overrides of a config.json ]
    if overrides and _names_a_folder(base, base):
        return folder_workload(base, **sizes, overrides=overrides)
    if overrides and is_hub_id(base):
        return hub_workload(base, **sizes, overrides=overrides)
    if head.endswith(".py") or Path(head).suffix == ".py":
        _builtin_sizes_only(seq_len, resolution, "set it inside your workload file")
        return _load_file_workload(spec)
    if _names_a_module(spec, head):
        _builtin_sizes_only(seq_len, resolution, "set it inside your workload module")
        return _load_module_workload(spec)
    if _names_a_folder(spec, head):
        return folder_workload(spec, seq_len=seq_len, resolution=resolution, load=load_workload)
    if is_hub_id(spec):
        return hub_workload(spec, seq_len=seq_len, resolution=resolution, load=load_workload)
    if "/" in head or "\\" in head:
        _builtin_sizes_only(seq_len, resolution, "set it inside your workload file")
        return _load_file_workload(spec)
    return builtin_workload(spec, seq_len=seq_len, resolution=resolution)


def _builtin_sizes_only(seq_len: int | None, resolution: int | None, fix: str) -> None:
    for flag, value in (("--seq-len", seq_len), ("--resolution", resolution)):
        if value is not None:
            raise UserError(f"{flag} applies to built-in workloads, model folders and hub ids only; {fix}")


def _names_a_module(spec: str, head: str) -> bool:
    """``package.module:NAME``, as ``python -m``, uvicorn and setuptools' entry points name an object:
    a dotted name of identifiers (one dot at least, so no built-in's name) that is no existing path."""
    _, _, name = spec.partition(":")
    return ("." in head and all(part.isidentifier() for part in head.split("."))
            and (not name or name.isidentifier()) and not _is(Path(head), "exists"))


def _load_module_workload(spec: str) -> Workload:
    module_name, _, name = spec.partition(":")
    if not name:
        raise UserError(f"workload {spec!r} names no object; write {module_name}:NAME (a Workload or a function "
                        "returning one)")
    try:
        found = importlib.util.find_spec(module_name)
    except ImportError:  # a parent package is missing
        found = None
    if found is None:
        raise UserError(f"no module {module_name!r} to import; install its package, or name a file as "
                        "path/to/file.py:NAME")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise UserError(f"workload module {module_name!r} raised {type(e).__name__} while importing: {e}; "
                        "fix the module (run with --debug for the traceback)") from e
    return _workload_from(module, name, module_name, f"{module_name}:{name}")


def _is(path: Path, test: str) -> bool:
    """``path.exists()`` or ``path.is_dir()``, False where the name cannot be a path (a built-in's long overrides:
    a name over 255 bytes makes ``stat`` fail with ENAMETOOLONG, which pathlib passes on)."""
    try:
        return getattr(path, test)()
    except OSError:
        return False


def _names_a_folder(spec: str, head: str) -> bool:
    """A model folder: an existing folder or config.json; or a path (it has a slash) that does not
    exist and is neither a ``file:NAME`` spec nor a hub id by form (then "not found" says what a
    folder needs). A bare word that is also a built-in's name stays the built-in."""
    path = Path(spec).expanduser()
    if _is(path, "is_dir"):
        return "/" in spec or head.lower() not in builtin_names()
    if path.name == "config.json":
        return True
    return (not _is(path, "exists") and ("/" in spec or spec.startswith("~")) and ":" not in spec
            and not is_hub_id(spec))


def _load_file_workload(spec: str) -> Workload:
    path_text, _, name = spec.partition(":")
    path = Path(path_text)
    if path.is_dir():
        raise UserError(f"workload {spec!r}: {path_text} is a folder; give a model folder (with key=value overrides "
                        "of its config.json, if any) or a file as path/to/file.py:NAME")
    if not path.is_file():
        raise UserError(f"workload file {path_text!r} not found; give path/to/file.py:NAME (or a model folder "
                        "holding config.json)")
    if not name:
        raise UserError(f"workload {spec!r} names no object; write {path_text}:NAME (a Workload or a function returning one)")
    mod_name = f"memfit_user_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None:  # not a .py file: Python has no loader for it
        raise UserError(f"workload file {path_text!r} is not a Python file; give path/to/file.py:NAME")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise UserError(f"workload file {path_text!r} raised {type(e).__name__} while importing: {e}; "
                        "fix the file (run with --debug for the traceback)") from e
    return _workload_from(module, name, path_text, f"{path.name}:{name}")


def _workload_from(module, name: str, where: str, default_name: str) -> Workload:
    """``module.name``: a Workload, or a function returning one (called with no arguments)."""
    if not hasattr(module, name):
        found = [k for k, v in vars(module).items() if isinstance(v, Workload) or (callable(v) and not k.startswith("_"))]
        raise UserError(f"{where} has no {name!r}; define a Workload or a function returning one"
                        + (f" (found: {', '.join(found[:8])})" if found else ""))
    obj = getattr(module, name)
    if not isinstance(obj, Workload):
        if not callable(obj):
            raise UserError(f"{where}:{name} is a {type(obj).__name__}, not a Workload or a function returning one")
        try:
            obj = obj()
        except Exception as e:
            raise UserError(f"{where}:{name}() raised {type(e).__name__}: {e}; fix the workload "
                            "(run with --debug for the traceback)") from e
        if not isinstance(obj, Workload):
            raise UserError(f"{where}:{name}() returned a {type(obj).__name__}, not a memfit.Workload")
    if obj.name == "workload":
        obj.name = default_name
    return obj
