"""Activation offload with prefetch (memfit.techniques.offload.OffloadActivations): backward
fetches the next saved tensors ahead of its need, uses each only once its copy is done, and
drops every copy once the graph is gone."""

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
        device, host = self.saved[k]
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
