"""torch's ``checkpoint``, as memfit's techniques call it: one that leaves nothing behind when the
checkpointed forward raises (the non-reentrant one's generator).

A checkpoint costs nothing in memory or time beyond torch's own; this module only makes a failed call
clean up. memfit calls checkpoint for blocks (memfit.techniques.checkpointing), attention chunks
(memfit.techniques.attention) and loss slices (memfit.techniques.chunked_loss).
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

_GENERATOR = "_checkpoint_without_reentrant_generator"


# NOTE [ Checkpoints under saved-tensor hooks ]: hooks held around forward (offload: activations)
# see what a checkpoint keeps for backward and nothing else. Non-reentrant checkpoint saves the
# block's positional inputs through them before it enters its own hooks; the tensors saved inside
# the block go to those innermost hooks (and are dropped); where checkpoint takes
# ``respect_saved_tensors_hooks`` (torch 2.14 does) what a selective policy keeps goes through the
# outer hooks too (older torch keeps it on the device, out of them). The recomputation in backward
# runs under checkpoint's hooks, outside forward's: nothing it saves passes through them
# (tests/unit/techniques/test_offload_blocks.py counts it).
HOOKS_KWARGS = {"respect_saved_tensors_hooks": True} \
    if "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters else {}


# NOTE [ A checkpoint that raised ]
# Non-reentrant checkpoint runs its set-up and tear-down in a generator: the first ``next`` enters its
# saved-tensor hooks (what forward saves inside the block is dropped, and recomputed in backward), the
# second leaves them. torch 2.14 throws a forward's exception into that generator, which leaves them
# then. torch 2.11 (the GPU machine's) does not: the generator stays suspended, its hooks stay entered,
# and they stay until the exception's traceback, which holds the generator, is gone. Meanwhile the
# contexts around the call leave in the wrong order, and every later forward in the process saves
# through the dead checkpoint's hooks, whose backward recomputes the dead block. Seen under torch 2.11
# as a plan whose compiled block could not be captured: every later plan in the process then raised
# that block's error from its own backward (the search's fallback without compile among them). The
# same holds for an out-of-memory error raised in a checkpointed block, which memfit's OOM adaptation
# catches and retries. So a call that raises closes the generator it left, here, before the contexts
# around it leave; where torch already ran it to its end, there is nothing to close.
def checkpoint(function, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, **kwargs)``, which leaves no saved-tensor hooks
    entered when ``function`` raises (NOTE [ A checkpoint that raised ])."""
    if torch.compiler.is_compiling():  # (Dynamo captures torch's checkpoint itself: no generator runs)
        return _torch_checkpoint(function, *args, **kwargs)
    try:
        return _torch_checkpoint(function, *args, **kwargs)
    except BaseException as e:
        close_left_generators(e)
        raise


def close_left_generators(error: BaseException) -> int:
    """Close each checkpoint generator that ``error``'s traceback holds suspended (what torch 2.11 leaves
    after a forward that raised); the number closed."""
    closed = 0
    tb = error.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if getattr(getattr(value, "gi_code", None), "co_name", None) == _GENERATOR and \
                    value.gi_frame is not None and not value.gi_running:
                value.close()
                closed += 1
        tb = tb.tb_next
    return closed
