"""FSDP2's CPU offload (``shard_offload``) on a GPU preset, traced on the CPU's fake tensors.

FSDP2's ``CPUOffloadPolicy`` keeps each parameter's shard in host memory: before a unit's all-gather each shard
is copied to the device (``FSDPParam.all_gather_inputs``: ``.to(device)``), gathered, used and freed; after its
reduce-scatter each gradient shard is copied back to the host (``.to("cpu")``) and the device's freed; the
optimizer then steps on the host, its states there. Device memory drops by the shards, their gradients and the
states; it gains one unit's shard copies while it is gathered; the step waits for the copies.

A GPU preset is traced on fake CPU tensors (NOTE [ GPU presets without a GPU ], memfit.devices), where every
``.to(device)`` and ``.cpu()`` of FSDP2's is a no-op. So here the trace makes what those copies would
(:func:`emulate_offload`): the shards are booked on the host (the step's observer, once a step), each shard gathered
is copied first, each gradient shard is copied out and booked on the host, and the optimizer's states too.

Only an adapter's training is predicted so (a LoRA or QLoRA over a sharded base, axolotl's and accelerate's FSDP
recipes): the optimizer's step on the host then touches an adapter's few parameters. A full fine-tuning's step on
the host would allocate its temporaries in host memory, which the trace would book on the device; it is refused in
one line (:func:`check_emulated`).
"""

from __future__ import annotations

from memfit.errors import UserError


def emulated(parts) -> bool:
    """A GPU preset traced on CPU tensors: FSDP2's copies between host and device are no-ops there."""
    return parts.device.is_gpu and parts.device_type != "cuda"


def check_emulated(parts) -> None:
    """Refuse what the emulation does not predict (the module docstring): a full fine-tuning's step on the host."""
    if parts.plan is not None and parts.plan.config("adapter").is_default:
        raise UserError(f"plan: shard_offload on {parts.device.name} is predicted for an adapter's training only yet: "
                        "a full fine-tuning steps its optimizer on the host, whose temporaries a trace on the CPU's "
                        "tensors would count on the device; train an adapter, or leave shard_offload out")


def emulate_offload(parts) -> None:
    """Make, in a trace on CPU tensors, the copies FSDP2's CPU offload makes between host and device (the module
    docstring). Call after ``fully_shard``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

    class OffloadedShard(FSDPParam):
        @property
        def all_gather_inputs(self):
            inputs = super().all_gather_inputs
            if self.sharded_state == ShardedState.SHARDED:  # (the shard's copy to the device, ``.to(device)``)
                return [t.clone() for t in inputs]
            return inputs

    params = []
    for module in parts.model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None) if state is not None else None
        if group is not None:
            for fsdp_param in group.fsdp_params:
                fsdp_param.__class__ = OffloadedShard
                params.append(fsdp_param)
    placement, optimizers = parts.placement, []
    make = parts.make_optimizer

    def made(params_, factory):
        optimizers.append(make(params_, factory))
        return optimizers[-1]

    def shards_on_host(*_args) -> None:  # (the step's observer is set when a step runs: told once a step)
        placement.mark_host([p._sharded_param_data for p in params])

    def gradients_out(*_args) -> None:
        for p in params:
            grad = p.sharded_param.grad
            if grad is not None:
                host = grad.to_local().clone()  # (``.to("cpu")`` after the reduce-scatter; the device's shard freed)
                placement.mark_host(host)
                p.sharded_param.grad = p.to_sharded_dtensor(host)

    def states_on_host() -> None:
        placement.mark_host([v for opt in optimizers for state in opt.state.values() for v in state.values()
                             if hasattr(v, "untyped_storage")])

    parts.make_optimizer = made
    parts.model.register_forward_pre_hook(shards_on_host)
    parts.before_update.append(gradients_out)
    parts.after_update.append(states_on_host)
