"""A paged optimizer's page migration alone, at several rooms on the card (issue 51; run on a lent GPU).

memfit prices a paged optimizer's states that the card has no room for as migrating every step, every
managed byte in and out, the two directions one after the other at the card's host link (NOTE [ Pages that
migrate ] in memfit.memory.managed). Two figures disagree with that: on an H200 under a ballast leaving 24 GiB,
torchtune's full recipe left about 0.50 s for the migration memfit put at 0.58 s; and torchtune's published
RTX 4090 rate for the same recipe leaves at most 0.93 s where memfit puts 1.29 s, even with its GEMMs at the
card's whole bf16 peak and nothing else in the step (bench/published_rows.py). This measures the migration
itself: bitsandbytes' ``PagedAdamW8bit`` over ``--params`` elements (64 bf16 matrices, their gradients set
once) steps under a ballast that leaves the states a given room, against ``AdamW8bit`` with the states on
the card (the same kernels, no paging); the difference is the migration. Each room is one JSON line with
memfit's prediction beside it (the preset's link, and the link measured here one way and both ways at once).
The rooms tell three models apart: every managed byte in and out in series (memfit's: 2M/link at half room
and at almost none), only the bytes the room lacks in series (M/link, then 2M/link), every byte with both
directions at once (M/link at both).

    python3 -m tools.gpu.migration_probe --out $OUT/migration.jsonl [--params 2e9] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

GiB = 1 << 30


def _step_seconds(opt, repeats: int) -> float:
    from tools.gpu.host_probe import median_seconds
    for _ in range(2):  # (the first step makes the states; the second settles the pages)
        opt.step()
    return median_seconds(opt.step, repeats)


def _params(count: float):
    import torch
    n = max(1, round(count / (4096 * 8192)))
    params = [torch.nn.Parameter(torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def measure(params, rooms: list[float], repeats: int, preset: str) -> list[dict]:
    """One row per room (bytes left to the managed states on the card), and the dense baseline."""
    import bitsandbytes as bnb
    import torch

    from memfit.devices import get_device
    from memfit.memory.managed import migration
    from tools.gpu.host_probe import link_bandwidth

    link = link_bandwidth()
    dense = bnb.optim.AdamW8bit(params, lr=1e-5)
    dense_s = _step_seconds(dense, repeats)
    managed = sum(s.numel() for st in dense.state.values() for k, s in st.items()  # (the states paged: uint8,
                  if k in ("state1", "state2") and isinstance(s, torch.Tensor))    # their block scales stay)
    del dense
    gc.collect()
    torch.cuda.empty_cache()
    rows = []
    preset_link = get_device(preset).host_link_bandwidth
    one_way = min(link["h2d_bytes_per_second"], link["d2h_bytes_per_second"])
    for room in rooms:
        free = torch.cuda.mem_get_info()[0]
        ballast = torch.empty(max(0, free - int(room) - GiB // 4), dtype=torch.uint8, device="cuda")  # (a step's own)
        paged = bnb.optim.PagedAdamW8bit(params, lr=1e-5)
        paged_s = _step_seconds(paged, repeats)
        left = torch.cuda.mem_get_info()[0]
        m = migration(managed, int(room), preset_link)
        rows.append({"managed_bytes": managed, "room_bytes": int(room), "free_after_bytes": left,
                     "dense_step_seconds": round(dense_s, 5), "paged_step_seconds": round(paged_s, 5),
                     "migration_seconds": round(paged_s - dense_s, 5),
                     "predicted_migration_seconds": round(m.seconds, 5), "preset": preset,
                     "predicted_at_measured_link": round(2 * m.in_bytes / one_way, 5) if m.in_bytes else 0.0,
                     "duplex_at_measured_link": round(m.in_bytes / one_way, 5) if m.in_bytes else 0.0,
                     "link": link})
        print(json.dumps(rows[-1]), flush=True)
        del paged, ballast
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, metavar="FILE.jsonl")
    ap.add_argument("--params", type=float, default=2e9, help="elements stepped (64 bf16 matrices of 4096 x 8192 a 2.1e9)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--preset", default="h200-141gb", help="the preset whose link memfit's prediction uses")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("migration_probe: no CUDA GPU here; run it on a lent GPU", file=sys.stderr)
        return 2
    params = _params(args.params)
    managed = 2 * sum(p.numel() for p in params)  # (two 8-bit states an element, before their block scales)
    rooms = [managed + 2 * GiB, managed / 2, GiB / 2]  # all on the card, half, almost none
    rows = measure(params, rooms, args.repeats, args.preset)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
