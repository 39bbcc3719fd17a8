"""memfit demo: the main job on built-in defaults (what `make demo` runs)."""

from __future__ import annotations

import argparse

DEMO_PREDICT = ("gpt2", 8, "rtx4090")
DEMO_PROFILE = ("gpt2:n_layer=4,n_embd=256,n_head=4,n_positions=256", 4)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="estimate GPT-2 on a 24 GB GPU, then profile a small GPT-2 here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from memfit.memory.estimate import estimate
    from memfit.memory.measure import profile
    from memfit.plans import Plan
    from memfit.report.tables import print_estimate, print_profile

    c = Console(highlight=False, soft_wrap=True)
    wl, bs, dev = DEMO_PREDICT
    c.rule(f"1. Will GPT-2 (124M) train at batch {bs}, seq 1024 on an {dev} (24 GB)?")
    for precision in ("fp32", "bf16"):
        print_estimate(estimate(wl, Plan(precision=precision), batch_size=bs, device=dev), c)
        c.print()
    wl, bs = DEMO_PROFILE
    c.rule("2. Prediction vs measurement, here on this CPU")
    for precision in ("fp32", "bf16"):
        print_profile(profile(wl, Plan(precision=precision), batch_size=bs, device="cpu", repeats=3), c)
        c.print()
    c.print("Next: memfit estimate WORKLOAD --device DEVICE --precision bf16 (see memfit --help)")
    return 0
