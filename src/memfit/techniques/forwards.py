"""A module's forward, wrapped by a technique so that one compiled graph serves every copy of the model.

Techniques wrap a module's forward in place (checkpointing a block, MultiheadAttention without its
weights): ``m.forward = functools.partial(wrapper, <the forward it had>, ...)``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from torch import nn


# NOTE [ Wrapped forwards that torch.compile does not tie to one model ]
# Where the forward it had is a bound method (``m.forward`` of a module that has no instance-level
# forward yet), Dynamo meets a ``method`` object inside a compiled region (``compile: full`` traces
# through every block's wrapper) and guards on its identity: the compiled graph then serves that one
# model object. The planner traces a new copy of the model for every plan, so each of its traces
# recompiled the whole model (15-25 s for GPT-2 124M on 2 cores), even for plans whose graph is the
# same (another optimizer, in-backward stepping, offloaded states). As ``partial(type(m).forward, m)``
# the same call is the class's function (one object for every copy) and the module, which Dynamo
# guards by its type and attributes, not its identity (``tests/unit/test_compiled_reuse.py``). A list
# that a wrapper holds is guarded by identity too: checkpointing's recompute contexts become a tuple
# once every technique has applied (memfit.techniques.checkpointing).
def forward_of(module: nn.Module) -> Callable:
    """``module.forward`` as it is now, for a wrapper to call (NOTE [ Wrapped forwards that torch.compile
    does not tie to one model ]): a bound method becomes ``partial(function, module)``."""
    forward = module.forward
    if inspect.ismethod(forward) and forward.__self__ is module:
        return functools.partial(forward.__func__, module)
    return forward
