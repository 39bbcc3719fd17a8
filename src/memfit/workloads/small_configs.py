"""Small config.json files of mixture-of-experts and speech models: every code path of the full
models (routers, shared experts, group-limited routing, expert biases, the speech encoder) at a
fraction of their size, so that a real step takes well under a second here. The tests and the
accuracy table (``bench/moe_accuracy.py``) write them to a folder and run it as a model folder::

    from memfit.workloads.small_configs import write_folder
    memfit profile "$(python -c 'from memfit.workloads.small_configs import write_folder; print(write_folder("mixtral"))')"
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

_DECODER = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
            "max_position_embeddings": 512, "tie_word_embeddings": False}

SMALL_FOLDERS: dict[str, dict] = {
    "mixtral": {**_DECODER, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "intermediate_size": 128,
                "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**_DECODER, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
                  "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 128,
                  "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1},
    "deepseek_v3": {**_DECODER, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                    "num_hidden_layers": 3, "first_k_dense_replace": 1, "intermediate_size": 128,
                    "moe_intermediate_size": 32, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
                    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16},
    "gpt_oss": {**_DECODER, "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "intermediate_size": 64,
                "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]},
    "whisper": {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"], "d_model": 64,
                "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 512, "num_mel_bins": 16,
                "max_source_positions": 64, "max_target_positions": 64, "pad_token_id": 0, "bos_token_id": 1,
                "eos_token_id": 2, "decoder_start_token_id": 1},
}
"""model type -> a small config.json of that type."""

MOE = ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")


def write_folder(name: str, into: str | Path | None = None, **changes) -> str:
    """Write the small config ``name`` (with ``changes``, e.g. ``experts_implementation="eager"``) as
    ``into/<name>/config.json`` (a new temporary folder by default); returns the model folder."""
    base = Path(into) if into is not None else Path(tempfile.mkdtemp(prefix="memfit-"))
    folder = base / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**SMALL_FOLDERS[name], **changes}))
    return str(folder)
