"""What the training configs people already have become: memfit's workload, sizes and plan (``memfit
estimate --from FILE``, and ``plan``; an axolotl YAML, memfit.integrations.axolotl, or a kohya-ss
sd-scripts TOML, memfit.integrations.kohya, told apart by the file's suffix: memfit.integrations.from_file)."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import UserError
from memfit.plans import Plan
from memfit.techniques.reentrant_checkpoint import non_reentrant_beside_compile_or_fsdp


@dataclass(frozen=True)
class TrainingConfig:
    """What a training config says, in memfit's terms."""

    path: str
    workload: str
    batch_size: int
    micro_batch_size: int
    seq_len: int | None
    plan: Plan
    warnings: tuple[str, ...] = ()
    resolution: int | tuple[int, int] | None = None
    """An image's side, or its (width, height) (NOTE [ A resolution's width ] in memfit.workloads.checks)."""
    ranks_from_launcher: str | None = None
    """Set where the config shards over ranks it does not count (axolotl's FSDP): why ``--world-size`` is needed."""
    batch_per_rank: bool = False
    """The config's batch is each rank's (axolotl's ``micro_batch_size`` x ``gradient_accumulation_steps``, per GPU):
    over ``--world-size N`` ranks memfit's batch, all the ranks', is N times it."""

    def summary(self) -> str:
        split = (f" ({self.micro_batch_size} a micro-batch x {self.batch_size // self.micro_batch_size} accumulated)"
                 if self.batch_size != self.micro_batch_size else "")
        seq = f" · seq {self.seq_len}" if self.seq_len else ""
        res = self.resolution
        px = f" · {res[0]}x{res[1]} px" if isinstance(res, tuple) else f" · {res} px" if res else ""
        return f"from {self.path}: {self.workload} · batch {self.batch_size}{split}{seq}{px} · {self.plan.describe()}"


def whole(data: dict, key: str, where: str, default):
    """``data[key]``, a whole number >= 1 (``default`` where it is absent)."""
    value = data.get(key, default)
    if value is default:
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"--from {where}: {key} must be a whole number >= 1, got {value!r}")
    return value


def text_config(model: str) -> dict | None:
    """The config.json of ``model`` (a folder or a hub id in the Hugging Face cache), its language model's part
    (``text_config`` of a multimodal model); None where it cannot be read here."""
    import json
    from pathlib import Path

    from memfit.workloads import hub
    try:
        folder = Path(model).expanduser() if Path(model).expanduser().is_dir() else hub.hub_config_folder(model)
        config = json.loads((folder / "config.json").read_text())
    except (UserError, OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    return config.get("text_config") if isinstance(config.get("text_config"), dict) else config


def module_names(data: dict, key: str, where: str, commas: bool = False) -> list[str]:
    """``data[key]`` as module names: a YAML list, or one name (``commas``: one string of names separated by commas,
    as LLaMA-Factory takes them)."""
    value = data[key]
    names = ([n.strip() for n in value.split(",")] if commas else [value]) if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise UserError(f"--from {where}: {key} must be " + ("module names (a list, or one string separated by "
                        "commas)" if commas else "a list of module names") + f", got {value!r}")
    return names


def reentrant_set_aside(fields: dict, where: str, tool: str) -> list[str]:
    """A config's reentrant checkpoint beside torch.compile or FSDP (plan fields ``compile``, ``shard``), which memfit
    runs with the non-reentrant one only (memfit.techniques.reentrant_checkpoint): ``fields`` changed to that one,
    and the line that says so (none where nothing changed)."""
    if not non_reentrant_beside_compile_or_fsdp(fields):
        return []
    return [f"{tool} config {where}: the reentrant checkpoint beside torch.compile or FSDP is predicted as the "
            "non-reentrant one, which memfit runs with them (the reentrant one's first input gradient, one hidden "
            "state, is left out)"]


def read_toml(path, where: str, what: str) -> dict:
    """The TOML file at ``path`` (a pathlib.Path); one line where it is missing (``give {what}``) or not TOML."""
    try:
        import tomllib
    except ImportError:  # (Python 3.10)
        import tomli as tomllib
    if not path.is_file():
        raise UserError(f"{where}: no such file; give {what}")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: not valid TOML ({str(e).splitlines()[0]}); fix the file") from None
