"""A plan's shallow pair carried to full depth, against its full trace (memfit.memory.deep_stream).

For each plan: the two shallow traces the planner's workers run (memfit.planner.trace_job.Tracer), their
allocations at full depth replayed through the caching-allocator model, and the full-depth trace. Prints
each plan's allocated peak and reserved bytes both ways and their difference (0.0 MiB: to the byte), or
"no stream" where the pair does not line up (the planner then traces the full depth, as here).

    python -m bench.deep_stream_check llama --swap 8,16,24
    HF_HOME=<a cache holding the config> HF_HUB_OFFLINE=1 python -m bench.deep_stream_check google/gemma-2-9b --swap 14,21,28
    python -m bench.deep_stream_check dit-flux --swap 19,38 --plans n --resolution 1024 -b 1

``--plans``: b (LoRA r=16, bf16-pure, blocks checkpointed; with ``--fp8``, fp8 base weights), s (selective, 8
loss chunks), e (every second block checkpointed, 8 loss chunks), n (no checkpointing). On GPU presets only: the traces are of that preset, on fake tensors.
"""

from __future__ import annotations

import argparse
import time

from memfit.memory.budget import Budget
from memfit.memory.categories import STEADY_STEP
from memfit.memory.deep_stream import deepen, replay
from memfit.planner.shallow import depths, extrapolate, extrapolate_ops
from memfit.planner.space import model_facts
from memfit.planner.stacks import stacks_of
from memfit.planner.timing import time_from_ops
from memfit.planner.trace_job import Tracer
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target


def plans(counts: list[int], which: str, fp8: bool, micro: int | None = None) -> list[Plan]:
    base = {"adapter": "lora:r=16", "precision": "bf16-pure", **({"base_weights": "fp8"} if fp8 else {}),
            **({"micro_batch_size": micro} if micro else {})}
    kinds = {"b": {"checkpointing": "blocks"}, "s": {"checkpointing": "selective", "loss_chunks": 8}, "n": {},
             "e": {"checkpointing": "blocks:every=2", "loss_chunks": 8}}
    return [Plan(**base, **kinds[k], swap_blocks=n) for n in counts for k in which]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--swap", default="0", help="comma-separated swap_blocks counts")
    parser.add_argument("--plans", default="bsn", help="of b, s, n (see the module docstring)")
    parser.add_argument("--fp8", action="store_true", help="fp8 base weights")
    parser.add_argument("--device", default="rtx4090")
    parser.add_argument("-b", "--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--resolution", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="split the batch (the pair skips the repeated micro-batches: NOTE [ Repeated "
                             "micro-batches, traced once ] in memfit.step)")
    args = parser.parse_args()
    todo = plans([int(x) for x in args.swap.split(",")], args.plans, args.fp8, args.micro_batch_size)
    sizes = {"resolution": args.resolution} if args.resolution else {"seq_len": args.seq_len}
    with silenced_warnings():
        target = Target.resolve(args.model, todo[0], args.batch_size, args.device, **sizes)
        facts = model_facts(target.workload)
        stacks = stacks_of(facts.model)
        full = stacks.full
        tracer = Tracer(target, facts.model, Budget.resolve(None, target.device))
        for plan in todo:
            pair = depths(plan, full, stacks.least, stacks.unit)
            if pair is None:
                print(f"{plan.short():60s} traced at full depth (no shallow pair)", flush=True)
                continue
            t0 = time.time()
            a, b = (tracer((plan, d, None)) for d in pair)
            deep = deepen(a.stream, b.stream, *pair, full) if a.stream and b.stream else None
            got = replay(deep, STEADY_STEP) if deep is not None else None
            t1 = time.time()
            f = tracer((plan, None, None))
            want = (f.peak_bytes, f.used_bytes - f.context_bytes)
            t2 = time.time()
            shown = "no stream" if got is None else \
                f"{got[0] / 2**30:.3f}/{got[1] / 2**30:.3f} GiB, diff {(got[0] - want[0]) / 2**20:+.1f}/{(got[1] - want[1]) / 2**20:+.1f} MiB"
            on = target.with_plan(plan)
            ops = extrapolate_ops(a.ops, b.ops, *pair, full)  # (else the line through the pair's times, as the book)
            pair_s = time_from_ops(ops, on).seconds if ops is not None else \
                extrapolate(*(time_from_ops(t.ops, on).seconds for t in (a, b)), *pair, full)
            full_s = time_from_ops(f.ops, on).seconds
            print(f"{plan.short():60s} pair {pair}: {shown}; full trace {want[0] / 2**30:.3f}/{want[1] / 2**30:.3f} GiB; "
                  f"time {pair_s * 1e3:.1f} ms against {full_s * 1e3:.1f} ms ({(pair_s / full_s - 1) * 100:+.2f}%"
                  f"{', ops extrapolated' if ops is not None else ', line through the times'}) "
                  f"(pair {t1 - t0:.1f} s, full {t2 - t1:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
