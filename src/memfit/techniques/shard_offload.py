"""FSDP2's CPU offload (``shard_offload``) on a GPU preset, traced on the CPU's fake tensors.

FSDP2's ``CPUOffloadPolicy`` keeps each parameter's shard in host memory: before a unit's all-gather each shard
is copied to the device (``FSDPParam.all_gather_inputs``: ``.to(device)``), gathered, used and freed; after its
reduce-scatter each gradient shard is copied back to the host (``.to("cpu")``) and the device's freed; the
optimizer then steps on the host, its states there. Device memory drops by the shards, their gradients and the
states; it gains one unit's shard copies while it is gathered; the step waits for the copies.

A GPU preset is traced on fake CPU tensors (NOTE [ GPU presets without a GPU ], memfit.devices), where every
``.to(device)`` and ``.cpu()`` of FSDP2's is a no-op. So here the trace makes what those copies would
(:func:`emulate_offload`): the shards are booked on the host (the step's observer, once a step), each shard gathered
is copied first, each unit's gradient shards are copied out to the host after its reduce-scatter (the device's
freed there, as FSDP2 drops them), and the optimizer steps inside the observer's ``on_host`` block: its states and
its temporaries are the host's.
"""

from __future__ import annotations


def emulated(parts) -> bool:
    """A GPU preset traced on CPU tensors: FSDP2's copies between host and device are no-ops there."""
    return parts.device.is_gpu and parts.device_type != "cuda"


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

    params, groups = [], []
    for module in parts.model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None) if state is not None else None
        if group is not None:
            groups.append(group)
            for fsdp_param in group.fsdp_params:
                fsdp_param.__class__ = OffloadedShard
                params.append(fsdp_param)
    placement = parts.placement
    make = parts.make_optimizer

    def made(params_, factory):
        optimizer = make(params_, factory)
        step = optimizer.step

        def step_on_host(*args, **kwargs):
            with placement.on_host():
                return step(*args, **kwargs)
        optimizer.step = step_on_host
        return optimizer

    def shards_on_host(*_args) -> None:  # (the step's observer is set when a step runs: told once a step)
        placement.mark_host([p._sharded_param_data for p in params])

    for group in groups:
        group.post_backward = _then_gradients_out(group.post_backward, group.fsdp_params, placement)
    parts.make_optimizer = made
    parts.model.register_forward_pre_hook(shards_on_host)


def _then_gradients_out(post_backward, fsdp_params, placement):
    """A unit's ``post_backward`` (its reduce-scatter), then its gradient shards copied to the host (``.to("cpu")``):
    the device's, views of the reduce-scatter's output, are dropped and freed."""
    def post_backward_then_out(*args, **kwargs):
        out = post_backward(*args, **kwargs)
        for p in fsdp_params:
            grad = p.sharded_param.grad
            if grad is not None and not getattr(grad.to_local(), "_memfit_on_host", False):
                with placement.on_host():
                    host = grad.to_local().clone()
                host._memfit_on_host = True
                p.sharded_param.grad = p.to_sharded_dtensor(host)
        return out
    return post_backward_then_out
