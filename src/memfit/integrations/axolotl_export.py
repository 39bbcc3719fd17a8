"""A plan as the fields of an axolotl config: ``memfit plan ... --format axolotl`` prints the YAML fields that run
the plan memfit chose (the inverse of memfit.integrations.axolotl's table), what axolotl has no field for, and
what the user's own setup must hold.

Each field is the one :func:`memfit.integrations.axolotl.map_config` reads back into the same plan (a test holds
the round trip). What axolotl runs with none of its fields (an optimizer stepped in backward, optimizer states on
the host, selective checkpointing as memfit's, an EMA) is listed as plan keys; ``--format axolotl`` searches
only the plans it carries, unless the user fixed such a key (memfit.integrations.export.carried_by).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.devices import Device
from memfit.plans import Plan


@dataclass(frozen=True)
class AxolotlFields:
    """A plan's axolotl fields, and what they cannot carry."""

    fields: dict
    unmapped: tuple[str, ...]
    """Plan settings axolotl has no field for (as plan keys)."""
    notes: tuple[str, ...]
    """What the rest of the user's setup must hold."""

    def yaml(self) -> str:
        import yaml
        return yaml.safe_dump(self.fields, sort_keys=False, default_flow_style=False).rstrip()


def to_axolotl(plan: Plan, batch_size: int, model: str, seq_len: int | None,
               device: Device | str | None = None) -> AxolotlFields:
    """``plan`` at ``batch_size`` (global) for ``model`` (a hub id or folder) as axolotl's fields: each technique's
    own (``Config.export``'s ``axolotl``), then the model's: a chunked loss is axolotl's only as Liger's, in the
    slices Liger cuts for the model (memfit.integrations.axolotl.liger_chunks), and offloaded activations only
    beside checkpointed layers (axolotl offloads their inputs)."""
    from memfit.integrations.axolotl import liger_chunks
    from memfit.integrations.export import export
    into = export(plan, batch_size, device)
    fields = {"base_model": model, **({"sequence_len": seq_len} if seq_len else {}), **into.axolotl}
    unmapped, notes = list(into.axolotl_unmapped), list(into.axolotl_notes)
    chunks = fields.pop("loss_chunks", None)
    if chunks:
        ligers = liger_chunks(model, fields.get("micro_batch_size", batch_size) * seq_len) if seq_len else None
        if ligers == chunks:
            fields["liger_fused_linear_cross_entropy"] = True
            notes.append("plugins: [axolotl.integrations.liger.LigerPlugin] beside liger_fused_linear_cross_entropy")
        else:
            unmapped.append(f"loss_chunks: {chunks} (axolotl's chunked loss is Liger's, in "
                            + (f"{ligers} slices for this model)" if ligers else "slices sized by the model)"))
    if fields.get("activation_offloading") and not fields.get("gradient_checkpointing"):
        del fields["activation_offloading"]
        unmapped.append("offload: activations (axolotl offloads the inputs of checkpointed layers: with "
                        "gradient_checkpointing)")
    return AxolotlFields(fields, tuple(unmapped), tuple(notes))
