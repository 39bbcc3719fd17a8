"""Overrides of a model folder's or hub id's config.json, written as for a built-in:
``Qwen/Qwen2.5-7B-Instruct:num_hidden_layers=14,max_position_embeddings=65536``.

NOTE [ Overrides of a config.json ]
transformers' ``AutoConfig.from_pretrained(id, num_hidden_layers=14)`` takes fields as keyword
arguments; a hub id's config.json sits in the hub's cache, where no one should edit it. So a hub id
or a model folder takes ``:key=value`` pairs, as a built-in does, applied to the config.json's fields
before the model is built from it (one path: NOTE [ Model folders ] in :mod:`memfit.workloads.hf`).
A dotted key reaches a nested config (``text_config.num_hidden_layers=4`` of a vision-language model);
``a/b/c`` gives a list (``axes_dims_rope=16/56/56``), as in a built-in's overrides; ``1e6`` is a number
(YAML 1.1 reads it as a string). A key must be a field of the config: in the config.json, or, for a
transformers model, of its config class (a field the file leaves at its default), its aliases read as
``from_pretrained`` reads them (GPT-2's ``num_hidden_layers`` is ``n_layer``). A misspelt one would
otherwise become an attribute no model reads, and the prediction would be of the model unchanged. The
config class then checks the values, as for any config.json.
"""

from __future__ import annotations

import difflib

from memfit.errors import UserError
from memfit.units import parse_key_values, parse_scalar


def split_overrides(spec: str) -> tuple[str, str]:
    """``org/name:key=value,...`` -> (``org/name``, ``key=value,...``); no overrides: (spec, "")."""
    head, sep, rest = spec.rpartition(":")
    if sep and head and "=" in rest and "=" not in head:
        return head, rest
    return spec, ""


def with_override(spec: str, key: str, value) -> str:
    """``spec`` with ``key=value`` added beside the overrides it has (``unet-sdxl:layers_per_block=1`` ->
    ``unet-sdxl:layers_per_block=1,width=1216``)."""
    head, overrides = split_overrides(spec)
    return f"{head}:{overrides + ',' if overrides else ''}{key}={value}"


def parse_overrides(text: str, where: str) -> dict:
    """The ``key=value`` pairs of ``text`` (YAML scalars; ``a/b/c`` a list of them)."""
    values = parse_key_values(text, where, example=f"{where}:num_hidden_layers=4")
    return {k: [parse_scalar(x) for x in v.split("/")] if isinstance(v, str) and "/" in v else v for k, v in values.items()}


def apply_overrides(data: dict, overrides: dict | None, where: str) -> dict:
    """``data`` (a config.json's object) with ``overrides`` set; a key not in it is a one-line error."""
    if not overrides:
        return data
    data = dict(data)
    fields = _config_class_fields(data)
    for key, value in overrides.items():
        *parents, field = key.split(".")
        aliases, known = fields if fields is not None and not parents else ({}, {})
        field = aliases.get(field, field)
        node, path = data, []
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise UserError(f"{where}: its config.json has no nested config {'.'.join([*path, part])!r} "
                                f"for the override {key}; name a field of the config.json")
            node[part] = node = dict(node[part])
            path.append(part)
        if field not in node and field not in known:
            close = difflib.get_close_matches(field, [k for k in node if isinstance(k, str)] + [*known, *aliases], n=1)
            hint = f" (did you mean {'.'.join([*path, close[0]])}?)" if close else ""
            raise UserError(f"{where}: its config has no field {key!r}{hint}; name a field of its config.json"
                            + (" or of its config class" if fields is not None else ""))
        node[field] = _number(value, node[field] if field in node else known[field])
    return data


def _number(value, current):
    """``value``, a number where it is written as one and the field holds one (``1e6``, ``1e-5``)."""
    if isinstance(value, list):
        return [_number(v, current[0] if isinstance(current, list) and current else None) for v in value]
    if isinstance(value, str) and isinstance(current, (int, float)) and not isinstance(current, bool):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if isinstance(current, int) and number.is_integer() else number
    return value


def _config_class_fields(data: dict) -> tuple[dict, dict] | None:
    """A transformers config's (aliases, {field: default}) from its class, or None (not one)."""
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        return None
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        cls = CONFIG_MAPPING[model_type]
        defaults = cls().to_dict()
    except Exception:  # noqa: BLE001 - not transformers', or a class that needs arguments: the file's fields only
        return None
    return dict(getattr(cls, "attribute_map", {}) or {}), defaults

