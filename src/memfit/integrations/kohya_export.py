"""A plan as kohya-ss sd-scripts arguments: ``memfit plan ... --format kohya`` prints the lines of a
``--config_file`` TOML that run the plan memfit chose (the inverse of memfit.integrations.kohya's table),
what sd-scripts has no argument for, and what the user's own setup must hold (cached latents and text
outputs: memfit's batch is the cached tensors).

Each technique writes its own arguments (``Config.export``'s ``kohya``; what it cannot carry is listed as
plan keys); here the model family's adjustments follow: its LoRA module, FLUX's swapped blocks (sd-scripts
counts N/2 double-stream blocks and N single-stream ones, so the smallest ``blocks_to_swap`` that swaps
at least the plan's bytes is written, and said), and what sd-scripts runs for some families only. Each
value is the one :func:`memfit.integrations.kohya.map_config` reads back into the same plan.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from memfit.devices import Device
from memfit.errors import UserError
from memfit.integrations.export import carried_by, export
from memfit.integrations.kohya import FLUX_DOUBLE, FLUX_MOST_SWAPPED, FLUX_SINGLE, family_of, flux_swap
from memfit.plans import Plan
from memfit.techniques.precision import Autocast

MODULES = {"flux": "networks.lora_flux", "sd3": "networks.lora_sd3", "lumina": "networks.lora_lumina",
           "unet": "networks.lora"}
"""sd-scripts' LoRA module of each model family."""


@dataclass(frozen=True)
class KohyaArguments:
    """A plan's sd-scripts arguments, and what they cannot carry."""

    arguments: dict
    unmapped: tuple[str, ...]
    """Plan settings sd-scripts has no argument for (as plan keys)."""
    notes: tuple[str, ...]
    """What the rest of the user's setup must hold."""

    def toml(self) -> str:
        """The arguments as the lines of a ``--config_file`` TOML."""
        return "\n".join(f"{k} = {_value(v)}" for k, v in self.arguments.items())


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, str) else repr(v)


def to_kohya(plan: Plan, batch_size: int, model: str, resolution: int | tuple[int, int] | None = None,
             device: Device | str | None = None, model_class: str | None = None,
             text_encoders: str | None = None, t5: str | None = None, t5_tokens: int | None = None,
             t5_mask: bool | None = None) -> KohyaArguments:
    """``plan`` at ``batch_size`` (global) for ``model`` (a workload's name: it says the model family) as
    sd-scripts arguments: each technique's own (``Config.export``'s ``kohya``), then the family's: its LoRA
    module, FLUX's count of swapped blocks, and what sd-scripts runs for that family only. ``text_encoders``,
    ``t5``, ``t5_tokens`` and ``t5_mask``: the workload's (memfit.workloads.text_encoders, packed_dits)."""
    into = export(plan, batch_size, device)
    args, unmapped = dict(into.kohya), list(into.kohya_unmapped)
    cached = CACHED if text_encoders in (None, "cached") else T5_CACHED if t5 == "cached" else LATENTS_CACHED
    notes = [cached, *into.kohya_notes]
    if t5_tokens is not None:
        args["t5xxl_max_token_length"] = t5_tokens
    if t5_mask:
        args["apply_t5_attn_mask"] = True
    family = family_of(model, {}, model_class)
    if family is None:
        raise UserError(f"--format kohya: sd-scripts trains FLUX.1, SD3, Lumina 2 and SD/SDXL UNets, not {model}"
                        + (f" ({model_class})" if model_class else "") + "; use --format yaml, hf or lightning")
    if "network_module" in args:
        args["network_module"] = MODULES[family]
        if text_encoders == "trained":  # (the workload's text encoders train: memfit.workloads.text_encoders)
            del args["network_train_unet_only"]
        args["network_alpha"] = _number(args["network_alpha"])
        if isinstance(plan.config("precision"), Autocast):
            notes.append(f"mixed_precision {args['mixed_precision']}: sd-scripts' LoRA script casts the frozen base to "
                         f"{args['mixed_precision']} too, where the plan keeps it in fp32 (less memory than predicted; "
                         f"precision {args['mixed_precision']}-base is what it runs)")
    if args.get("fp8_base") and args.get("mixed_precision") == "no":
        unmapped.append("precision: fp32 (sd-scripts' fp8_base needs mixed_precision bf16 or fp16)")
    if resolution is not None:
        args["resolution"] = f"{resolution[0]},{resolution[1]}" if isinstance(resolution, tuple) else str(resolution)
    if args.get("gradient_accumulation_steps") == 1:
        del args["gradient_accumulation_steps"]
    _family_rules(args, unmapped, notes, family)
    return KohyaArguments(args, tuple(unmapped), tuple(notes))


def runs_in_sd_scripts(batch_size: int, model: str, resolution: int | tuple[int, int] | None = None,
                       device: Device | str | None = None, model_class: str | None = None,
                       fixed: dict | None = None, text_encoders: str | None = None, t5: str | None = None,
                       t5_tokens: int | None = None, t5_mask: bool | None = None) -> Callable[[Plan], bool]:
    """Whether sd-scripts' arguments carry a plan (``memfit plan --format kohya`` searches only those): every
    setting :func:`to_kohya` cannot carry is one of the ``fixed`` fields the user gave (theirs to keep, and
    listed). A model sd-scripts does not train is refused here, before a search."""
    text = {"text_encoders": text_encoders, "t5": t5, "t5_tokens": t5_tokens, "t5_mask": t5_mask}
    return carried_by(lambda plan: to_kohya(plan, batch_size, model, resolution, device, model_class, **text), fixed)


LATENTS_CACHED = ("cache_latents (or cache_latents_to_disk): memfit's batch is the cached latents; the text encoders run "
                  "in the step, as the workload holds them")
CACHED = ("cache_latents and cache_text_encoder_outputs (or their _to_disk forms): memfit's batch is the cached latents "
          "and text-encoder outputs")
T5_CACHED = ("cache_latents and cache_text_encoder_outputs = true: memfit's batch is the cached latents and T5-XXL's "
             "states; the CLIP encoders run in the step, as sd-scripts runs them with that cache where they train "
             "(or with use_t5xxl_cache_only)")


def _family_rules(args: dict, unmapped: list[str], notes: list[str], family: str) -> None:
    """What sd-scripts runs for some families only: offloaded checkpointing (FLUX's and SD3's, without swapped
    blocks), FLUX's count of swapped blocks (the smallest that swaps at least the plan's: less device memory
    than predicted, a note), the fused backward pass (full fine-tuning, Adafactor, no accumulation)."""
    if args.get("blocks_to_swap") and family == "unet":
        unmapped.append(f"swap_blocks: {args.pop('blocks_to_swap')} (sd-scripts' SD and SDXL scripts swap no blocks)")
    if args.get("cpu_offload_checkpointing") and (family not in ("flux", "sd3") or args.get("blocks_to_swap")
                                                   or not args.get("gradient_checkpointing")):
        del args["cpu_offload_checkpointing"]
        unmapped.append("offload: [activations] (sd-scripts offloads FLUX's and SD3's checkpointed blocks' inputs, "
                        "with gradient_checkpointing and without blocks_to_swap)")
    if not args.get("sdpa") and family != "unet":
        unmapped.append("attention: math (sd-scripts runs SDPA for FLUX, SD3 and Lumina)")
    swap = args.get("blocks_to_swap")
    if swap and family == "flux":
        n = next((n for n in range(1, FLUX_MOST_SWAPPED + 1) if flux_swap(n) >= swap), None)
        if n is None:
            del args["blocks_to_swap"]
            unmapped.append(f"swap_blocks: {swap} (more than sd-scripts' {FLUX_MOST_SWAPPED} swaps of FLUX's "
                            f"{FLUX_DOUBLE + FLUX_SINGLE} blocks)")
        else:
            args["blocks_to_swap"] = n
            if flux_swap(n) != swap:
                notes.append(f"swap_blocks: {swap} is written as blocks_to_swap {n}, which swaps about the bytes of "
                             f"memfit's last {flux_swap(n)} blocks: a little more than planned (less device memory, "
                             "a little slower)")
    if args.get("fused_backward_pass") and (args.get("network_module") or args.get("optimizer_type") != "Adafactor"
                                            or args.get("gradient_accumulation_steps")):
        del args["fused_backward_pass"]
        unmapped.append("optimizer_in_backward: true (sd-scripts fuses it with Adafactor in full fine-tuning only)")


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x
