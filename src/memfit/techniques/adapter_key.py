"""The plan key ``adapter``: its text read as the adapter it names.

``none`` (:class:`memfit.techniques.adapter.NoAdapter`), ``lora:OPTIONS`` and ``dora:OPTIONS``
(:class:`memfit.techniques.adapter.LoRA`), ``lokr:OPTIONS`` (:class:`memfit.techniques.lokr.LoKr`), ``lycoris:OPTIONS``
(:class:`memfit.techniques.lycoris_networks.LycorisAdapter`); ``qlora:`` and
``qdora:`` are read before, as an adapter and its base weights (memfit.plans). The options are comma-separated
``name=value`` pairs, lists ``+``-separated; each module's docstring says what its options mean. A text that names
no adapter, an option its kind does not take, or a value of the wrong kind is one line.
"""

from __future__ import annotations

import re

from memfit.errors import UserError
from memfit.techniques.adapter import Adapter, LoRA, NoAdapter
from memfit.techniques.base import Key, Technique, register
from memfit.techniques.lokr import LoKr, parse_lokr
from memfit.techniques.lycoris_networks import LycorisAdapter, parse_lycoris

_OPTION = re.compile(r"^([a-z_]+)=(.+)$")
_LISTS = ("targets", "save", "params", "skip", "only")
_LORA = ("r", "alpha", "dropout", *_LISTS)
_LOKR = ("factor", "decompose_both", "factored")
"""LoKr's own options, read by memfit.techniques.lokr.parse_lokr (and its ``r=full``)."""
_LYCORIS = ("algo", "dim", "alpha", "factor", "modules")
"""A LyCORIS network's options (memfit.techniques.lycoris_networks)."""


def parse(values: dict) -> Adapter:
    text = values["adapter"]
    if text in (None, "none", False):
        return NoAdapter()
    if not isinstance(text, str):
        raise UserError(f"plan: adapter {text!r} is not valid; write none, lora:r=16,... or dora:r=16,...")
    kind, _, rest = text.partition(":")
    if kind not in ("lora", "dora", "lokr", "lycoris"):
        raise UserError(f"plan: adapter {text!r} is not valid; write none, lora:r=16,alpha=32,targets=q_proj+v_proj, "
                        "dora:r=16, lokr:r=16,factor=16, lycoris:algo=lokr,dim=16, or qlora:r=16 (lora over nf4 base "
                        "weights)")
    if kind == "lycoris":
        return parse_lycoris(_options(rest, _LYCORIS, "algo=, dim=, alpha=, factor=, modules=a+b"), text)
    own = _LOKR if kind == "lokr" else ()
    hint = ("r=, alpha=, targets=a+b, dropout=, save=a+b, params=a+b, skip=a+b, only=a+b (e.g. lora:r=16,alpha=32,"
            "targets=q_proj+v_proj)" + ("; LoKr's factor=, decompose_both=, factored=" if own else ""))
    options = {name: value if name in own or (own and (name, value) == ("r", "full")) else _option(name, value, text)
               for name, value in _options(rest, (*_LORA, *own), hint).items()}
    return parse_lokr(options, text) if kind == "lokr" else LoRA(**options, dora=kind == "dora")


def _options(rest: str, names: tuple[str, ...], hint: str) -> dict:
    """``name=value`` pairs of ``names`` (as text), or one line naming the option that is not one and the others."""
    options = {}
    for part in filter(None, rest.split(",")):
        m = _OPTION.match(part.strip())
        if not m or m.group(1) not in names:
            raise UserError(f"plan: adapter option {part!r} is not valid; use {hint}")
        options[m.group(1)] = m.group(2)
    return options


def _option(name: str, value: str, text: str):
    if name in _LISTS:
        return tuple(v for v in value.split("+") if v)
    try:
        return int(value) if name == "r" else float(value)
    except ValueError:
        raise UserError(f"plan: adapter {text!r}: {name}={value} is not a number") from None


TECHNIQUE = register(
    Technique("adapter", (Key("adapter", "none", "Train an adapter instead of the model (a method: changes what is "
                              "trained): none | lora:r=16,alpha=32,targets=q_proj+v_proj,dropout=0.05,save=lm_head | "
                              "lora:r=16,targets=in-blocks,skip=ff_i.experts,only=blocks.1 (leave out the linear layers "
                              "whose names hold a skip or no only: ai-toolkit's ignore_if_contains, only_if_contains) | "
                              "lora:r=16,params=experts.gate_up_proj+experts.down_proj (a mixture of experts' "
                              "expert weights) | dora:... | lokr:r=16,factor=16 (LoKr; factored=1: ai-toolkit's) | "
                              "lycoris:algo=lokr,dim=10000,factor=16,modules=Attention+FeedForward (LyCORIS's) | "
                              "qlora:... and qdora:... (the same over base_weights nf4).", metavar="ADAPTER"),), parse),
    Adapter, NoAdapter, LoRA, LoKr, LycorisAdapter)
