"""One rank's peak under FSDP2 on this CPU: measured on real gloo ranks, next to the prediction.

    .venv/bin/python -m bench.sharding_cpu [--world 2] [--repeats 3]

For each model and plan, ``world`` real processes (gloo on localhost) run memfit's sharded TrainStep; rank
0's second step is measured by the profiler's allocator events (independent of memfit's tracker)
and tracked by memfit's tracker on the real tensors; the prediction is one process against PyTorch's
fake process group (``memfit estimate --world-size``). The measured peak also holds gloo's own
scratch (NOTE [ gloo's collective scratch ], booked by rule in the prediction; the tracker does not
see it), and the frees gloo's worker threads make are put back (NOTE [ Frees the profiler does not
see ]).
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp

SMALL = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=32"
WIDER = "gpt2:n_layer=4,n_embd=256,n_head=4,vocab_size=2000,n_positions=64"
CASES = ((SMALL, {}), (SMALL, {"optimizer_in_backward": True}), (SMALL, {"compile": "blocks"}),
         (SMALL, {"micro_batch_size": 1}), (WIDER, {"micro_batch_size": 1}),
         (WIDER, {}), (WIDER, {"checkpointing": "blocks"}), (WIDER, {"optimizer_in_backward": True}),
         (WIDER, {"reshard_after_forward": False}), (WIDER, {"loss_chunks": 4}))
BATCH, SEQ = 8, 32


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, spec: str, fields: dict, out: str) -> None:
    import torch.distributed as dist

    from memfit.memory.measure import measured_cpu_run
    from memfit.memory.report import report_for
    from memfit.plans import Plan
    from memfit.target import Target

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        target = Target.resolve(spec, Plan(world_size=world, **fields), BATCH, "cpu", seq_len=SEQ)
        run, peak, _ = measured_cpu_run(target)
        if rank == 0:
            with open(out, "w") as f:
                f.write(f"{peak} {report_for(run.tracker, target, 'real').peak_bytes}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from memfit.memory.estimate import estimate
    from memfit.plans import Plan
    print("| model | plan | predicted (fake group) | tracked on the real rank | measured (profiler), each run | error |")
    print("|---|---|---|---|---|---|")
    for spec, fields in CASES:
        plan = Plan(world_size=args.world, **fields)
        predicted = estimate(spec, plan, batch_size=BATCH, device="cpu", seq_len=SEQ).peak_bytes
        measured, tracked = [], set()
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "rank0")
                mp.start_processes(_rank, args=(args.world, _port(), spec, fields, out), nprocs=args.world,
                                   start_method="spawn")
                peak, t = map(int, open(out).read().split())
            measured.append(peak)
            tracked.add(t)
        errors = ", ".join(f"{100 * (predicted - m) / m:+.2f}%" for m in measured)
        shown = " ".join(f"{k}={v}" for k, v in fields.items()) or "defaults"
        print(f"| {spec.split(',n_head')[0]} | {shown} | {predicted:,} | {', '.join(f'{t:,}' for t in sorted(tracked))} | "
              f"{', '.join(f'{m:,}' for m in measured)} | {errors} |")


if __name__ == "__main__":
    main()
