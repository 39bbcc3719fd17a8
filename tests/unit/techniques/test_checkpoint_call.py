"""NOTE [ A checkpoint that raised ]: a checkpointed forward that raises leaves no saved-tensor hooks entered,
whether torch closes its generator itself (2.14) or leaves it suspended (2.11, simulated here)."""

import pytest
import torch

from memfit.techniques import checkpoint_call
from memfit.techniques.checkpoint_call import checkpoint


class Boom(RuntimeError):
    pass


def _raises(x):
    torch.sin(x)  # (an op of the block, saving its input)
    raise Boom("out of memory, as an OOM in a block would be")


def _saved_by(packed: list) -> int:
    """Saves a tensor for backward (a multiplication by itself); how many tensors ``packed``'s hook saw since."""
    before = len(packed)
    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()
    return len(packed) - before


def _torch_211_checkpoint(packed: list):
    """torch 2.11's non-reentrant ``checkpoint``, reduced to what matters here: its generator enters saved-tensor
    hooks, and a forward that raises leaves it suspended."""
    def _checkpoint_without_reentrant_generator():  # (torch's name: how memfit finds it)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            yield
        yield

    def leaking(function, *args, use_reentrant=False, **kwargs):
        gen = _checkpoint_without_reentrant_generator()
        next(gen)
        ret = function(*args, **kwargs)
        next(gen)
        return ret
    return leaking


def test_a_forward_that_raised_leaves_no_hooks_under_a_torch_that_leaves_its_generator(monkeypatch):
    packed = []
    monkeypatch.setattr(checkpoint_call, "_torch_checkpoint", _torch_211_checkpoint(packed))
    x = torch.ones(4, requires_grad=True)
    with pytest.raises(Boom):
        checkpoint(_raises, x, use_reentrant=False)
    assert _saved_by(packed) == 0  # (were its hooks still entered, they would save the product's inputs)
    with pytest.raises(Boom) as leaked:  # (torch 2.11's own call, unwrapped, leaves its hooks entered...)
        _torch_211_checkpoint(packed)(_raises, x)
    assert _saved_by(packed) == 2  # (x * x saves x twice)
    assert checkpoint_call.close_left_generators(leaked.value) == 1  # (...until its generator is closed)
    assert _saved_by(packed) == 0


def test_torchs_own_checkpoint_that_raised_has_nothing_left_to_close():
    x = torch.ones(4, requires_grad=True)
    with pytest.raises(Boom) as caught:
        checkpoint(_raises, x, use_reentrant=False)
    assert checkpoint_call.close_left_generators(caught.value) == 0
    y = checkpoint(lambda t: (t * t).sum(), x, use_reentrant=False)
    y.backward()
    assert torch.equal(x.grad, 2 * x.detach())


def test_selective_checkpointing_asks_torch_for_what_torchs_checkpoint_takes():
    """The hooks keyword is read off torch's checkpoint, not off memfit's wrapper (whose signature is
    ``*args, **kwargs``): read off the wrapper, selective checkpointing stopped passing it, silently."""
    import inspect

    from memfit.techniques.checkpoint_call import HOOKS_KWARGS
    takes = "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    assert HOOKS_KWARGS == ({"respect_saved_tensors_hooks": True} if takes else {})
