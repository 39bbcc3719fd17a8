"""The physical bound of an offloaded step (issue 51), beside each row of bench/offload_gpu.py.

An offloaded step can be no faster than the largest of three terms: the device's compute (the same step
without the copies, measured), the bytes the step moves over the host link at the link's measured
bandwidth (pinned copies, each direction; memfit's recorded ops give the bytes), and the bytes the host
update reads and writes at the host's measured bandwidth for that update (torch's fused CPU AdamW for
offloaded optimizer states, an elementwise average for the EMA).
"""

from __future__ import annotations

import statistics
import time


def traffic(workload: str, batch_size: int, seq_len: int, plan: dict, preset: str) -> dict:
    """The bytes plan ``plan``'s step moves over the host link (each way) and reads and writes on the
    host, from the ops memfit records of its steady-state step (fake tensors: no GPU needed)."""
    from memfit.planner.ops import BACKWARD, D2H, FORWARD, FUSED_HOST, H2D, HOST
    from memfit.planner.timing import record_ops
    from memfit.plans import Plan
    from memfit.target import Target

    ops = record_ops(Target.resolve(workload, Plan(**plan), batch_size, preset, seq_len=seq_len))
    return {"h2d_bytes": sum(op.nbytes for op in ops if op.kind == H2D),
            "d2h_bytes": sum(op.nbytes for op in ops if op.kind == D2H),
            "d2h_forward_bytes": sum(op.nbytes for op in ops if op.kind == D2H and op.phase == FORWARD),
            "h2d_backward_bytes": sum(op.nbytes for op in ops if op.kind == H2D and op.phase == BACKWARD),
            "host_bytes": sum(op.host_bytes for op in ops if op.kind == HOST),
            "fused_host": any(op.kind == HOST and op.flags & FUSED_HOST for op in ops)}


def link_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> dict:
    """Pinned host <-> device copy bandwidth on this machine, bytes/s each way (median of ``repeats``)."""
    from tools.gpu.host_probe import copy_bandwidth
    return copy_bandwidth(nbytes, repeats)


UPDATE_BYTES = {"adamw": 16, "lerp": 12}
"""Bytes per fp32 element of the host update as memfit's recorded ops count them (``traffic``'s ``host_bytes``,
memfit.planner.opcost: every tensor an op reads, plus those it writes that it returns): torch's fused AdamW
reads the weight, its gradient and two moments (16; its in-place writes return nothing), the EMA's lerp reads
two and returns one (12). The bandwidth is measured with the same count, so that bytes / bandwidth is the
update's time (NOTE [ One count of host bytes ])."""

# NOTE [ Out in forward, back in backward ]
# A saved activation goes out while forward runs and comes back while backward runs, and the last one
# saved is the first one backward needs: it can start back only once everything sent before it is out
# (one copy stream each way, in order). So the two directions of an activation offload do not overlap:
# its link time is forward's bytes out plus backward's bytes back, not the larger of the two. GPT-2's
# full activation offload on the H200 (2026-12-04) moves 8.0 GiB each way: 157 ms a direction, 314 ms in
# all, and its step took 357 ms (1.14x; by the larger direction alone, 2.27x). Offloaded optimizer states
# send gradients out and parameters back in the same phase: their directions do overlap.

# NOTE [ One count of host bytes ]
# The bound's host term divides the step's host bytes, as memfit's ops count them, by a bandwidth measured
# here. Until 2026-12-04 this measured AdamW's bandwidth counting 28 bytes per element (four reads, three
# writes) against 16 in the ops: the host term came out 1.75x too small (the H200's llama4-offopt row: 151 ms
# where the update takes 265 ms, B / bound 2.44x where it is 1.39x). The count is now one
# (tests/unit/test_offload_bench.py holds the two together).


def host_update_bandwidth(elements: int = 64 << 20, fused: bool = True) -> float:
    """Bytes/s of the host update, its bytes counted as :data:`UPDATE_BYTES`: torch's fused CPU AdamW over
    ``elements`` fp32 parameters, or (``fused`` False) an elementwise lerp as the EMA's average."""
    import torch
    p = torch.zeros(elements, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    if fused:
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        opt.step()  # (states made)
        run, per = opt.step, UPDATE_BYTES["adamw"]
    else:
        avg = torch.zeros_like(p)
        run, per = (lambda: avg.lerp_(p.detach(), 0.001)), UPDATE_BYTES["lerp"]
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        runs.append(elements * per / (time.perf_counter() - t0))
    return statistics.median(runs)


def bound(row_traffic: dict, compute_seconds: float, link: dict, host_bw: float | None) -> dict:
    """The three terms (seconds) and the bound, their largest. The link's term is the larger direction's
    bytes at its bandwidth (the two run at once), or, where larger, what forward sends out and backward
    brings back, one after the other (NOTE [ Out in forward, back in backward ])."""
    round_trip = row_traffic.get("d2h_forward_bytes", 0) / link["d2h"] + row_traffic.get("h2d_backward_bytes", 0) / link["h2d"]
    terms = {"compute_s": compute_seconds,
             "link_s": max(row_traffic["h2d_bytes"] / link["h2d"], row_traffic["d2h_bytes"] / link["d2h"], round_trip),
             "host_s": row_traffic["host_bytes"] / host_bw if host_bw else 0.0}
    return {**terms, "bound_s": max(terms.values()), "link_bw": link, "host_bw": host_bw, **row_traffic}


