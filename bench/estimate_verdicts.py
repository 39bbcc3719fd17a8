"""The estimate rung's verdicts checked by tracing: every plan it would rule out as too big is traced
anyway, and each verdict is set beside the plan's own figures (NOTE [ A recipe is never ruled out by an
estimate ] in memfit.planner.walk).

The estimate adds each value's saving measured alone; where a combination saves more than its parts
(the peak moves), it errs high and rules out a plan that fits. This prints, for one search, the plans it
would rule out, which of them fit by their own traces, and whether any is faster than the plan chosen (a
wrong answer) or only slower (the same answer, more traces).

    .venv/bin/python -m bench.estimate_verdicts            # Llama-3-8B sizes, b2 x 2048, the emulated 24 GB card
    .venv/bin/python -m bench.estimate_verdicts --model "llama:num_hidden_layers=2" --device rtx4090 --budget 4GiB
"""

from __future__ import annotations

import argparse
import time

LLAMA3_8B = ("llama:hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,"
             "num_key_value_heads=8,vocab_size=128256,max_position_embeddings=8192")


def main(argv: list[str] | None = None) -> int:
    from memfit.planner import walk
    from memfit.planner.search import plan
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=LLAMA3_8B)
    ap.add_argument("--device", default="h200-141gb")
    ap.add_argument("--budget", default="21.28GiB")
    ap.add_argument("--host", default="h200-box")
    ap.add_argument("-b", "--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--max-traces", type=int, default=150)
    opts = ap.parse_args(argv)
    would: dict = {}

    def recorded(self, c) -> bool:  # the verdict kept, the plan traced anyway
        rung = self.ladder.estimate if c.recipe is None else None
        e = rung.evaluate(c.plan) if rung is not None else None
        if e is not None and e.over(self.budget.bytes):
            would[c.plan] = e.used_bytes
        return False

    walk.Walk._estimated_too_big = recorded
    t0 = time.perf_counter()
    r = plan(opts.model, device=opts.device, budget=opts.budget, batch_size=opts.batch_size, seq_len=opts.seq_len,
             host=opts.host, max_traces=opts.max_traces)
    print(f"{opts.model[:60]} b{opts.batch_size} x {opts.seq_len} on {opts.device}, budget {opts.budget}: "
          f"{r.traces} traces, {time.perf_counter() - t0:.0f} s; chosen "
          f"{r.chosen.plan.short(opts.batch_size) if r.chosen else None} "
          f"({r.chosen.seconds:.4f} s)" if r.chosen else "nothing fits")
    ruled = [c for c in r.candidates if c.plan in would and c.used_bytes is not None]
    fit = [c for c in ruled if c.used_bytes <= r.budget_bytes]
    faster = [c for c in fit if r.chosen is not None and c.seconds < r.chosen.seconds]
    for c in fit:
        print(f"  fits, ruled out: estimated {would[c.plan] / 2**30:.2f} GiB, own traces {c.used_bytes / 2**30:.2f} "
              f"GiB, {c.seconds:.4f} s: {c.plan.short(opts.batch_size)}")
    print(f"ruled out by the estimate: {len(would)}; traced: {len(ruled)}; over the budget by their own traces: "
          f"{len(ruled) - len(fit)}; fit: {len(fit)}; faster than the plan chosen: {len(faster)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
