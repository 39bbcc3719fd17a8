"""Random ops recomputed in a compiled region's backward, run under memfit's dispatch modes.

Where a compiled region recomputes a random op in backward (dropout inside a checkpointed block of a
``compile: full`` graph), AOTAutograd wraps it so that forward and backward draw the same numbers:
forward runs PyTorch's higher-order op ``run_and_save_rng_state`` (the generator's state, then the
op) and saves the state; backward runs ``run_with_rng_state`` (the op from that state). Inductor
leaves both to PyTorch at run time, and a ``TorchDispatchMode`` sees a higher-order op only where it
registers a rule for it. These rules run the op itself under the mode (its output is a storage
like any other), with the generator's state taken and restored as PyTorch's own rules do; on fake
tensors (a prediction) the state is not replayed, since no number is drawn.
"""

from __future__ import annotations

import torch


def _device(args, kwargs) -> str:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


def _get_state(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _set_state(device: str, state: torch.Tensor) -> None:
    (torch.cuda.set_rng_state if device == "cuda" else torch.set_rng_state)(state)


def register(mode_type: type) -> None:
    """Give ``mode_type`` (a ``TorchDispatchMode``) rules for the two random-state higher-order ops."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    from torch._subclasses.fake_tensor import is_fake

    @run_and_save_rng_state.py_impl(mode_type)
    def save(mode, op, *args, **kwargs):
        state = _get_state(_device(args, kwargs))
        with mode:
            return state, op(*args, **kwargs)

    @run_with_rng_state.py_impl(mode_type)
    def replay(mode, rng_state, op, *args, **kwargs):
        device = _device(args, kwargs)
        with mode:
            if is_fake(rng_state) or any(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
                return op(*args, **kwargs)
            current = _get_state(device)
            _set_state(device, rng_state.cpu())
            try:
                return op(*args, **kwargs)
            finally:
                _set_state(device, current)
