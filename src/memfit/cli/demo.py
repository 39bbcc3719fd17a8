"""memfit demo: the main job on built-in defaults (what `make demo` runs)."""

from __future__ import annotations

import argparse

from memfit.cli.common import add_command

DEMO_PREDICT = ("gpt2", 8, "rtx4090")
DEMO_SHARDED = ("llama", 8, "a100-80gb", dict(world_size=8, shard_param_dtype="bf16", shard_reduce_dtype="fp32",
                                               checkpointing="blocks"))
DEMO_PROFILE = ("gpt2:n_layer=4,n_embd=256,n_head=4,n_positions=256", 4)
DEMO_PLAN = ("gpt2", 16, "rtx4090")
DEMO_TRAIN = ("gpt2:n_layer=4,n_embd=256,n_head=4,n_positions=256", 8, 128, 0.6, "memfit-out/demo")


def register(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "demo", run, help="estimate and plan GPT-2 for a 24 GB GPU, Llama-2-7B over 8 GPUs; profile "
                                       "and train a small GPT-2 here")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from memfit.memory.estimate import estimate
    from memfit.memory.measure import profile
    from memfit.memory.workspaces import native_dtype
    from memfit.planner.search import plan
    from memfit.plans import Plan
    from memfit.report.planner import print_plan_result
    from memfit.report.tables import print_estimate, print_profile
    from memfit.training.loop import train
    from memfit.training.report import render

    c = Console(highlight=False, soft_wrap=True)
    # planned first: the planner's trace processes fork from this one before it runs a backward
    planned = plan(DEMO_PLAN[0], device=DEMO_PLAN[2], batch_size=DEMO_PLAN[1])
    wl, bs, dev = DEMO_PREDICT
    c.rule(f"1. Will GPT-2 (124M) train at batch {bs}, seq 1024 on an {dev} (24 GB)? fp32, bf16, bf16 + compiled blocks")
    for p in (Plan(precision="fp32"), Plan(precision="bf16"), Plan(precision="bf16", compile="blocks")):
        print_estimate(estimate(wl, p, batch_size=bs, device=dev), c)  # compile: Inductor's pipeline, traced
        c.print()
    wl, bs, dev = DEMO_PLAN
    c.rule(f"2. The fastest plan for batch {bs} that fits the {dev}")
    print_plan_result(planned, c, top=5)
    c.print()
    wl, bs, dev, fields = DEMO_SHARDED
    c.rule(f"3. Beyond one GPU: Llama-2-7B sharded with FSDP2 over {fields['world_size']} x {dev}, batch {bs} x 2048: "
           "one rank predicted here, with no GPU and no other process")
    c.print("(fp32 AdamW needs ~101 GiB of model states: no single GPU holds it; torchtitan's mixed precision: bf16 "
            "gathered parameters, fp32 reductions)")
    print_estimate(estimate(wl, Plan(**fields), batch_size=bs, device=dev), c)
    c.print()
    wl, bs = DEMO_PROFILE
    c.rule("4. Prediction vs measurement, here on this CPU")
    precisions = ("fp32", "bf16") if native_dtype(torch.bfloat16) else ("fp32",)
    for precision in precisions:
        print_profile(profile(wl, Plan(precision=precision), batch_size=bs, device="cpu", repeats=3), c)
        c.print()
    if len(precisions) == 1:
        c.print(f"(bf16 is not profiled here: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16, "
                "so its matmuls are emulated and a step would take minutes)")
        c.print()
    wl, bs, seq, share, out = DEMO_TRAIN
    need = estimate(wl, Plan(), batch_size=bs, seq_len=seq).peak_bytes
    c.rule(f"5. Training with a budget of {share:.0%} of what the fp32 plan needs: the run adapts, the training "
           "does not change")
    result = train(wl, plan=Plan(), budget=int(need * share), steps=6, out=out, batch_size=bs, seq_len=seq,
                   overwrite=True)
    c.print(render(result.report))
    c.print()
    c.print("Next: memfit plan WORKLOAD --budget SIZE --device DEVICE, then memfit train WORKLOAD --plan plan.yaml "
            "(see memfit --help)")
    return 0
