"""Plan values as other tools name them, for the "did you mean" of a value memfit does not take.

People bring the names of the trainer they use: Hugging Face's ``optim`` names (``paged_adamw_8bit``), Lightning's
precisions (``bf16-mixed``, ``bf16-true``), dtype names (``bfloat16``), bitsandbytes' ``4bit``. A plan value keeps
one spelling (plan files stay stable and compare equal), so these are not taken as values: the one-line error
for such a value ends with the memfit value meant (:func:`meant`).
"""

from __future__ import annotations

from memfit.techniques.optimizer_variant import TRAINERS_OPTIM_NAMES

SYNONYMS: dict[str, dict[str, str]] = {
    "optimizer": {**TRAINERS_OPTIM_NAMES, "adam8bit": "adamw8bit", "adam_8bit": "adamw8bit", "paged_adamw": "adamw-paged",
                  "adam": "adamw (the same memory; AdamW decays the weights apart from the gradient)"},
    "precision": {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
                  "bf16_mixed": "bf16 (Lightning's bf16-mixed)", "16_mixed": "fp16 (Lightning's 16-mixed)",
                  "bf16_true": "bf16-pure (Lightning's bf16-true: the weights in bf16)",
                  "16_true": "fp16-base (Lightning's 16-true over an adapter) or fp16", "32_true": "fp32", "32": "fp32",
                  "16": "fp16", "mixed": "bf16 or fp16", "amp": "bf16 or fp16"},
    "base_weights": {"4bit": "nf4 (QLoRA's; bitsandbytes' own default 4-bit type is fp4)", "int4": "nf4",
                     "bnb_4bit": "nf4", "load_in_4bit": "nf4", "8bit": "int8", "bnb_8bit": "int8", "load_in_8bit": "int8",
                     "float8": "fp8", "fp8_e4m3fn": "fp8", "e4m3": "fp8", "float8_e4m3fn": "fp8", "bf16": "as-is",
                     "fp16": "as-is"},
    "checkpointing": {"full": "blocks (each repeated block)", "all": "blocks", "true": "blocks", "on": "blocks",
                      "gradient": "blocks", "block": "blocks", "layers": "blocks", "sac": "selective",
                      "selective_ac": "selective", "op": "selective",
                      "unsloth": "blocks with --offload activations (Unsloth's offloaded checkpointing)"},
}
"""Per plan key: a value other tools use (lower case, ``_`` for ``-``) -> the memfit value meant."""


def meant(values: dict) -> str:
    """'; did you mean KEY VALUE?' for the first of ``values`` (a technique's plan values) that another tool's
    name stands in, else ''."""
    for key, value in values.items():
        if isinstance(value, str):
            ours = SYNONYMS.get(key, {}).get(value.strip().lower().replace("-", "_"))
            if ours:
                return f"; did you mean {key} {ours}?"
    return ""
