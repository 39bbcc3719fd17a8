"""An axolotl config's FSDP fields as memfit's FSDP2 plan (memfit.techniques.sharding).

| axolotl | memfit |
|---|---|
| ``fsdp: [full_shard, auto_wrap]`` or ``fsdp_config:`` (any ``fsdp_version``) | ``shard: fsdp``, one rank of ``--world-size N`` (the launcher's ranks are not in the config) |
| ``sharding_strategy`` ``FULL_SHARD`` (or ``fsdp: [full_shard]``) / ``SHARD_GRAD_OP`` | ``reshard_after_forward: true`` / ``false`` |
| ``reshard_after_forward`` (FSDP2's own, ``fsdp_version: 2``) | ``reshard_after_forward`` |
| ``offload_params: true`` (or ``fsdp: [..., offload]``) | ``shard_offload: true`` (parameters, gradients and the update on the host) |
| ``activation_checkpointing: true`` | ``checkpointing: blocks`` |

Each key is read with or without axolotl's older ``fsdp_`` prefix. FSDP1 (``fsdp_version`` 1, axolotl's default) is
predicted as FSDP2 over the same units, the decoder layers (its flat parameters hold the same bytes a unit, gathered
and freed alike), said in a warning; so is a ``transformer_layer_cls_to_wrap`` that is not the model's repeated
block (Mixtral's ``MixtralSparseMoeBlock``: memfit shards each decoder layer). ``HYBRID_SHARD`` and ``NO_SHARD`` are
refused in one line. The keys of loading, saving and wrapping (``cpu_ram_efficient_loading``,
``sync_module_states``, ``use_orig_params``, ``limit_all_gathers``, ``state_dict_type``, ``auto_wrap_policy``,
the prefetch flags) change no bytes memfit counts at the step's peak and are read in silence.
"""

from __future__ import annotations

from memfit.errors import UserError

STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
"""FSDP1's sharding strategies memfit's FSDP2 reproduces, and their ``reshard_after_forward``."""
LAUNCHER_RANKS = ("the ranks come from the launcher (accelerate, torchrun), not the config; give --world-size N to "
                  "predict one of N ranks")


def is_sharded(data: dict) -> bool:
    """The config trains with FSDP (``fsdp`` or ``fsdp_config`` set)."""
    return bool(data.get("fsdp")) or bool(data.get("fsdp_config"))


def fsdp_fields(data: dict, where: str) -> tuple[dict, list[str]]:
    """The plan fields of the config's FSDP keys (see the module docstring), and the warnings to give."""
    config = data.get("fsdp_config") or {}
    if not isinstance(config, dict):
        raise UserError(f"--from {where}: fsdp_config must be a mapping of FSDP options, got {type(config).__name__}")
    listed = data.get("fsdp") or []
    listed = [str(x).lower() for x in (listed.split() if isinstance(listed, str) else listed)] \
        if isinstance(listed, (str, list)) else []

    def get(name: str):
        return config.get(name, config.get(f"fsdp_{name}"))

    version = data.get("fsdp_version", get("version")) or 1
    strategy = str(get("sharding_strategy") or ("SHARD_GRAD_OP" if "shard_grad_op" in listed else "FULL_SHARD"))
    strategy = strategy.upper().split(".")[-1]  # (ShardingStrategy.FULL_SHARD, or a number's name)
    if strategy not in STRATEGIES:
        raise UserError(f"--from {where}: fsdp sharding_strategy {strategy} is not one memfit predicts (it shards "
                        "every rank's parameters over all ranks: FULL_SHARD, or SHARD_GRAD_OP); use one of them")
    reshard = get("reshard_after_forward")
    fields = {"shard": "fsdp", "reshard_after_forward": STRATEGIES[strategy] if reshard is None else bool(reshard),
              "shard_offload": bool(get("offload_params")) or "offload" in listed}
    if get("activation_checkpointing"):
        fields["checkpointing"] = "blocks"
    warnings = []
    if str(version) != "2":
        warnings.append(f"axolotl config {where}: FSDP1 (fsdp_version {version}) predicted as FSDP2 over the same "
                        "units, each decoder layer (set fsdp_version: 2 to train what memfit predicts)")
    wrap = get("transformer_layer_cls_to_wrap")
    if wrap and not str(wrap).endswith("DecoderLayer"):
        warnings.append(f"axolotl config {where}: fsdp transformer_layer_cls_to_wrap {wrap}: memfit shards each "
                        "repeated block (decoder layer) instead")
    return fields, warnings
