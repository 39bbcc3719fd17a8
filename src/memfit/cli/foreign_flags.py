"""Other tools' flags, answered with memfit's.

People come to memfit with another trainer's command line in their fingers: Hugging Face's
``TrainingArguments`` (``--bf16``, ``--gradient_checkpointing``, ``--optim``), kohya-ss's
(``--fp8_base``, ``--network_dim``, ``--blocks_to_swap``), axolotl's and bitsandbytes' keys
(``--load_in_4bit``). argparse would call them unrecognized, or worse, read one as a prefix of
memfit's own (``--bf16`` as ``--bf16-update``, asking for its value; ``--optim`` as ambiguous).
So each is caught before parsing and answered in one line with the memfit flag that does it.
"""

from __future__ import annotations

THEIRS = {
    # Hugging Face TrainingArguments, accelerate, torchtune
    "--bf16": "--precision bf16 (or bf16-pure: bf16 weights too)",
    "--fp16": "--precision fp16",
    "--tf32": "nothing: TF32 matmuls change no memory",
    "--gradient-checkpointing": "--checkpointing blocks",
    "--activation-checkpointing": "--checkpointing blocks",
    "--enable-activation-checkpointing": "--checkpointing blocks",
    "--per-device-train-batch-size": "--micro-batch-size N, with --batch-size the whole batch",
    "--train-batch-size": "--batch-size N",
    "--gradient-accumulation-steps": "--grad-accum-steps N",
    "--optim": "--optimizer NAME (e.g. adamw8bit)",
    "--max-seq-length": "--seq-len N",
    "--max-length": "--seq-len N",
    "--sequence-len": "--seq-len N",
    "--mixed-precision": "--precision bf16|fp16",
    "--torch-compile": "--compile blocks|full",
    "--deepspeed": "--shard fsdp --world-size N (memfit predicts FSDP2, not DeepSpeed)",
    "--fsdp": "--shard fsdp --world-size N",
    # bitsandbytes, PEFT, axolotl
    "--load-in-4bit": "--base-weights nf4 (or --adapter qlora)",
    "--load-in-8bit": "--base-weights int8",
    "--lora-r": "--adapter lora:r=N",
    "--lora-rank": "--adapter lora:r=N",
    "--lora-alpha": "--adapter lora:r=N,alpha=A",
    # kohya-ss sd-scripts
    "--network-dim": "--adapter lora:r=N",
    "--network-alpha": "--adapter lora:r=N,alpha=A",
    "--fp8-base": "--base-weights fp8",
    "--blocks-to-swap": "--swap-blocks N",
    "--full-bf16": "--precision bf16-pure",
    "--cache-latents": "nothing: memfit's image workloads take cached latents already",
    "--gpu": "--device NAME (see memfit devices)",
}


def answer(argv: list[str]) -> str | None:
    """For the first of ``argv``'s flags that is another tool's (the note above): one line saying memfit's."""
    for token in argv:
        if token == "--":
            return None
        flag = token.split("=", 1)[0].replace("_", "-")
        if flag in THEIRS:
            return f"{token.split('=', 1)[0]} is another tool's flag; memfit's: {THEIRS[flag]}"
    return None
