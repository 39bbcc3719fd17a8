"""Adapters (LoRA, DoRA; LoKr in memfit.techniques.lokr): a *method*, not a technique: train small low-rank matrices
beside frozen base weights instead of the weights themselves.

A LoRA adapter of rank r on a linear layer W [out, in] adds ``B @ A`` (A: [r, in], B: [out, r], B starts at zero)
scaled by alpha / r; only A and B train. Memory: the base weights stay, but their gradients and optimizer states go
(AdamW: 12 of 16 bytes per fp32 parameter), replaced by those of r * (in + out) adapter parameters per layer.
Activations barely shrink: backward still needs each targeted layer's input (for A's gradient) and the frozen
layers' inputs only where a trainable parameter lies before them; the adapter adds its own [tokens, r] intermediate
(and a dropout mask when ``dropout`` > 0). DoRA also learns a magnitude per output feature and normalises ``W + BA``
by its column norm every forward: an extra [out, in] temporary per layer and more compute.

It changes *what is trained* (a different model comes out), so the planner never picks it by itself: ``memfit plan
--methods full,lora`` compares methods only when asked (NOTE [ Methods are the user's ]).

Plan key ``adapter``: ``none`` (:class:`NoAdapter`), ``lokr:OPTIONS`` (memfit.techniques.lokr), or ``lora:OPTIONS``
/ ``dora:OPTIONS`` (:class:`LoRA`) with comma-separated options ``r=16,alpha=32,targets=q_proj+v_proj,
dropout=0.05,save=lm_head,params=experts.gate_up_proj``. Targets are PEFT's names (module-name suffixes,
``+``-separated); without them PEFT's defaults for the model's type, diffusers' attention projections
(``to_q+to_k+to_v+to_out.0``) for a diffusers model (Flux: its attention and feed-forward layers, as diffusers' Flux
LoRA; kohya's also adapts the blocks' modulations: ``targets=all-linear``), else every linear layer but the output
layer (``all-linear``); ``targets=in-blocks`` takes every linear layer inside the model's repeated blocks only
(ai-toolkit's ``transformer_only``), and ``targets=in-blocks:layers`` those of the blocks listed under that name
alone (ai-toolkit's Z-Image LoRA: its 30 ``layers``, not the refiners' four blocks); ``targets=linear-modules`` the
names of every module whose class is a linear layer's, the output layer's left out (axolotl's
``lora_target_linear``, the QLoRA repository's ``find_all_linear_names``: PEFT's ``all-linear`` also adapts a
transformers mixture of experts' router and fused experts). ``skip`` leaves out every linear layer whose name holds
one of its strings (ai-toolkit's ``ignore_if_contains``), ``only`` every one whose name holds none of its strings
(``only_if_contains``; ``skip`` wins where both hold); a denoiser's names are matched as diffusers writes them,
under ``transformer.``, too. ``save`` lists modules trained in full beside the adapter (PEFT's ``modules_to_save``,
e.g. a classifier head); ``params`` names parameters of no linear layer (PEFT's ``target_parameters``: a mixture of
experts' 3-D expert weights, adapted per expert). The adapter is injected with PEFT's own
``inject_adapter_in_model``, so the model keeps its class and the workload's loss runs unchanged. A workload that
builds a PEFT model itself (``get_peft_model``, ``inject_adapter_in_model``, diffusers' ``add_adapter``) needs no
plan key: its frozen weights already get no gradients.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memfit.errors import UserError, brief
from memfit.techniques.base import Config, Export

ALL_LINEAR = "all-linear"
LINEAR_MODULES = "linear-modules"
"""The name suffixes of the modules whose class is a linear layer's (``nn.Linear``, bitsandbytes' ``Linear4bit``, by the
word in the class name), the output layer's left out: axolotl's ``lora_target_linear``."""
IN_BLOCKS = "in-blocks"
"""Every linear layer inside the model's repeated blocks (memfit.techniques.checkpointing.find_blocks; a
denoiser's beside its text encoders), as ai-toolkit's ``transformer_only`` LoRA of a DiT: not the
embedders, the final norm's modulation nor the output layer that ``all-linear`` takes too."""


# NOTE [ Methods are the user's ]
# The empty plan trains the workload's own model. A method key (``adapter``, ``base_weights``)
# changes the parameters that train, so it is applied only when the plan names it, before every
# technique (``order``), and never searched by default.
class Adapter(Config):
    rank = None  # a method: not in the techniques' memory order

    def values(self) -> dict:
        return {"adapter": self.text_value()}

    def text_value(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class NoAdapter(Adapter):
    """Train the workload's model as it is (every parameter that requires grad)."""

    def text_value(self) -> str:
        return "none"


@dataclass(frozen=True)
class LoRA(Adapter):
    """A LoRA (or DoRA) adapter on the target linear layers; the rest of the model is frozen."""

    r: int = 16
    """Rank of the update (>= 1)."""
    alpha: float | None = None
    """Scale numerator (the update is scaled by alpha / r); None: 2 * r."""
    targets: tuple[str, ...] = ()
    """Module names to adapt (PEFT's ``target_modules``; ``all-linear``: every linear layer but the
    output layer; ``in-blocks``: every linear layer inside the repeated blocks); empty: PEFT's default for
    the model type, else all linear layers but the output layer."""
    dropout: float = 0.0
    """Dropout on the adapter's input (0 <= dropout < 1)."""
    save: tuple[str, ...] = ()
    """Modules trained in full beside the adapter (PEFT's ``modules_to_save``)."""
    params: tuple[str, ...] = ()
    """Parameters to adapt that are no linear layer's (PEFT's ``target_parameters``), e.g. a
    mixture of experts' ``experts.gate_up_proj+experts.down_proj`` (3-D, one matrix per expert);
    given alone, only they are adapted."""
    dora: bool = False
    """Weight-decomposed LoRA (DoRA): also learn a magnitude per output feature."""
    skip: tuple[str, ...] = ()
    """Linear layers left out: those whose names hold any of these strings (ai-toolkit's ``ignore_if_contains``)."""
    only: tuple[str, ...] = ()
    """Linear layers left out: those whose names hold none of these strings (ai-toolkit's ``only_if_contains``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise UserError(f"plan: adapter rank r must be a whole number >= 1, got {self.r!r}; write e.g. lora:r=16")
        if self.alpha is not None and not self.alpha > 0:
            raise UserError(f"plan: adapter alpha must be > 0, got {self.alpha!r}; write e.g. lora:r=16,alpha=32")
        if not 0 <= self.dropout < 1:
            raise UserError(f"plan: adapter dropout must be in [0, 1), got {self.dropout!r}; write e.g. dropout=0.05")


    @property
    def kind(self) -> str:
        return "dora" if self.dora else "lora"

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.r

    def text_value(self) -> str:
        opts = [f"r={self.r}"]
        if self.alpha is not None:
            opts.append(f"alpha={self.alpha:g}")
        if self.targets:
            opts.append("targets=" + "+".join(self.targets))
        if self.dropout:
            opts.append(f"dropout={self.dropout:g}")
        if self.save:
            opts.append("save=" + "+".join(self.save))
        if self.params:
            opts.append("params=" + "+".join(self.params))
        if self.skip:
            opts.append("skip=" + "+".join(self.skip))
        if self.only:
            opts.append("only=" + "+".join(self.only))
        return f"{self.kind}:" + ",".join(opts)

    @property
    def in_blocks(self) -> bool:
        """The targets are the linear layers of the repeated blocks (``in-blocks``, ``in-blocks:NAME``)."""
        return bool(self.targets) and all(t == IN_BLOCKS or t.startswith(IN_BLOCKS + ":") for t in self.targets)

    def peft_config(self, model):
        """The PEFT ``LoraConfig`` for ``model`` (targets resolved: see the module docstring)."""
        peft = peft_or_error()
        targets = list(self.targets) if self.targets else [] if self.params else _default_targets(model, peft)
        extra = {"target_parameters": list(self.params)} if self.params else {}
        if targets == [ALL_LINEAR]:  # (targets=all-linear: PEFT's shorthand, which it takes as a string only)
            targets = ALL_LINEAR
        elif LINEAR_MODULES in targets:
            targets = sorted(set(_linear_module_names(model)) | set(targets) - {LINEAR_MODULES})
        elif self.in_blocks:
            lists = {t.partition(":")[2] for t in targets} - {""}
            targets = _linears_in_blocks(model, self.text_value(), lists if IN_BLOCKS not in targets else None)
        return peft.LoraConfig(r=self.r, lora_alpha=self.scale_alpha, lora_dropout=self.dropout,
                               target_modules=targets, use_dora=self.dora,
                               modules_to_save=list(self.save) or None, **extra)

    def apply(self, parts) -> None:
        peft = peft_or_error()
        config = self.peft_config(parts.model)
        left_out = list(getattr(parts.model, "adapter_leaves_out", None) or [])  # (a workload's frozen encoders)
        if config.target_modules == ALL_LINEAR and not self.targets:
            left_out += _left_out(config, parts.model)
        skipped = self._skipped(parts.model)  # (exact names: PEFT's list also takes a name's suffix, FLUX's proj_out)
        config.exclude_modules = "|".join([*(rf"(?:.*\.)?{re.escape(n)}" for n in left_out), *map(re.escape, skipped)]) \
            if skipped else left_out or None  # (the list's entries as PEFT's list matches them: a name or its suffix)
        try:
            parts.model = peft.inject_adapter_in_model(config, parts.model)
        except (ValueError, NotImplementedError) as e:  # (a model PEFT asks what it does not answer: PP-FormulaNet's
            # get_input_embeddings raises NotImplementedError)
            if "not found in the base model" in str(e) or "Target modules" in str(e):
                targets = config.target_modules
                names = [targets] if isinstance(targets, str) else [*targets]
                names += getattr(config, "target_parameters", None) or []
                raise UserError(f"plan: adapter {self.text_value()}: the targets {', '.join(names)} "
                                f"match no module or parameter of the model; name its linear layers (e.g. "
                                f"targets=q_proj+v_proj) or parameters (params=experts.gate_up_proj; "
                                f"`memfit estimate ... --modules 20` lists the modules)") from None
            raise UserError(f"plan: adapter {self.text_value()}: PEFT refuses it on this model ({brief(e)}); name "
                            "the layers to adapt (e.g. targets=q_proj+v_proj)") from None
        # peft casts a new adapter to its base layer's dtype, a 4-bit layer's compute dtype (bf16 as QLoRA sets it);
        # get_peft_model then upcasts it to fp32 (its autocast_adapter_dtype=True), as this does (the precision may
        # cast it again: bf16-pure)
        from peft.tuners.tuners_utils import cast_adapter_dtype
        cast_adapter_dtype(parts.model, adapter_name="default")
        if self.save:
            _check_saved(parts.model, self.save, self.text_value())

    def _skipped(self, model) -> list[str]:
        """The linear layers ``skip`` and ``only`` leave out; either naming no layer is a one-line error."""
        import torch
        names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)] if self.skip or self.only else []

        def held(name: str, parts: tuple[str, ...]) -> bool:
            return any(s in name or s in "transformer." + name.removeprefix("denoiser.") for s in parts)
        for key, parts in (("skip", self.skip), ("only", self.only)):
            if parts and not any(held(n, parts) for n in names):
                raise UserError(f"plan: adapter {self.text_value()}: {key}={'+'.join(parts)} is in no linear layer's "
                                "name; give a part of a name (`memfit estimate ... --modules 20` lists the modules)")
        return [n for n in names if held(n, self.skip) or self.only and not held(n, self.only)]

    def label(self, batch_size):
        return f"{self.kind}{self.r}"

    def export(self, into: Export) -> None:
        extras = self.dora or bool(self.save or self.params or self.dropout)
        into.not_carried(self, kohya=extras or bool(self.skip or self.only) or self.targets != (ALL_LINEAR,),
                         ai_toolkit=extras or self.targets != (ALL_LINEAR,) and not self.in_blocks,
                         axolotl=bool(self.params or self.skip or self.only) or self.in_blocks
                         or ALL_LINEAR in self.targets)
        self._axolotl(into)
        if not self.dora:  # (sd-scripts' LoRA adapts every linear layer of the blocks; ai-toolkit's, the transformer's)
            into.kohya.update(network_module="networks.lora", network_dim=self.r, network_alpha=self.scale_alpha,
                              network_train_unet_only=True)
            into.ai_toolkit.update({"network.type": "lora", "network.linear": self.r,
                                    "network.linear_alpha": self.scale_alpha, **self._ai_toolkit_layers()})
        note = f"build the PEFT model in your code: get_peft_model(model, {self._peft_text()})"
        into.hf_notes.append(note)
        into.lightning_notes.append(note)

    def _ai_toolkit_layers(self) -> dict:
        kwargs = {**({"ignore_if_contains": list(self.skip)} if self.skip else {}),
                  **({"only_if_contains": list(self.only)} if self.only else {})}
        return {"network.transformer_only": self.in_blocks, **({"network.network_kwargs": kwargs} if kwargs else {})}

    def _axolotl(self, into: Export) -> None:
        """axolotl's LoRA fields (``qlora`` over the 4-bit base weights memfit.techniques.base_weights wrote)."""
        fields = into.axolotl
        fields.update(adapter="qlora" if fields.get("load_in_4bit") else "lora", lora_r=self.r)
        if self.alpha is not None:
            fields["lora_alpha"] = self.alpha
        if LINEAR_MODULES in self.targets:
            fields["lora_target_linear"] = True
            if fields.get("quantize_moe_experts"):
                into.axolotl_notes.append("axolotl refuses lora_target_linear with quantize_moe_experts: name the "
                                          "linear layers in lora_target_modules instead (the same layers)")
        named = [t for t in self.targets if t != LINEAR_MODULES]
        if named and not self.in_blocks:
            fields["lora_target_modules"] = named
        if self.dropout:
            fields["lora_dropout"] = self.dropout
        if self.save:
            fields["lora_modules_to_save"] = list(self.save)
        if self.dora:
            fields["peft_use_dora"] = True

    def _peft_text(self) -> str:
        args = [f"r={self.r}", f"lora_alpha={self.scale_alpha:g}"]
        if self.targets:
            args.append(f"target_modules={list(self.targets)}")
        if self.dropout:
            args.append(f"lora_dropout={self.dropout:g}")
        if self.save:
            args.append(f"modules_to_save={list(self.save)}")
        if self.params:
            args.append(f"target_parameters={list(self.params)}")
        if self.dora:
            args.append("use_dora=True")
        if self.skip or self.only:  # (PEFT matches a string in full: those holding a skip, or none of the only)
            alt = {k: "|".join(map(re.escape, v)) for k, v in (("skip", self.skip), ("only", self.only))}
            cases = ([f"(?=.*(?:{alt['skip']}))"] if self.skip else []) + ([f"(?!.*(?:{alt['only']}))"] if self.only else [])
            args.append(f"exclude_modules={'(?:' + '|'.join(cases) + ').*'!r}")
        return f"LoraConfig({', '.join(args)})"


DIFFUSERS_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
"""The attention projections diffusers' LoRA training scripts adapt (train_text_to_image_lora,
train_dreambooth_lora_*)."""


FLUX_TARGETS = (r".*transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|"
                r"to_add_out)|ff(_context)?\.net\.(0\.proj|2)|proj_mlp|proj_out)")
"""Flux's LoRA targets: diffusers' ``train_dreambooth_lora_flux`` default (both streams' attention
projections and feed-forward layers) and the single-stream blocks' MLP and output projections (kohya's
Flux LoRA adapts these and the blocks' modulation layers too: ``targets=all-linear``); one regex PEFT
matches against whole module names, so the model's own final ``proj_out`` is not adapted."""
DIFFUSERS_MODEL_TARGETS = {"FluxTransformer2DModel": FLUX_TARGETS,
                           "HiDreamImageTransformer2DModel": ["to_k", "to_q", "to_v", "to_out"]}
"""Default targets of diffusers models whose LoRA scripts adapt other layers than the attention projections
(HiDream's ``to_out`` is a Linear, not ``to_out.0``: its script's default names it so, the image stream's alone)."""


def _default_targets(model, peft) -> list[str] | str:
    """PEFT's default target modules for a transformers model type; for a diffusers model the
    layers its LoRA scripts adapt (:data:`DIFFUSERS_MODEL_TARGETS`, else the attention
    projections); else every linear layer but the output layer (PEFT's ``all-linear``). A model that
    holds a ``denoiser`` beside its text encoders (memfit.workloads.text_encoders) takes the denoiser's,
    and its own ``adapter_targets`` beside them; one that holds ``experts`` of one class (Wan 2.2's two:
    memfit.workloads.wan_experts) takes an expert's, in each."""
    import torch
    experts = getattr(model, "experts", None)
    if isinstance(experts, tuple) and experts and all(isinstance(e, torch.nn.Module) for e in experts):
        return _default_targets(experts[0], peft)
    denoiser = getattr(model, "denoiser", None)
    if isinstance(denoiser, torch.nn.Module):
        inner, extra = _default_targets(denoiser, peft), list(getattr(model, "adapter_targets", ()))
        return inner if not extra or isinstance(inner, str) else [*inner, *extra]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    mapping = getattr(peft.utils, "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING", {})
    if isinstance(model_type, str) and model_type in mapping:  # (names, or a regular expression: gemma4's)
        return mapping[model_type] if isinstance(mapping[model_type], str) else list(mapping[model_type])
    family = mapping.get(model_type.removesuffix("_text")) if isinstance(model_type, str) else None
    if family is not None and not isinstance(family, str):  # (a text-only config of a multimodal family's names:
        return list(family)                                  # llama4_text as llama4; a family's expression names its paths)
    if type(model).__module__.startswith("diffusers.") and type(model).__name__ in DIFFUSERS_MODEL_TARGETS:
        return DIFFUSERS_MODEL_TARGETS[type(model).__name__]
    if type(model).__module__.startswith("diffusers.") and \
            any(name.endswith(".to_q") for name, _ in model.named_modules()):
        return DIFFUSERS_TARGETS
    return ALL_LINEAR


def _linears_in_blocks(model, text: str, lists: set[str] | None = None) -> list[str]:
    """The whole names of the linear layers inside ``model``'s repeated blocks (:data:`IN_BLOCKS`): of its
    denoiser where it holds one beside text encoders, with the layers those encoders' adapters take where
    they train. ``lists``: only the blocks of the lists of these names (``in-blocks:layers``)."""
    import torch

    from memfit.techniques.checkpointing import find_blocks
    denoiser = getattr(model, "denoiser", None)
    root, prefix = (denoiser, "denoiser.") if isinstance(denoiser, torch.nn.Module) else (model, "")
    found = [blocks for blocks, _ in find_blocks(root)]
    if lists is not None and not lists <= set(found):
        raise UserError(f"plan: adapter {text}: {', '.join(sorted(lists - set(found)))} is not a list of the model's "
                        f"repeated blocks; name one of {', '.join(found) or '(none)'} (in-blocks:NAME)")
    names = [f"{prefix}{blocks}.{name}" for blocks in found if lists is None or blocks in lists
             for name, m in root.get_submodule(blocks).named_modules() if isinstance(m, torch.nn.Linear)]
    if not names:
        raise UserError(f"plan: adapter {text}: the model has no repeated blocks holding linear layers; name the "
                        "layers to adapt (e.g. targets=all-linear)")
    return names + list(getattr(model, "adapter_targets", ()) if prefix else ())


def adapter_facts(model, adapter=None) -> list[str]:
    """A line for a report of a model with adapter layers: which layers were adapted (by their last two
    names: ``self_attn.q_proj x32``) and the parameters trained. The default targets are PEFT's or
    every linear layer, so a user sees what they became (JetMoE's experts are no linear layers: its
    routers alone are adapted). ``adapter``: the plan's, whose named targets that match no adapted layer get a
    line of their own (PEFT adapts the others and says nothing: a config's ``q_proj`` on Phi-3's fused
    ``qkv_proj``)."""
    from collections import Counter

    import torch
    adapted = [n for n, m in model.named_modules()
               if any(isinstance(getattr(m, a, None), (torch.nn.ModuleDict, torch.nn.ParameterDict)) and
                      len(getattr(m, a)) for a in ("lora_A", "lokr_w1", "lokr_w1_a"))  # (LoRA's, LoKr's)
               or is_lycoris_module(getattr(m, "lycoris", None))]  # (LyCORIS's: memfit.techniques.lycoris_networks)
    names = Counter(".".join(n.split(".")[-2:]) for n in adapted)
    if not names:
        return []
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = ", ".join(f"{k} x{v}" for k, v in names.most_common(6)) + (", ..." if len(names) > 6 else "")
    named = [t for t in getattr(adapter, "targets", ()) if t not in (ALL_LINEAR, LINEAR_MODULES)
             and not t.startswith(IN_BLOCKS)]
    missed = [t for t in named if not any(n == t or n.endswith("." + t) for n in adapted)]
    return [f"adapter: {sum(names.values())} layers adapted ({layers}); {trained:,} parameters trained",
            *([f"adapter: targets {', '.join(missed)} match no layer of this model, and PEFT adapts the others without "
               "a word; name its own layers (`memfit estimate ... --modules 20` lists them)"] if missed else [])]


def is_lycoris_module(module) -> bool:
    """Whether ``module`` is one of a LyCORIS network's (lycoris-lora's ``lycoris.modules``), by its class's module."""
    return type(module).__module__.startswith("lycoris.modules.")


def _left_out(config, model) -> list[str]:
    """The layer names of ``model`` left out of the default ``all-linear``: those PEFT refuses to adapt with
    ``config`` (a Mamba mixer's ``out_proj``: PEFT raises), and a model's own subclasses of ``nn.Linear`` with a
    forward of their own (a router returning scores and indices, Llama 4's and PhiMoE's: PEFT's layer adds its
    update to a pair and fails)."""
    import torch
    from peft.tuners import tuners_utils
    check = getattr(tuners_utils, "_check_lora_target_modules_mamba", None)
    refused = set()
    for path, module in model.named_modules():
        name = path.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and type(module).forward is not torch.nn.Linear.forward and \
                type(module).__module__.startswith("transformers.models."):
            refused.add(name)
        elif check is not None and path and name not in refused:
            try:
                check(config, model, name)
            except ValueError:
                refused.add(name)
    return sorted(refused)


def _linear_module_names(model) -> list[str]:
    """``targets=linear-modules``: the last name of each module whose class is a linear layer's (``nn.Linear`` or a
    class named so: bitsandbytes' ``Linear4bit``), less the output layer's, as axolotl's ``find_all_linear_names``."""
    import torch
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if name and (isinstance(module, torch.nn.Linear) or "Linear" in type(module).__name__)}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = next((name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is output), None)
    return sorted(names - {head})


def _check_saved(model, names: tuple[str, ...], text: str) -> None:
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "ModulesToSaveWrapper"}
    missing = [n for n in names if n.rsplit(".", 1)[-1] not in wrapped]
    if missing:
        raise UserError(f"plan: adapter {text}: save={'+'.join(missing)} matches no module of the model; name a "
                        "module to train in full (e.g. save=lm_head)")


def peft_or_error():
    try:
        import peft
    except ImportError:
        raise UserError("plan: adapter needs peft (pip install 'memfit[peft]' or pip install peft)") from None
    return peft
