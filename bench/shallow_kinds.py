"""A shallow pair against the full trace, on models whose blocks come in several kinds (NOTE [ Blocks of
several kinds ] in memfit.planner.stacks).

    python -m bench.shallow_kinds                 # tiny models of each pattern (about 2 minutes here)
    python -m bench.shallow_kinds --full-size     # Gemma-3-12B and gpt-oss-20b sizes, 2,048 tokens

Each model is built from its config (no weights) in a temporary folder and traced as the planner's workers
trace it: at the pair's two depths, and whole. Printed: the cut, the pair's depths, their trace times, and
the pair's figures against the full trace's (its peak on the line, its step time from the extrapolated ops,
its allocations replayed at full depth).
"""

from __future__ import annotations

import argparse
import tempfile
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

TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            vocab_size=1000)
MODELS = {  # name: (model_type, config values)
    "llama4-text": ("llama4_text", dict(TINY, num_hidden_layers=24, num_local_experts=8, interleave_moe_layer_step=2,
                                        intermediate_size_mlp=256)),
    "deepseek-v3": ("deepseek_v3", dict(TINY, head_dim=16, num_hidden_layers=12, first_k_dense_replace=3,
                                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                        q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                        v_head_dim=32, n_group=2, topk_group=1)),
    "qwen3-next": ("qwen3_next", dict(TINY, num_hidden_layers=24, num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                      linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                                      linear_value_head_dim=32)),
    "granite4-hybrid": ("granitemoehybrid", dict(TINY, num_hidden_layers=24, num_local_experts=4,
                                                 num_experts_per_tok=2, mamba_d_state=16, mamba_n_heads=8,
                                                 mamba_d_head=32,
                                                 layer_types=["mamba", "mamba", "mamba", "attention"] * 6)),
    "cohere2": ("cohere2", dict(TINY, num_hidden_layers=24, sliding_window=64)),
    "gemma3-text": ("gemma3_text", dict(TINY, num_hidden_layers=26, sliding_window=64)),
}
FULL_SIZE = {
    "gemma3-12b": ("gemma3_text", dict(hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
                                       num_key_value_heads=8, head_dim=256, vocab_size=262208, num_hidden_layers=48,
                                       sliding_window=1024, query_pre_attn_scalar=256)),
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                                    sliding_window=128, vocab_size=201088, num_hidden_layers=24)),
}
PLANS = {"bf16": Plan(precision="bf16"),
         "lora+blocks": Plan(adapter="lora:r=4", precision="bf16-pure", checkpointing="blocks")}


def compare(folder: str, plan: Plan, seq_len: int) -> str:
    target = Target.resolve(folder, plan, 2, "rtx4090", seq_len=seq_len)
    facts = model_facts(target.workload)
    stacks = stacks_of(facts.model)
    pair = depths(plan, stacks.full, stacks.least, stacks.unit)
    if pair is None:
        return f"{stacks.describe()}: no pair"
    tracer = Tracer(target, facts.model, Budget.resolve(None, target.device))
    t0 = time.perf_counter()
    a, b = (tracer((plan, d, None)) for d in pair)
    t1 = time.perf_counter()
    full = tracer((plan, None, None))
    t2 = time.perf_counter()
    failed = next((t for t in (a, b, full) if not hasattr(t, "peak_bytes")), None)  # (a trace's error, returned)
    if failed is not None:
        return f"{stacks.describe()}: a trace failed: {failed}"
    peak = extrapolate(a.peak_bytes, b.peak_bytes, *pair, stacks.full)
    ops = extrapolate_ops(a.ops, b.ops, *pair, stacks.full)
    seconds = time_from_ops(ops, target).seconds if ops is not None else \
        extrapolate(*(time_from_ops(t.ops, target).seconds for t in (a, b)), *pair, stacks.full)
    deep = deepen(a.stream, b.stream, *pair, stacks.full) if a.stream and b.stream else None
    stream = replay(deep, STEADY_STEP) if deep is not None else None
    return (f"{stacks.describe()}, pair {pair} {t1 - t0:.1f} s, full {t2 - t1:.1f} s | peak "
            f"{peak / full.peak_bytes - 1:+.3%} | time {seconds / time_from_ops(full.ops, target).seconds - 1:+.3%}"
            f"{'' if ops is not None else ' (line of times)'} | stream "
            f"{'none' if stream is None else f'{stream[0] / full.peak_bytes - 1:+.3%}'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-size", action="store_true", help="Gemma-3-12B and gpt-oss-20b sizes, 2,048 tokens")
    args = parser.parse_args()
    from transformers import AutoConfig
    models, seq_len = (FULL_SIZE, 2048) if args.full_size else (MODELS, 256)
    with silenced_warnings(), tempfile.TemporaryDirectory() as tmp:
        for name, (model_type, values) in models.items():
            AutoConfig.for_model(model_type, **values).save_pretrained(f"{tmp}/{name}")
            for label, plan in PLANS.items():
                print(f"{name:16s} {label:12s} {compare(f'{tmp}/{name}', plan, seq_len)}", flush=True)


if __name__ == "__main__":
    main()
