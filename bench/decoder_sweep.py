"""Every decoder type of the installed transformers, tiny, traced as the planner traces it.

    python -m bench.decoder_sweep                       # the types below, one process each (~15 minutes here)
    python -m bench.decoder_sweep --types gpt_oss,jamba

Each type gets a config of its class with small sizes (hidden 64, 16 layers, 8 experts), written to a
temporary folder, and two plans (bf16; a LoRA with blocks checkpointed) are traced whole and at their
shallow pair (bench.shallow_kinds.compare). One JSON line a type: for each plan the cut, the pair's peak on
the line, its step time from the extrapolated ops and its allocations replayed at full depth, against the
full trace's; or the
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
FITTED = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
              kv_lora_rank=32, q_lora_rank=32, rotary_dim=8)
"""Token ids inside the small vocabulary, and multi-head latent attention's and partial rotary's widths within a
head of 16 (without them 13 more types do not build at these sizes); left out where a type refuses one."""


def one(model_type: str, folder: str) -> dict:
    from transformers import AutoConfig

    from bench.shallow_kinds import PLANS, compare
    from memfit.errors import UserError
    out: dict = {"model": model_type}
    try:
        try:
            config = AutoConfig.for_model(model_type, **SMALL, **FITTED)
        except Exception:  # noqa: BLE001 - a type whose config computes one of them (xLSTM's v_head_dim)
            config = AutoConfig.for_model(model_type, **SMALL)
        for key in ("layer_types", "mlp_layer_types"):  # (a list per layer, of the type's default depth)
            value = getattr(config, key, None)
            if isinstance(value, list) and len(value) != SMALL["num_hidden_layers"]:
                setattr(config, key, (value * SMALL["num_hidden_layers"])[:SMALL["num_hidden_layers"]])
        config.save_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - the small sizes do not make a config of this type
        return dict(out, config=f"{type(e).__name__}: {str(e)[:200]}")
    for label, plan in PLANS.items():
        try:
            out[label] = compare(folder, plan, seq_len=128)
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
