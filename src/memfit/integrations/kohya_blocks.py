"""sd-scripts' ``network_args`` that choose which FLUX.1 blocks its LoRA adapts, as memfit's adapter ``only=``.

``networks.lora_flux`` adapts the linear layers of FLUX.1's double- and single-stream blocks. Three of its
``network_args`` narrow that (``networks/lora_flux.py``, ``create_network``):

- ``train_blocks``: ``all`` (the default), ``single`` or ``double``: the single-stream blocks alone, or the
  double-stream ones;
- ``train_double_block_indices`` and ``train_single_block_indices``: ``all``, ``none``, or indices and ranges
  (``0-5,10``) of the blocks of each kind that keep their LoRA (the others' get rank 0: no module).

memfit's LoRA of a kohya config adapts every linear layer (``targets=all-linear``); a selection becomes ``only=`` with
each kept block's name as diffusers writes it under ``transformer.`` (``transformer.transformer_blocks.3.``,
``transformer.single_transformer_blocks.10.``: the first is no part of the second) and ``text_encoders.``, whose
trained CLIP-L keeps its LoRA as in sd-scripts. Fewer adapted layers mean fewer LoRA weights, gradients, optimizer
states and saved inputs; the frozen model's memory is the same.
"""

from __future__ import annotations

from memfit.errors import UserError

FLUX_DOUBLE, FLUX_SINGLE = 19, 38
"""FLUX.1's double- and single-stream blocks (memfit's order: the doubles first, then the singles)."""
KINDS = {"all": (True, True), "single": (False, True), "double": (True, False)}
"""``train_blocks``: (double-stream blocks adapted, single-stream blocks adapted)."""


def network_args(data: dict, where: str) -> dict[str, str]:
    """A config's ``network_args`` (``["key=value", ...]``) as a dict; a malformed entry is a one-line error."""
    args = data.get("network_args") or []
    if isinstance(args, str):
        args = [args]
    out: dict[str, str] = {}
    for arg in args if isinstance(args, list) else [None]:
        key, sep, value = str(arg).partition("=")
        if not isinstance(arg, str) or not sep or not key.strip():
            raise UserError(f"--from {where}: network_args must be a list of \"key=value\" strings, got {arg!r}")
        out[key.strip()] = value.strip()
    return out


def flux_blocks(args: dict[str, str], where: str) -> list[str]:
    """The adapter's ``only=`` option for FLUX.1's block selection in ``args`` (its keys removed), or none where
    every block keeps its LoRA."""
    kind = args.pop("train_blocks", "all")
    if kind not in KINDS:
        raise UserError(f"--from {where}: network_args train_blocks={kind} is not all, single or double")
    double, single = KINDS[kind]
    doubles = _selection(args.pop("train_double_block_indices", "all"), FLUX_DOUBLE, "train_double_block_indices",
                         where) if double else []
    singles = _selection(args.pop("train_single_block_indices", "all"), FLUX_SINGLE, "train_single_block_indices",
                         where) if single else []
    if len(doubles) == FLUX_DOUBLE and len(singles) == FLUX_SINGLE:
        return []
    if not doubles and not singles:
        raise UserError(f"--from {where}: network_args select no FLUX.1 block for the LoRA (train_blocks={kind}); "
                        "select some, or train no network")
    names = [f"transformer.transformer_blocks.{i}." for i in doubles] + \
        [f"transformer.single_transformer_blocks.{i}." for i in singles] + ["text_encoders."]
    return ["only=" + "+".join(names)]


def _selection(text: str, total: int, key: str, where: str) -> list[int]:
    """sd-scripts' ``parse_block_selection``: ``all``, ``none`` (or empty), or indices and ranges below ``total``."""
    if text == "all":
        return list(range(total))
    if text in ("none", ""):
        return []
    chosen: set[int] = set()
    try:
        for part in text.split(","):
            start, _, end = (x.strip() for x in part.partition("-"))
            first, last = int(start), int(end or start)
            if not 0 <= first <= last < total:
                raise ValueError
            chosen.update(range(first, last + 1))
    except ValueError:
        raise UserError(f"--from {where}: network_args {key}={text} is not all, none, or indices and ranges below "
                        f"{total} (e.g. 0-5,10)") from None
    return sorted(chosen)
