"""Optimizer-state offload: the optimizer steps on the host, overlapped with backward.

AdamW keeps 2N bytes of moments for N bytes of fp32 parameters, and the gradients add N more
until the update. Here the optimizer lives in host memory (as DeepSpeed's ZeRO-Offload and
torchao's ``CPUOffloadOptimizer`` do): a pinned host copy of each parameter (its master), its
moments and a pinned gradient buffer. The device keeps the parameters only:

- as backward accumulates each parameter's gradient (``register_post_accumulate_grad_hook``), the
  gradient is copied to its pinned host buffer on a side stream and freed on the device, so at
  most a few gradients exist there at a time (as with the optimizer step in backward);
- a worker thread waits for that copy and steps the parameter's optimizer on the host (torch's
  fused CPU AdamW/Adam where the workload uses plain AdamW/Adam) while backward goes on;
- the updated master goes back into the device parameter on another side stream; the step ends
  by making the compute stream wait for those copies, so the next forward sees the new weights.

The price is 2N bytes over the host link per step (gradients out, parameters in; half of what
fetching the states to the device and back moves), overlapped with backward, and the host CPU's
update (memory-bound on host DRAM). It saves the states (2N) and the gradients (N) on the device.

Clipping by the global norm and fp16 loss scaling need every gradient before any update: then
the gradients still go out as they are made, clipping and unscaling act on the host copies (the
optimizer's ``param_groups`` hold the host masters), and the updates start after backward.
With micro-batches, gradients accumulate on the device and go out in the last micro-batch's
backward (the step says which one it is: :meth:`OffloadOptimizerStates.backward_starts`).

The alternative, ``offload: [optimizer_states:step=device]`` (:class:`DeviceStepOffload`), keeps
the update on the device: after backward each parameter's states visit the device for its update
(fetched one parameter ahead on a side stream) and go back. It moves 2x the states over the link
(4N each way for AdamW, twice the host step's traffic) and keeps every gradient until the update,
but needs no host CPU time: on a host with little memory bandwidth per GPU it is the faster one.
The H100 recorded it at 1.78x a bf16 GPT-2 step and 3.82x on 4 Llama layers at 7B width.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable

import torch

from memfit.techniques.optimizer_variant import Factory
from memfit.techniques.optimizers import PerParameterOptimizers
from memfit.techniques.placement import HostPlacement, doing

# NOTE [ Gradients in flight ]
# A gradient freed while its copy to the host is still queued (``record_stream``) goes back to the
# caching allocator only once the copy is done, and backward on a large model makes gradients faster
# than the link drains them: the real step then held blocks that the replay of its trace had reused.
# On the H100 reserved came out 13% (4 Llama layers at 7B width), 4.4% (Llama-2-7B) and 9.9%
# (Llama-3-8B, under a 24 GiB cap) above the prediction. So each device gradient is kept until its
# copy is done, and at most :data:`IN_FLIGHT` copies are pending: sending one more first waits, on
# the CPU, for the oldest, and frees that gradient. The trace's copies are done at once, but it holds
# the same gradients just as long, so the step and its prediction free them at the same points: at
# most ``IN_FLIGHT`` gradients more than an immediate free, and no hidden ones. The wait holds up
# backward only where the link is slower than backward, where the step cannot end sooner anyway.
#
# The worker thread is used on real CUDA tensors only when nobody watches the step with a dispatch
# mode (memfit's tracker and budget guard see only their own thread); otherwise the same calls run
# at once, in order, on the calling thread. That synchronous path is what fake traces and CPU runs
# take; the threaded one is tested on the CPU against it bit for bit.
IN_FLIGHT = 4
"""Gradient copies to the host that may be pending at once (NOTE [ Gradients in flight ])."""


class OffloadOptimizerStates(PerParameterOptimizers):
    """One host optimizer per parameter, stepped as that parameter's gradient reaches the host.

    ``eager``: step each parameter from its gradient hook (no clipping or loss scaling needs all
    gradients first); otherwise :meth:`step` starts the updates. ``threaded``: None decides per
    step (see the module docstring); True/False force the worker thread or the calling thread.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], factory: Factory, placement: HostPlacement,
                 *, eager: bool, threaded: bool | None = None):
        super().__init__(params, factory)  # (built for the device parameters, so param groups follow the
        # workload's; each optimizer moves to its parameter's host master when that is made: _host)
        self.placement, self.eager, self.threaded = placement, eager, threaded
        self.masters: dict[torch.nn.Parameter, torch.Tensor] = {}
        """Device parameter -> its pinned host copy, whose ``.grad`` is the pinned gradient buffer."""
        self._last_backward = True
        self._sent: dict[torch.nn.Parameter, object] = {}
        """Parameters whose gradient went out this step -> the copy's event (None: done)."""
        self._in_flight: deque = deque()
        """(device gradient, its copy's event) kept until the copy is done (NOTE [ Gradients in flight ])."""
        self._jobs: list = []
        self._pool = None
        self._in = None  # CUDA: the side stream parameters come back on (they go out on the placement's)
        self._handles = [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in self.params]

    stages: dict[str, float] | None = None
    """Where the step's time goes, summed over steps, while set to a dict (bench/offload_gpu.py sets it;
    nothing is timed otherwise): ``update`` the host optimizers' steps and ``gradient_copies`` the waits for
    their gradients to reach the host (the worker's time), ``copies_back`` issuing the parameters' copies
    back, ``held_gradients`` backward waiting for a copy out before it frees a gradient (NOTE [ Gradients in
    flight ]), ``tail`` :meth:`step` waiting for the updates once backward is done, ``steps`` the count."""

    # -- the optimizer interface -----------------------------------------------------------------------
    @property
    def state(self) -> dict:
        return {h: opt.state[h] for p, opt in self.optimizers.items()
                if (h := self.masters.get(p)) is not None and h in opt.state}

    def backward_starts(self, index: int, count: int) -> None:
        """The step's micro-batch ``index`` of ``count`` starts its backward: gradients go out in
        the last one's."""
        self._last_backward = index == count - 1

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for p in self.params:  # a gradient the hook did not send (a parameter unused in the last micro-batch)
            if p.grad is not None and p not in self._sent:
                copied = self._send(p)
                if self.eager:
                    self._submit(p, copied)
        if not self.eager:
            self.wait_for_gradients()
            for p, copied in self._sent.items():
                self._submit(p, copied)
        self._sent = {}
        with self._timed("held_gradients"):
            self._land(0)
        with self._timed("tail"):
            self.join()
        if self.stages is not None:
            self.stages["steps"] = self.stages.get("steps", 0) + 1

    def wait_for_gradients(self) -> None:
        """Until every gradient sent this step is in its host buffer (before clipping or unscaling
        reads them there; the ``param_groups`` hold the host copies)."""
        for copied in self._sent.values():
            if copied is not None:
                copied.synchronize()
        self._land(0)

    def join(self) -> None:
        """Until every update submitted is done and its copy back is ordered before what the
        compute stream runs next."""
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()  # (an error in the worker is raised here)
        if self._in is not None:
            torch.cuda.current_stream(self._in.device).wait_stream(self._in)

    def state_dict(self) -> dict:
        self.join()
        return super().state_dict()

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load each parameter's states into its host optimizer (torch's loader casts them to the
        parameter's device: the host copy's). The masters are refreshed from the device
        parameters, which a resume has just loaded."""
        self.join()
        for p, sd in zip(self.params, state["per_param"]):
            h = self._host(p)
            h.copy_(p.detach())
            self.optimizers[p].load_state_dict(sd)
            self._mark_states(p)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()

    # -- the pipeline ------------------------------------------------------------------------------------
    def _gradient_ready(self, p: torch.nn.Parameter) -> None:
        if not self._last_backward:
            return  # (micro-batches: the gradient keeps accumulating on the device)
        with torch.no_grad():
            copied = self._send(p)
            if self.eager:
                self._submit(p, copied)

    def _send(self, p: torch.nn.Parameter):
        """Copy ``p``'s gradient into its host buffer (on the out-stream on CUDA) and free it on the
        device; returns the copy's event (None where the copy is done)."""
        h = self._host(p)
        h.grad, copied = self.placement.copy_out(p.grad, into=h.grad)  # (the pinned buffer: made once)
        if copied is not None and p.is_cuda and self._in is None:
            self._in = torch.cuda.Stream(device=p.device)
        self._in_flight.append((p.grad, copied))
        p.grad = None
        self._sent[p] = copied
        with self._timed("held_gradients"):
            self._land(IN_FLIGHT)
        return copied

    @contextlib.contextmanager
    def _timed(self, stage: str):
        """Add the block's seconds to ``stages[stage]`` (see :attr:`stages`)."""
        if self.stages is None:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages[stage] = self.stages.get(stage, 0.0) + time.perf_counter() - t0

    def _land(self, keep: int) -> None:
        """Free the oldest device gradients sent, once their copies are done, until ``keep`` are left
        pending (NOTE [ Gradients in flight ])."""
        while len(self._in_flight) > keep:
            grad, copied = self._in_flight.popleft()
            if copied is not None:
                copied.synchronize()
            del grad  # (its block may be reused now)

    def _submit(self, p: torch.nn.Parameter, copied) -> None:
        if self._threaded(p):
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-offload")
            self._jobs.append(self._pool.submit(self._update, p, copied))
        else:
            self._update(p, copied)

    @torch.no_grad()
    def _update(self, p: torch.nn.Parameter, copied) -> None:
        """Step ``p``'s host optimizer once its gradient is on the host, then copy the master back."""
        h = self.masters[p]
        with doing("host"):
            with self._timed("gradient_copies"):
                if copied is not None:
                    copied.synchronize()
            new = not self.optimizers[p].state.get(h)
            with self._timed("update"):
                self.optimizers[p].step()
            if new:
                self._mark_states(p)
            if self._in is not None:
                self._in.wait_event(copied)  # (the compute stream had finished with p when the gradient went out)
            with self._timed("copies_back"), torch.cuda.stream(self._in) if self._in is not None else contextlib.nullcontext():
                p.copy_(h, non_blocking=True)

    def _mark_states(self, p: torch.nn.Parameter) -> None:
        """``p``'s optimizer states are host memory (the observer counts them there)."""
        self.placement.mark_host([v for v in self.optimizers[p].state[self.masters[p]].values() if torch.is_tensor(v)])

    def _threaded(self, p: torch.nn.Parameter) -> bool:
        if self.threaded is not None:
            return self.threaded
        # (on a CPU the host is the device: a thread overlaps nothing there, and CPU memory
        # profilers miss what it allocates)
        from torch._subclasses.fake_tensor import is_fake
        return p.is_cuda and not is_fake(p) and not getattr(self.placement.observer, "thread_local", False)

    def _host(self, p: torch.nn.Parameter) -> torch.Tensor:
        """``p``'s host master, made (pinned) on first use, with its optimizer moved onto it."""
        h = self.masters.get(p)
        if h is None:
            h = self.masters[p] = self.placement.to_host(p.detach())
            self.optimizers[p] = _on_host(self.optimizers[p], p, h)
            self.param_groups = [g for opt in self.optimizers.values() for g in opt.param_groups]
        return h


FUSED_ON_HOST = (torch.optim.AdamW, torch.optim.Adam)
"""torch's optimizers with a fused CPU kernel (one pass over memory instead of one per op: about 10x
faster on the host). Used where the workload's optimizer is one of them with foreach/fused unset."""


def _on_host(opt: torch.optim.Optimizer, p: torch.Tensor, h: torch.Tensor) -> torch.optim.Optimizer:
    """``opt`` (built for the device parameter ``p``, no state yet) stepping the host copy ``h``.

    Tensor hyperparameters follow the copy: torchao's optimizers make ``lr`` a tensor on the
    default device when a group is added, a CUDA scalar that a host update cannot multiply by a
    host tensor (seen on an H100; on fake tensors and on a CPU the two devices are the same)."""
    for group in opt.param_groups:
        group["params"] = [h if q is p else q for q in group["params"]]
        for key, value in group.items():
            if isinstance(value, torch.Tensor) and value.device != h.device:
                group[key] = value.to(h.device)
    plain = type(opt) in FUSED_ON_HOST and opt.defaults.get("fused") is None and \
        opt.defaults.get("foreach") is None and not opt.defaults.get("differentiable")
    if plain and h.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return type(opt)([{**g, "fused": True} for g in opt.param_groups], fused=True)
    return opt


class DeviceStepOffload(PerParameterOptimizers):
    """One optimizer per parameter, stepped on the device after backward; its states live on the
    host between updates and visit the device one parameter (and the next, prefetched) at a time."""

    def __init__(self, params: Iterable[torch.nn.Parameter], factory: Factory, placement: HostPlacement):
        super().__init__(params, factory)
        self.placement = placement
        self._copy_stream = None

    def _fetch(self, p: torch.nn.Parameter) -> dict:
        """The parameter's states, on the device."""
        state = self.optimizers[p].state.get(p, {})
        if p.device.type == "cuda" and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=p.device)
        ctx = torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else contextlib.nullcontext()
        with ctx:
            return {k: self.placement.to_device(v, p.device) if torch.is_tensor(v) and v.dim() > 0 else v
                    for k, v in state.items()}

    def load_state_dict(self, state: dict) -> None:
        """Load one parameter's states at a time and put them back on the host (torch's loader
        casts them to the parameter's device; all at once, that is the memory offload avoids)."""
        for (p, opt), sd in zip(self.optimizers.items(), state["per_param"]):
            opt.load_state_dict(sd)
            opt.state[p] = {k: self.placement.to_host(v) if torch.is_tensor(v) and v.dim() > 0 else v
                            for k, v in opt.state[p].items()}

    @torch.no_grad()
    def step(self, closure=None) -> None:
        todo = [p for p in self.params if p.grad is not None]
        fetched = self._fetch(todo[0]) if todo else None
        for i, p in enumerate(todo):
            opt = self.optimizers[p]
            if self._copy_stream is not None:
                torch.cuda.current_stream(p.device).wait_stream(self._copy_stream)
            if fetched:
                opt.state[p] = fetched
            nxt = self._fetch(todo[i + 1]) if i + 1 < len(todo) else None  # overlaps this update on CUDA
            opt.step()
            opt.state[p] = {k: self.placement.to_host(v) if torch.is_tensor(v) and v.dim() > 0 else v
                            for k, v in opt.state[p].items()}
            fetched = nxt
        if self._copy_stream is not None:
            torch.cuda.current_stream().synchronize()  # host copies complete before they are read
