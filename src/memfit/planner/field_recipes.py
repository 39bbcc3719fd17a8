"""The field's published recipes, planned beside memfit's own plans.

A plan that fits but runs slower than a recipe people already run (torchtune's, kohya's, the QLoRA
paper's) is a wrong answer, and a user who knows the recipe asks how memfit's plan compares. So on
GPU presets every recipe below that suits the workload's method joins the search as a candidate: it
is predicted the same way (its own TrainStep's traces: memory from the trace book, time from its
ops), walked with the others, and measured after the walk if the walk never reached it
(:func:`settle_recipes`): where it fits and is predicted faster than the plan chosen, it is chosen.
The report lists each with its predicted memory, step time and throughput, and what its authors
published for it.

Each is planned only for models of the size it is published for (torchtune's single-device configs
start at 1B parameters), so a small model's plan is not slowed by a recipe nobody runs on it. A
recipe fixes techniques, never the user's model or adapter: its LoRA rank, targets and base-weight
format stay the user's (``--adapter``, ``--base-weights``, ``--methods``). A value that needs the
model's structure (block checkpointing, a chunked loss) is kept only where the search space offers
it for this workload, and the language-model recipes apply to causal LMs only (those whose loss the
space offers to chunk); a recipe that contradicts a plan field the user fixed is left out, with a note.

| recipe | method | plan | source |
|---|---|---|---|
| torchtune full, one GPU | full | bf16-pure, blocks, paged 8-bit AdamW in backward, compiled blocks, 8 chunks | ``full_finetune_single_device``, ``llama3_1/8B_full_single_device.yaml``; 1,650 tokens/s and 18.9 GiB reserved on an RTX 4090 at batch 2 x 2048 (torchtune's README) |
| torchtune LoRA, one GPU | lora | bf16-pure, blocks, 8 chunks | ``lora_finetune_single_device``, ``llama3_1/8B_lora_single_device.yaml`` |
| torchtune QLoRA, one GPU | qlora | bf16-pure, blocks, 8 chunks | ``lora_finetune_single_device``, ``llama3_1/8B_qlora_single_device.yaml`` |
| QLoRA paper (HF Trainer) | qlora | bf16 autocast, blocks, paged 8-bit AdamW | Dettmers et al. 2023; ``optim="paged_adamw_8bit"``, ``gradient_checkpointing=True`` |
| Unsloth, one GPU | lora, qlora | bf16-pure, blocks with their inputs on the host, 8-bit AdamW, 8 chunks | Unsloth's notebooks: ``use_gradient_checkpointing="unsloth"`` (offloaded checkpoints), ``optim="adamw_8bit"``; its fused Triton kernels are not modelled: the row is its memory plan run with memfit's kernels |
| kohya sd-scripts LoRA | lora, qlora (images) | bf16-base (the frozen model cast to bf16, the LoRA in fp32, autocast), blocks, 8-bit AdamW | ``--mixed_precision bf16 --gradient_checkpointing --optimizer_type AdamW8bit`` |
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import UserError
from memfit.plans import Plan


@dataclass(frozen=True)
class FieldRecipe:
    name: str
    methods: tuple[str, ...]
    """The methods it is published for (``full``, ``lora``, ``qlora``)."""
    fields: dict
    source: str
    published: str = ""
    """What its authors measured (a figure and its setup), shown beside memfit's prediction."""
    text_lm: bool = True
    """A recipe for causal language models (else for image-generation models)."""
    min_params: int = 0
    """The smallest model it is published for (torchtune's single-device configs start at 1B)."""


RECIPES = (
    FieldRecipe("torchtune full (1 GPU)", ("full",),
                dict(precision="bf16-pure", checkpointing="blocks", optimizer="adamw8bit-paged",
                     optimizer_in_backward=True, compile="blocks", loss_chunks=8),
                "torchtune full_finetune_single_device, llama3_1/8B_full_single_device.yaml",
                published="Llama-3.1-8B on an RTX 4090, batch 2 x 2048: 1,650 tokens/s, 18.9 GiB reserved (torchtune's README)",
                min_params=10**9),
    FieldRecipe("torchtune LoRA (1 GPU)", ("lora",),
                dict(precision="bf16-pure", checkpointing="blocks", loss_chunks=8),
                "torchtune lora_finetune_single_device, llama3_1/8B_lora_single_device.yaml", min_params=10**9),
    FieldRecipe("torchtune QLoRA (1 GPU)", ("qlora",),
                dict(precision="bf16-pure", checkpointing="blocks", loss_chunks=8),
                "torchtune lora_finetune_single_device, llama3_1/8B_qlora_single_device.yaml", min_params=10**9),
    FieldRecipe("QLoRA paper (HF Trainer)", ("qlora",),
                dict(precision="bf16", checkpointing="blocks", optimizer="adamw8bit-paged"),
                "Dettmers et al. 2023 with transformers' Trainer: optim=paged_adamw_8bit, gradient_checkpointing=True, bf16=True",
                min_params=10**9),
    FieldRecipe("Unsloth (1 GPU)", ("lora", "qlora"),
                dict(precision="bf16-pure", checkpointing="blocks", offload=["activations"], optimizer="adamw8bit",
                     loss_chunks=8),
                "unslothai/unsloth's notebooks: FastLanguageModel (bf16; load_in_4bit for QLoRA), get_peft_model("
                "use_gradient_checkpointing=\"unsloth\": each checkpointed layer's input held in host memory), "
                "optim=\"adamw_8bit\", its chunked cross-entropy", min_params=10**9),
    FieldRecipe("kohya sd-scripts LoRA", ("lora", "qlora"),
                dict(precision="bf16-base", checkpointing="blocks", optimizer="adamw8bit"),
                "kohya-ss/sd-scripts: --mixed_precision bf16 --gradient_checkpointing --optimizer_type AdamW8bit",
                text_lm=False),
)

MODEL_DEPENDENT = ("checkpointing", "loss_chunks")
"""Values a recipe keeps only where the search space offers them for the workload."""


def method_of(given: dict, mostly_frozen: bool = False) -> str:
    """The method of the plan fields the user fixed: full, lora, or qlora (a quantized base);
    ``mostly_frozen``: most of the model's own parameters do not train (a PEFT model of the user's
    own), so the method is an adapter's."""
    plan = Plan(**{k: v for k, v in given.items() if k in ("adapter", "base_weights")})
    if plan.config("adapter").is_default:
        return "lora" if mostly_frozen else "full"
    return "lora" if plan.config("base_weights").is_default else "qlora"


def field_plans(workload, given: dict, offered: dict, device, mostly_frozen: bool = False,
                n_params: int | None = None) -> tuple[dict, list[str]]:
    """The recipes that suit ``workload``'s method on ``device``, as plans (each with the fields the
    user fixed, ``given``), and notes on those left out. ``offered``: the search space's values
    before any narrowing (plan key -> values); ``mostly_frozen``: see :func:`method_of`;
    ``n_params``: the model's parameters (None: any size suits)."""
    if not device.is_gpu:
        return {}, []
    images = workload.info.resolution is not None
    text = not images and any(offered.get("loss_chunks", ()))  # (a causal LM: its loss can be chunked)
    method = method_of(given, mostly_frozen)
    yours = Plan(**given).to_dict()  # (a given value may need another: a budget needs compile)
    out, notes = {}, []
    for recipe in RECIPES:
        if method not in recipe.methods or (recipe.text_lm and not text) or (not recipe.text_lm and not images):
            continue
        if n_params is not None and n_params < recipe.min_params:
            continue
        fields = {k: v for k, v in recipe.fields.items() if k not in MODEL_DEPENDENT or v in offered.get(k, ())}
        clash = [k for k, v in fields.items() if k in given and yours[k] != Plan(**{k: v}).to_dict()[k]]
        if clash:
            notes.append(f"{recipe.name} not planned: it sets {', '.join(clash)}, which you fixed")
            continue
        try:
            plan = Plan(**{**given, **fields})
        except UserError as e:
            notes.append(f"{recipe.name} not planned: {e}")
            continue
        out.setdefault(plan, recipe)
    return out, notes


def settle_recipes(walk, recipes: list, chosen):
    """Measure each recipe candidate the walk left open, and confirm one that fits and is predicted
    faster than ``chosen`` (the fastest such is chosen instead). Returns the plan chosen."""
    for c in sorted(recipes, key=lambda c: c.seconds):
        better = walk.settle(c, chosen)
        if better is not None:
            if chosen is not None:
                chosen.reopen()
            better.choose()
            chosen = better
    return chosen
