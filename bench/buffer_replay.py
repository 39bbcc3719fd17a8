"""The host memory of a meta build's buffer replay (NOTE [ Buffers of a meta build ]) against the eager build.

SD3.5's transformer (diffusers' ``SD3Transformer2DModel`` at SD3.5's sizes, ``pos_embed_max_size=384``: a
906 MB sin-cos position table computed in ``__init__``; 2 blocks, so that the table sets the peak) is built
eagerly on the host, then on the meta device under memfit's ``BuildRecord``, whose ``buffer_values`` replays
the table's computation on the host. Printed: the most bytes of host tensors alive at once in each (counted
by a dispatch mode that follows each storage until it is freed, not by memfit), the replay's seconds, and
whether the replayed table equals the eager one. Another checkout's figures come from the same script with
its ``src`` first on the path:

    .venv/bin/python -m bench.buffer_replay
    PYTHONPATH=/tmp/old/src .venv/bin/python -m bench.buffer_replay
"""

from __future__ import annotations

import time
import warnings
import weakref

warnings.simplefilter("ignore")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from memfit.techniques.loading import on_meta  # noqa: E402

SD35 = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=64, num_attention_heads=24,
            joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
            pos_embed_max_size=384)
MiB = 2 ** 20


class LiveBytes(TorchDispatchMode):
    """The most bytes of CPU tensors made under it alive at once (each storage counted until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def main() -> None:
    from diffusers import SD3Transformer2DModel
    with LiveBytes() as eager:
        real = SD3Transformer2DModel(**SD35)
    table = real.pos_embed.pos_embed
    print(f"SD3.5 transformer, 2 blocks, pos_embed_max_size 384: table {table.nbytes / MiB:.0f} MiB ({table.dtype})")
    print(f"eager build on the host: peak {eager.peak / MiB:.0f} MiB of live tensors (weights included)")
    with on_meta() as record:
        model = SD3Transformer2DModel(**SD35)
    t0 = time.perf_counter()
    with LiveBytes() as replay:
        values = record.buffer_values(model)
    seconds = time.perf_counter() - t0
    same = torch.equal(values["pos_embed.pos_embed"], table)
    print(f"replay of its buffers: peak {replay.peak / MiB:.0f} MiB of live tensors, {seconds:.1f} s; "
          f"the table equals the eager build's: {same}")


if __name__ == "__main__":
    main()
