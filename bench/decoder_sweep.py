"""Every decoder type of the installed transformers, tiny, traced as the planner traces it.

    python -m bench.decoder_sweep                       # the types below, one process each (~15 minutes here)
    python -m bench.decoder_sweep --types gpt_oss,jamba

Each type gets a config of its class with small sizes (hidden 64, 16 layers, 8 experts), written to a
temporary folder, and two plans (bf16; a LoRA with blocks checkpointed) are traced whole and at their
shallow pair. One JSON line a type: the cut, and for each plan the pair's peak on the line, its step time
from the extrapolated ops and its allocations replayed at full depth, against the full trace's; or the
error, where the small config does not build (a type whose sizes need more than these) or memfit fails
(an ``INTERNAL`` one is memfit's bug).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import traceback

TYPES = ("afmoe apertus arcee bamba cohere cohere2 cohere2_moe deepseek_v3 deepseek_v4 doge ernie4_5 ernie4_5_moe "
         "exaone4 exaone_moe falcon_h1 gemma gemma2 gemma3_text gemma4_text glm4_moe gpt_neox gpt_oss granite "
         "granitemoe granitemoehybrid granitemoeshared helium hunyuan_v1_dense hunyuan_v1_moe hy_v3 internlm3 "
         "jamba jetmoe laguna lfm2 llama llama4_text minimax minimax_m2 mimo_v2_flash ministral mistral mixtral "
         "nemotron nemotron_h olmo2 olmo3 olmoe phimoe qwen2_moe qwen3 qwen3_5_moe_text qwen3_5_text qwen3_moe "
         "qwen3_next seed_oss solar_open starcoder2 vaultgemma").split()
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=512, num_hidden_layers=16, moe_intermediate_size=32, num_experts=8, num_local_experts=8,
             n_routed_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=32,
             max_position_embeddings=1024)


def one(model_type: str, folder: str) -> dict:
    from transformers import AutoConfig

    from memfit.errors import UserError
    from memfit.memory.budget import Budget
    from memfit.memory.categories import STEADY_STEP
    from memfit.memory.deep_stream import deepen, replay
    from memfit.planner.shallow import depths, extrapolate, extrapolate_ops
    from memfit.planner.space import model_facts
    from memfit.planner.stacks import stacks_of
    from memfit.planner.timing import time_from_ops
    from memfit.planner.trace_job import Tracer
    from memfit.plans import Plan
    from memfit.target import Target
    out: dict = {"model": model_type}
    try:
        config = AutoConfig.for_model(model_type, **SMALL)
        for key in ("layer_types", "mlp_layer_types"):  # (a list per layer, of the type's default depth)
            value = getattr(config, key, None)
            if isinstance(value, list) and len(value) != SMALL["num_hidden_layers"]:
                setattr(config, key, (value * SMALL["num_hidden_layers"])[:SMALL["num_hidden_layers"]])
        config.save_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - the small sizes do not make a config of this type
        return dict(out, config=f"{type(e).__name__}: {str(e)[:200]}")
    plans = {"bf16": Plan(precision="bf16"),
             "lora+blocks": Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="blocks")}
    for label, plan in plans.items():
        try:
            target = Target.resolve(folder, plan, 2, "rtx4090", seq_len=128)
            facts = model_facts(target.workload)
            stacks = stacks_of(facts.model)
            out["stacks"] = stacks.describe() if stacks else None
            tracer = Tracer(target, facts.model, Budget.resolve(None, target.device))
            full = tracer((plan, None, None))
            if not hasattr(full, "peak_bytes"):
                out[label] = f"full trace: {full}"[:300]
                continue
            pair = depths(plan, stacks.full, stacks.least, stacks.unit) if stacks else None
            if pair is None:
                out[label] = "traced whole"
                continue
            a, b = (tracer((plan, d, None)) for d in pair)
            peak = extrapolate(a.peak_bytes, b.peak_bytes, *pair, stacks.full) / full.peak_bytes - 1
            ops = extrapolate_ops(a.ops, b.ops, *pair, stacks.full)
            seconds = time_from_ops(ops, target).seconds if ops is not None else \
                extrapolate(*(time_from_ops(t.ops, target).seconds for t in (a, b)), *pair, stacks.full)
            deep = deepen(a.stream, b.stream, *pair, stacks.full) if a.stream and b.stream else None
            stream = replay(deep, STEADY_STEP)[0] / full.peak_bytes - 1 if deep is not None else None
            out[label] = (f"pair {pair} line {peak:+.3%} time {seconds / time_from_ops(full.ops, target).seconds - 1:+.3%}"
                          f" stream {'none' if stream is None else f'{stream:+.3%}'}")
        except UserError as e:
            out[label] = f"UserError: {str(e)[:300]}"
        except Exception as e:  # noqa: BLE001 - memfit's bug: recorded, and the sweep goes on
            where = traceback.extract_tb(e.__traceback__)[-1]
            out[label] = f"INTERNAL {type(e).__name__}: {str(e)[:200]} at {where.filename}:{where.lineno}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated model types")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        from memfit.quiet import silenced_warnings
        with silenced_warnings(), tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one(args.one, tmp)), flush=True)
        return
    for model_type in args.types.split(","):
        try:
            p = subprocess.run([sys.executable, "-m", "bench.decoder_sweep", "--one", model_type], capture_output=True,
                               text=True, timeout=300)
            lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
            print(lines[-1] if lines else json.dumps({"model": model_type, "exit": p.returncode,
                                                      "stderr": p.stderr.strip().splitlines()[-1:]}), flush=True)
        except subprocess.TimeoutExpired:
            print(json.dumps({"model": model_type, "timeout": 300}), flush=True)


if __name__ == "__main__":
    main()
