"""Activation offload with prefetch (memfit.techniques.offload.OffloadActivations): forward copies
each saved tensor out on a side stream and keeps at most STASH in flight; backward fetches the next
saved tensors ahead of its need, copies none back before its copy out is done, uses each only once
its copy back is done, and drops every copy once the graph is gone."""

import torch

from helpers import GPT2_DROPOUT, assert_same_training, run_steps
from memfit.plans import Plan
from memfit.techniques import offload

PLAN = Plan(offload=["activations"])


class _SlowCopy:
    """An asynchronous copy as on a GPU: the tensor holds garbage until ``wait()``."""

    def __init__(self, t, host):
        self.t, self.host, self.waited = t, host, False

    def wait(self):
        self.t.copy_(self.host)
        self.waited = True


def test_prefetched_tensors_are_used_only_after_their_copy(monkeypatch):
    """A prefetch handed out before its copy finished would be NaN: the training would differ."""
    copies, real_fetch = [], offload.OffloadActivations._fetch

    def slow_fetch(self, k, *, ahead):
        if not ahead:
            return real_fetch(self, k, ahead=ahead)
        device, host, _ = self.saved[k]
        t = torch.full_like(host, float("nan")) if host.is_floating_point() else torch.zeros_like(host)
        copies.append(_SlowCopy(t, host))
        return t, copies[-1]

    reference = run_steps(GPT2_DROPOUT, Plan(), steps=2)
    monkeypatch.setattr(offload.OffloadActivations, "_fetch", slow_fetch)
    assert_same_training(reference, run_steps(GPT2_DROPOUT, PLAN, steps=2))
    assert copies and all(c.waited for c in copies)


def test_backward_prefetches_and_nothing_stays_behind(monkeypatch):
    made = []
    real_init = offload.OffloadActivations.__init__

    def spy_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    kinds = []
    real_fetch = offload.OffloadActivations._fetch

    def spy_fetch(self, k, *, ahead):
        kinds.append(ahead)
        return real_fetch(self, k, ahead=ahead)

    monkeypatch.setattr(offload.OffloadActivations, "__init__", spy_init)
    monkeypatch.setattr(offload.OffloadActivations, "_fetch", spy_fetch)
    run_steps(GPT2_DROPOUT, PLAN, steps=2)
    (hooks,) = made
    assert hooks._next > 0 and kinds.count(True) > kinds.count(False)  # most were fetched ahead
    assert hooks.saved == {} and hooks.fetched == {} and not hooks.unpacked  # all freed with the graph


class _SlowCopyOut:
    """A copy to the host as on a GPU: the host copy holds garbage until ``wait()``."""

    def __init__(self, host):
        self.host, self.values, self.waited = host, host.clone(), False
        host.fill_(float("nan")) if host.is_floating_point() else host.zero_()

    def wait(self, stream=None):
        if not self.waited:  # (as an event: waiting again changes nothing)
            self.host.copy_(self.values)
        self.waited = True


def test_nothing_is_copied_back_before_its_copy_out_is_done_and_few_are_in_flight(monkeypatch):
    """A copy back reading the host copy before the copy out finished would see NaN: the training
    would differ. Forward keeps at most STASH device tensors waiting for their copies."""
    outs, in_flight, real_send = [], [], offload.OffloadActivations._send

    def slow_send(self, t):
        host, _ = real_send(self, t)
        outs.append(_SlowCopyOut(host))
        t_, _ = self.sending.pop()
        self.sending.append((t_, outs[-1]))
        in_flight.append(len(self.sending))
        return host, outs[-1]

    reference = run_steps(GPT2_DROPOUT, Plan(), steps=2)
    monkeypatch.setattr(offload.OffloadActivations, "_send", slow_send)
    assert_same_training(reference, run_steps(GPT2_DROPOUT, PLAN, steps=2))
    assert outs and all(o.waited for o in outs)
    assert max(in_flight) == offload.STASH


def test_a_tensor_saved_twice_goes_to_the_host_once():
    """log_softmax saves its output and nll_loss saves it again: one host copy serves both, both
    unpack it, and it goes when the graph does (the logits of an LM: half the host bytes of the
    tests' GPT-2 with block checkpointing)."""
    from memfit.techniques.placement import HostPlacement
    model = torch.nn.Linear(1, 1)  # (alive: its parameters' storages are told apart by address)
    hooks = offload.OffloadActivations(model, HostPlacement(), min_bytes=64)
    x = torch.randn(8, 16, requires_grad=True)
    labels = torch.arange(8)
    with hooks():
        y = torch.log_softmax(x * 2, dim=-1)
        loss = torch.nn.functional.nll_loss(y, labels)
    assert len(hooks.saved) == 2 and sorted(hooks._uses.values()) == [1, 2]  # y (saved twice, copied once), labels
    loss.backward()
    expected = torch.autograd.grad(torch.nn.functional.nll_loss(torch.log_softmax(x * 2, dim=-1), labels), x)[0]
    assert torch.equal(x.grad, expected)
    del y, loss
    assert hooks.saved == {} and hooks._uses == {}


def test_a_tensor_fetched_ahead_and_never_used_is_waited_for_before_it_is_dropped():
    """The copy back writes into a block of the compute stream's pool with no record_stream (the
    trace's replay reuses a freed block at once, and so must the caching allocator): a prefetched
    tensor dropped unused must first make the compute stream wait for its copy."""
    model = torch.nn.Linear(4, 4)  # (alive: its parameters' storages are never offloaded)
    hooks = offload.OffloadActivations(model, offload.HostPlacement(), min_bytes=0)
    packed = hooks._pack(torch.randn(16, 16))  # (what autograd keeps; dropping it forgets the tensor)
    k = packed.number
    host = hooks.saved[k][1]
    copy = _SlowCopy(torch.empty_like(host), host)
    hooks.fetched[k] = (copy.t, copy)
    del packed
    assert copy.waited and k not in hooks.fetched
