"""memfit fit: one table of cards by fine-tuning methods (memfit.planner.fit)."""

from __future__ import annotations

import argparse
import contextlib

from memfit.cli.common import add_command, add_resolution_arg, apply_config, parse_resolution, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "fit", run, help="which cards train a model, by which method, at what batch, how fast",
                    description="For each card and method (full, LoRA, QLoRA; full and LoRA for image models): does it "
                                "fit, the largest batch that does (exact: the next one does not), the recipe that "
                                "takes it, and its predicted tokens/s or images/s; where no card fits alone, the "
                                "fewest cards with FSDP2. Traces are shared by the cards of one architecture.")
    p.add_argument("workload", nargs="?", help="built-in name (llama, gpt2, dit-lumina2, ...), a model folder or a hub "
                                               "id (with --from: the model named beside the config)")
    p.add_argument("--from", dest="from_config", metavar="CONFIG",
                   help="an axolotl, ai-toolkit, LLaMA-Factory or torchtune YAML, a kohya-ss TOML or a SimpleTuner config "
                        "(.json, .toml, .env): its model, size and "
                        "adapter (the LoRA "
                        "methods' rank and targets)")
    p.add_argument("--seq-len", metavar="T", help="sequence length (language models; default: the config's)")
    add_resolution_arg(p)
    p.add_argument("--methods", metavar="METHODS",
                   help="methods to compare (full,lora,dora,qlora,qdora); default full,lora,qlora, or full,lora for "
                        "image-generation models")
    p.add_argument("--adapter", help="the LoRA methods' adapter: rank and targets (default lora:r=16, the model's "
                                     "attention projections; with --from, the config's)")
    p.add_argument("--devices", metavar="CARDS", help="GPU presets to compare, separated by commas (default: every "
                                                      "preset; see memfit devices)")
    p.add_argument("--budget", metavar="PCT", help="each card's budget as a share of it, e.g. 100%% (default: the "
                                                   "capacity less 10%%, as memfit plan)")
    p.add_argument("--max-world-size", metavar="N", default="8",
                   help="where no card fits alone: try 2, 4, ... up to N cards with FSDP2 (default 8)")
    p.add_argument("--host-memory", metavar="SIZE",
                   help="the training machine's memory for offloaded and swapped copies: 64GB, or 80%% of this "
                        "machine's; recipes that need more are passed over (default: not checked)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--png", metavar="FILE.png", help="also write a picture of the table")


def run(args: argparse.Namespace) -> int:
    from memfit.devices import GPU_PRESETS, get_device
    from memfit.errors import UserError
    from memfit.outputs import IMAGE_SUFFIXES, check_output_file
    from memfit.planner.fit import fit_table
    from memfit.planner.methods import QUANTIZED, on_checkpoint, parse_methods, with_experts_quantized
    from memfit.planner.progress import PlanProgress
    from memfit.report.fit import markdown, print_fit, save_fit_png
    from memfit.units import MAX_SIZE, parse_positive_int
    from memfit.workloads import load_workload
    from memfit.workloads.checkpoint_formats import by_card

    if args.png:
        check_output_file(args.png, "--png", example="fit.png", suffixes=IMAGE_SUFFIXES)
    if args.budget is not None and not str(args.budget).strip().endswith("%"):
        raise UserError(f"fit --budget {args.budget}: give a share of each card, e.g. 90% (the cards differ in size)")
    most = parse_positive_int(args.max_world_size, "--max-world-size")
    names = [n.strip() for n in args.devices.split(",") if n.strip()] if args.devices else list(GPU_PRESETS)
    cards = list({d.name: d for d in map(get_device, names)}.values())
    apply_config(args, cards[0])  # (--from: the config's model, sizes and adapter under what the command line gives)
    if getattr(args, "config_summary", None) and not args.json:
        print(args.config_summary)
    given = args.config_plan.to_dict()["adapter"] if getattr(args, "config_plan", None) else "none"
    adapter = args.adapter or (given if given != "none" else "lora:r=16")
    seq = parse_positive_int(args.seq_len, "--seq-len", MAX_SIZE) if args.seq_len is not None else None
    res = parse_resolution(args.resolution) if args.resolution is not None else None
    workload = load_workload(args.workload, seq_len=seq, resolution=res)
    image, info = workload.info.resolution is not None, workload.info
    if info.adapter is not None:
        raise UserError(f"fit compares full fine-tuning, LoRA and QLoRA of a base model; {workload.name} is an adapter "
                        f"checkpoint ({info.adapter}): fit its base model, or plan it on a card with memfit plan "
                        f"{workload.name} --batch-size max --device CARD")
    default = ("full,lora" if by_card(info.quantized) else "qlora") if info.quantized else "full,lora" if image else \
        "full,lora,qlora"
    methods = parse_methods(args.methods or default, adapter)
    methods = on_checkpoint(methods, workload, "fit --methods")
    methods = with_experts_quantized(methods, workload)
    if image and any(m.name in QUANTIZED for m in methods):
        raise UserError("fit --methods: qlora and qdora are for language models here (4-bit base weights of a diffusion model "
                        "are not modelled); choose from full, lora, dora")
    with PlanProgress() if not args.json else contextlib.nullcontext() as progress:
        table = fit_table(workload, methods, cards, budget=args.budget, max_world=most,
                          host_memory=args.host_memory, progress=progress)
    if args.png:
        save_fit_png(table, args.png)
    if args.json:
        print_json({**table.to_json(), "checkpoint": workload.info.loaded})
    elif args.markdown:
        print(markdown(table))
    else:
        print_fit(table)
    if workload.info.loaded and not args.json:  # (how each card loads it: MXFP4 dequantized, FP8 by card)
        print(workload.info.loaded)
    if args.png and not args.json:
        print(f"picture written to {args.png}")
    return 0

