"""``memfit plan --format kohya|ai-toolkit|axolotl|llamafactory|torchtune``: the chosen plan in a trainer's own config,
and the search kept to the plans that trainer runs (memfit.integrations.kohya_export,
memfit.integrations.ai_toolkit_export, memfit.integrations.axolotl_export, memfit.integrations.llamafactory_export,
memfit.integrations.torchtune_export)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from memfit.errors import UserError


@dataclass(frozen=True)
class Exported:
    """A chosen plan in a trainer's config: the text to paste, and what it cannot carry."""

    header: str
    text: str
    who: str
    """The trainer, as the lines that follow name it: ``sd-scripts' arguments``."""
    unmapped: tuple[str, ...]
    notes: tuple[str, ...]
    json: dict

    def print(self) -> None:
        print(self.header)
        print(self.text)
        for setting in self.unmapped:
            print(f"  not carried by {self.who}: {setting}")
        for note in self.notes:
            print(f"  in your setup: {note}")


class TrainerTarget:
    """The workload's model, image size and text encoders, as a trainer's config names them."""

    def __init__(self, workload, batch_size, device, spec: str | None = None, seq_len: int | None = None):
        """``spec``: the workload as the user named it (``dit-flux:text_encoders=frozen``)."""
        from memfit.target import Target
        target = Target.resolve(workload, None, batch_size, device, seq_len=seq_len)
        self.seq_len = target.workload.info.seq_len
        info = target.workload.info
        width = info.config.get("width") if info.config.get("fixed_width") else None
        self.size = (width, info.resolution) if width and width != info.resolution else info.resolution
        self.model, self.model_class = target.workload.name, info.config.get("model_class")
        self.spec = spec or (workload if isinstance(workload, str) else target.workload.name)
        self.config = info.config
        self.batch_size, self.device, self.workload = target.batch_size, device, target.workload
        self.bf16 = target.device.bf16

    def own_fields(self, fixed: dict) -> dict:
        """The plan fields the user fixed, and those the trainer always runs its own way."""
        return fixed

    def search_values(self) -> dict | None:
        """Values the trainer runs in place of a technique's own (None: the search's own)."""
        return None


class KohyaTarget(TrainerTarget):
    """``--format kohya``: the lines of a kohya-ss sd-scripts ``--config_file`` TOML."""

    @property
    def text(self) -> dict:
        return {k: self.config.get(k) for k in ("text_encoders", "t5", "t5_tokens", "t5_mask")}

    def runs_in(self, fixed: dict):
        """The plans sd-scripts' arguments carry (the search is kept to them); refuses a model it does not train."""
        from memfit.integrations.kohya_export import runs_in_sd_scripts
        return runs_in_sd_scripts(self.batch_size, self.model, self.size, self.device, self.model_class, fixed,
                                  **self.text)

    def export(self, result) -> Exported:
        from memfit.integrations.kohya_export import to_kohya
        out = to_kohya(result.chosen.plan, result.batch_size, self.model, self.size, self.device, self.model_class,
                       **self.text)
        return Exported("sd-scripts arguments (lines of its --config_file TOML):", out.toml(), "sd-scripts' arguments",
                        out.unmapped, out.notes, {"kohya_arguments": out.arguments, "kohya_unmapped": list(out.unmapped),
                                                  "kohya_notes": list(out.notes)})


class AiToolkitTarget(TrainerTarget):
    """``--format ai-toolkit``: an ai-toolkit job's YAML."""

    @property
    def facts(self) -> dict:
        return {**{k: self.config.get(k) for k in ("text_encoders", "t5", "frames", "cross_attention_dim",
                                                       "control_images", "control_px")},
                "blocks": self.blocks}

    @functools.cached_property
    def blocks(self) -> int | None:
        """The denoiser's blocks (behind its text encoders' stacks): what a swapped share is of."""
        from memfit.planner.space import model_facts
        from memfit.planner.stacks import tail_blocks
        return tail_blocks(model_facts(self.workload).model)

    def own_fields(self, fixed: dict) -> dict:
        """An ai-toolkit LoRA's precision is its own: the model in ``train.dtype``, the LoRA in fp32, no autocast (NOTE
        [ ai-toolkit's LoRA: no autocast ]), unless the user fixed one."""
        from memfit.integrations.ai_toolkit import PRECISIONS
        from memfit.planner.field_recipes import method_of
        if "precision" in fixed or method_of(fixed) == "full":
            return fixed
        return {**fixed, "precision": PRECISIONS["bf16" if self.bf16 else "fp16"]}  # (its train.dtype, read as --from does)

    def runs_in(self, fixed: dict):
        """The plans ai-toolkit's fields carry (the search is kept to them); refuses a model it does not train."""
        from memfit.integrations.ai_toolkit_export import runs_in_ai_toolkit
        return runs_in_ai_toolkit(self.batch_size, self.spec, self.model_class, self.size, self.device, self.facts,
                                  fixed)

    def export(self, result) -> Exported:
        from memfit.integrations.ai_toolkit_export import to_ai_toolkit
        out = to_ai_toolkit(result.chosen.plan, result.batch_size, self.spec, self.model_class, self.size, self.device,
                            self.facts)
        return Exported("ai-toolkit job (python run.py job.yaml):", out.yaml(), "ai-toolkit's fields", out.unmapped,
                        out.notes, {"ai_toolkit_process": out.process, "ai_toolkit_unmapped": list(out.unmapped),
                                    "ai_toolkit_notes": list(out.notes)})


class AxolotlTarget(TrainerTarget):
    """``--format axolotl``: the fields of an axolotl config (memfit.integrations.axolotl_export)."""

    who = "axolotl"
    """The trainer, as its users name it (``--format``'s value: lower case, no hyphen)."""

    def own_fields(self, fixed: dict) -> dict:
        """axolotl's precision, unless the user fixed one: ``bf16: true`` (``fp16`` on a card without bf16), the
        model loaded in 16 bits, and an adapter kept in fp32 over it by peft (``bf16-base``), as its --from reads."""
        from memfit.devices import get_device
        from memfit.integrations.axolotl import precision_fields
        from memfit.planner.field_recipes import method_of
        if "precision" in fixed:
            return fixed
        return {**fixed, **precision_fields({"bf16": "auto"}, get_device(self.device), method_of(fixed) != "full")}

    def search_values(self) -> dict | None:
        """A chunked loss in the slices Liger cuts for the model (axolotl's and LLaMA-Factory's only chunked loss),
        at the batch's tokens; none where the model's config cannot be read here."""
        from memfit.integrations.axolotl import liger_chunks
        chunks = liger_chunks(self.spec, self.batch_size * self.seq_len) if self.seq_len else None
        return {"loss_chunks": [0, chunks]} if chunks else None

    def runs_in(self, fixed: dict):
        """The plans axolotl's fields carry (the search is kept to them); refuses a model it does not train."""
        from memfit.integrations.axolotl_export import to_axolotl
        from memfit.integrations.export import carried_by
        self.check_trained()
        return carried_by(lambda plan: to_axolotl(self._exported(plan)[0], self.batch_size, self.spec, self.seq_len,
                                                   self.device), fixed)

    def check_trained(self) -> None:
        """One line for a model that is not a language model (no sequence length): the trainer does not train it."""
        if self.seq_len is None:
            raise UserError(f"--format {self.who.lower().replace('-', '')}: {self.who} trains language models, and "
                            f"{self.spec} is not one; "
                            "for a diffusion model use --format kohya or ai-toolkit, or leave --format out")

    def _exported(self, plan):
        from memfit.devices import get_device
        from memfit.target import as_exported
        return as_exported(plan, self.workload, get_device(self.device))

    def export(self, result) -> Exported:
        from memfit.integrations.axolotl_export import to_axolotl
        plan, said = self._exported(result.chosen.plan)
        out = to_axolotl(plan, result.batch_size, self.spec, self.seq_len, self.device)
        return Exported("axolotl config fields (beside its datasets and the rest of the run):", out.yaml(),
                        "axolotl's fields", out.unmapped, [*said, *out.notes],
                        {"axolotl_fields": out.fields, "axolotl_unmapped": list(out.unmapped),
                         "axolotl_notes": [*said, *out.notes]})


class LlamaFactoryTarget(AxolotlTarget):
    """``--format llamafactory``: the fields of a LLaMA-Factory config (memfit.integrations.llamafactory_export)."""

    who = "LLaMA-Factory"

    def own_fields(self, fixed: dict) -> dict:
        return fixed  # (bf16, fp16, pure_bf16 or none: the search chooses among the precisions its fields carry)

    def runs_in(self, fixed: dict):
        """The plans LLaMA-Factory's fields carry (the search is kept to them); refuses a model it does not train."""
        from memfit.integrations.export import carried_by
        from memfit.integrations.llamafactory_export import to_llamafactory
        self.check_trained()
        return carried_by(lambda plan: to_llamafactory(self._exported(plan)[0], self.batch_size, self.spec,
                                                       self.seq_len, self.device), fixed)

    def export(self, result) -> Exported:
        from memfit.integrations.llamafactory_export import to_llamafactory
        plan, said = self._exported(result.chosen.plan)
        out = to_llamafactory(plan, result.batch_size, self.spec, self.seq_len, self.device)
        return Exported("LLaMA-Factory config fields (llamafactory-cli train config.yaml, beside its dataset and the "
                        "rest of the run):", out.yaml(), "LLaMA-Factory's fields", out.unmapped, [*said, *out.notes],
                        {"llamafactory_fields": out.fields, "llamafactory_unmapped": list(out.unmapped),
                         "llamafactory_notes": [*said, *out.notes]})


class TorchtuneTarget(AxolotlTarget):
    """``--format torchtune``: the fields of a torchtune single-device recipe config
    (memfit.integrations.torchtune_export)."""

    who = "torchtune"

    def own_fields(self, fixed: dict) -> dict:
        """torchtune's dtype, unless the user fixed a precision: bf16 (every weight in it: ``bf16-pure``) where the
        card has it, else fp32."""
        if "precision" in fixed:
            return fixed
        return {**fixed, "precision": "bf16-pure" if self.bf16 else "fp32"}

    def search_values(self) -> dict | None:
        return None  # (its chunked loss takes any number of chunks: num_output_chunks)

    def runs_in(self, fixed: dict):
        """The plans torchtune's fields carry (the search is kept to them); refuses a model it does not train."""
        from memfit.integrations.export import carried_by
        from memfit.integrations.torchtune_export import to_torchtune
        self.check_trained()
        return carried_by(lambda plan: to_torchtune(plan, self.batch_size, self.seq_len), fixed)

    def export(self, result) -> Exported:
        from memfit.integrations.torchtune_export import to_torchtune
        out = to_torchtune(result.chosen.plan, result.batch_size, self.seq_len)
        return Exported("torchtune config fields (set in your recipe's config, or as tune run overrides key=value):",
                        out.yaml(), "torchtune's fields", out.unmapped, out.notes,
                        {"torchtune_fields": out.fields, "torchtune_unmapped": list(out.unmapped),
                         "torchtune_notes": list(out.notes)})


TARGETS = {"kohya": KohyaTarget, "ai-toolkit": AiToolkitTarget, "axolotl": AxolotlTarget,
           "llamafactory": LlamaFactoryTarget, "torchtune": TorchtuneTarget}
"""The trainers ``--format`` writes a config for."""
