"""``--from FILE``: a training config people already have, read by its suffix (a YAML: axolotl's,
memfit.integrations.axolotl, an ai-toolkit job's, memfit.integrations.ai_toolkit, told apart by its
``config: process:``, torchtune's, memfit.integrations.torchtune, by its ``model: _component_: torchtune.models...``,
or LLaMA-Factory's, memfit.integrations.llamafactory, by its ``model_name_or_path``; a
kohya-ss sd-scripts TOML: memfit.integrations.kohya; a SimpleTuner config.json, config.toml or config.env:
memfit.integrations.simpletuner, a JSON or TOML told apart by its ``model_family``) as memfit's workload, sizes and
plan (memfit.integrations.configs.TrainingConfig)."""

from __future__ import annotations

from pathlib import Path

from memfit.devices import Device
from memfit.errors import UserError
from memfit.integrations import ai_toolkit, axolotl, kohya, llamafactory, simpletuner, torchtune
from memfit.integrations.configs import TrainingConfig, read_toml


def read_training_config(path: str | Path, device: Device, workload: str | None = None) -> TrainingConfig:
    """The config at ``path``: ``.yml``/``.yaml`` axolotl's, ai-toolkit's or LLaMA-Factory's, ``.toml`` kohya's or
    SimpleTuner's, ``.json`` and ``.env`` SimpleTuner's (``workload``: the model the user names beside it; a kohya
    config may train a checkpoint file that does not say which model it is)."""
    suffix = Path(path).suffix.lower()
    if suffix in (".yml", ".yaml"):
        data = _peek_yaml(Path(path))
        if ai_toolkit.is_ai_toolkit(data):
            return ai_toolkit.map_config(data, str(path), device, workload)
        if torchtune.is_torchtune(data):
            return torchtune.map_config(data, str(path), device, Path(path).read_text(), workload)
        if workload is not None:
            key = "model_name_or_path" if llamafactory.is_llamafactory(data) else "base_model"
            raise UserError(f"give a workload or --from {path}, not both (the config's {key} is the workload)")
        if llamafactory.is_llamafactory(data):
            return llamafactory.map_config(data, str(path), device)
        if llamafactory.is_llamafactory_v1(data):
            raise UserError(f"--from {path}: a config of LLaMA-Factory's v1 trainer (model:, model_class:) is not read; "
                            "give its v0 config (model_name_or_path:, finetuning_type:, ...)")
        return axolotl.read_config(path, device)
    if suffix == ".toml":
        if simpletuner.is_simpletuner(_peek_toml(Path(path))):
            return simpletuner.read_config(path, device, workload)
        return kohya.read_config(path, device, workload)
    if suffix in (".json", ".env"):
        return simpletuner.read_config(path, device, workload)
    raise UserError(f"--from {path}: give an axolotl, ai-toolkit, LLaMA-Factory or torchtune config (.yml, .yaml), a "
                    "kohya-ss sd-scripts config (.toml) or a SimpleTuner config (.json, .toml, .env)")


def _peek_yaml(path: Path) -> object:
    """The YAML's data, or None where it cannot be read (axolotl's reader then says why, in one line)."""
    import yaml
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None


def _peek_toml(path: Path) -> object:
    """The TOML's data, or None where it cannot be read (kohya's reader then says why, in one line)."""
    try:
        return read_toml(path, str(path), "a TOML file")
    except UserError:
        return None
