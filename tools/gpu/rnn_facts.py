"""What cuDNN's RNN kernels allocate on this GPU, over a grid of LSTM/GRU shapes: ground truth for
memfit.memory.cuda.rnn (its reserve and workspace model).

For each configuration (cell, dtype or autocast, input size, hidden, layers, steps, batch,
bidirectional, dropout, batch_first) one ``nn.LSTM``/``nn.GRU`` on the GPU runs forward and backward,
and this records:

- ``reserve``: bytes of the reserve ``_cudnn_rnn`` returns and autograd keeps for backward;
- ``fwd_allocs`` / ``bwd_allocs``: every allocation's size during forward / backward, in order,
  with ``f`` where it was freed before that pass ended (from the allocator's history);
- ``fwd_peak_over_after`` / ``bwd_peak_over_before``: peak allocated bytes over those at the end
  of forward / the start of backward;
- ``ops``: the ATen ops forward called (autocast tells which path the cell takes);
- ``persist_after_first_call``: bytes the first call leaves allocated (cuDNN's dropout state
  is made once per device and kept).

    python -m tools.gpu.rnn_facts --out rnn.json          # on a machine with a CUDA GPU
    python -m tools.gpu.rnn_facts --wide --out wide.json  # 216 unidirectional fp32 shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if not self.names or self.names[-1] != name:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def _events(snapshot: dict, start: int) -> list:
    """(action, size) of the allocator's device-0 trace from index ``start``."""
    trace = snapshot["device_traces"][0]
    return [(e["action"], e["size"]) for e in trace[start:] if e["action"] in ("alloc", "free_requested")]


def _allocs(events: list) -> list:
    """Allocation sizes in order, 'f' appended where freed later in the same window."""
    out, live = [], {}
    for action, size in events:
        if action == "alloc":
            live.setdefault(size, []).append(len(out))
            out.append([size, ""])
        elif live.get(size):
            out[live[size].pop()][1] = "f"
    return [f"{s}{f}" for s, f in out]


def measure(cell: str, dtype: str, i: int, h: int, layers: int, t: int, b: int, bidir: bool, dropout: float,
            batch_first: bool) -> dict:
    dev = torch.device("cuda")
    autocast = dtype.startswith("autocast-")
    param_dtype = torch.float32 if autocast else getattr(torch, dtype)
    cls = torch.nn.LSTM if cell == "LSTM" else torch.nn.GRU
    m = cls(i, h, layers, batch_first=batch_first, bidirectional=bidir, dropout=dropout).to(dev, param_dtype)
    x = torch.randn(*((b, t, i) if batch_first else (t, b, i)), device=dev, dtype=param_dtype, requires_grad=True)
    ctx = torch.autocast("cuda", dtype=getattr(torch, dtype.split("-")[1])) if autocast else torch.autocast(
        "cuda", enabled=False)
    torch.cuda.synchronize()
    pre = torch.cuda.memory_allocated()
    with ctx:
        y0, _ = m(x)  # first call: handles, plans, dropout state
    del y0, _
    torch.cuda.synchronize()
    persist = torch.cuda.memory_allocated() - pre
    torch.cuda.memory._record_memory_history(max_entries=200000)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    n0 = len(torch.cuda.memory._snapshot()["device_traces"][0])
    ops = _Ops()
    with ctx, ops:
        y, _ = m(x)
    torch.cuda.synchronize()
    after_fwd = torch.cuda.memory_allocated()
    fwd_peak = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    fwd_events = _events(snap, n0)
    n1 = len(snap["device_traces"][0])
    saved = {}
    node = y.grad_fn
    while node is not None and "Rnn" not in type(node).__name__ and node.next_functions:
        node = node.next_functions[0][0]
    if node is not None:
        for attr in dir(node):
            if attr.startswith("_saved_"):
                v = getattr(node, attr)
                if isinstance(v, torch.Tensor):
                    saved[attr[7:]] = [list(v.shape), str(v.dtype).replace("torch.", ""), v.numel() * v.element_size()]
    g = torch.ones_like(y)
    torch.cuda.synchronize()
    before_bwd = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y.backward(g)
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    bwd_events = _events(snap, n1)
    torch.cuda.memory._record_memory_history(enabled=None)
    row = {"cell": cell, "dtype": dtype, "input": i, "hidden": h, "layers": layers, "steps": t, "batch": b,
           "bidirectional": bidir, "dropout": dropout, "batch_first": batch_first,
           "node": type(node).__name__ if node is not None else None, "saved": saved,
           "reserve": saved.get("result3", [None, None, 0])[2],
           "fwd_new_bytes": after_fwd - base, "persist_after_first_call": persist, "fwd_peak_over_after": fwd_peak - after_fwd,
           "bwd_peak_over_before": bwd_peak - before_bwd, "output_bytes": y.numel() * y.element_size(),
           "fwd_allocs": _allocs(fwd_events)[:40], "bwd_allocs": _allocs(bwd_events)[:60], "ops": ops.names[:40]}
    del y, g, m, x
    torch.cuda.empty_cache()
    return row


def grid():
    for cell, dtype in itertools.product(("LSTM", "GRU"), ("float32", "float16", "autocast-bfloat16",
                                                            "autocast-float16")):
        for i, h, layers, t, b in ((512, 1024, 3, 256, 32), (128, 256, 1, 64, 8), (256, 512, 2, 128, 16),
                                   (512, 512, 1, 256, 32), (1024, 1024, 1, 64, 8), (64, 128, 4, 32, 4)):
            for bidir, dropout, bf in ((False, 0.0, True), (False, 0.1, True), (True, 0.0, False)):
                if layers == 1 and dropout:
                    continue
                yield cell, dtype, i, h, layers, t, b, bidir, dropout, bf


def wide_grid():
    """Unidirectional fp32 shapes around small and medium models (for fitting the workspace)."""
    for cell, h, layers, t, b, i in itertools.product(("LSTM", "GRU"), (128, 256, 512), (1, 2, 3), (32, 64, 128),
                                                       (8, 32), (128, 512)):
        yield cell, "float32", i, h, layers, t, b, False, 0.0, True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--wide", action="store_true", help="the wide fp32 grid instead of the default one")
    args = ap.parse_args(argv)
    rows = []
    from torch.backends import cudnn
    for cfg in (wide_grid() if args.wide else grid()):
        try:
            rows.append(measure(*cfg))
        except Exception as e:  # noqa: BLE001 - recorded; the grid goes on
            rows.append({"config": list(cfg), "error": f"{type(e).__name__}: {str(e)[:300]}"})
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": cudnn.version(),
                   "rows": rows}, f)
    print(f"{len(rows)} rows, {sum('error' in r for r in rows)} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
