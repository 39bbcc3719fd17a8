"""An axolotl config read as a workload and a plan (memfit.integrations.axolotl): each mapped field,
the fields refused in one line, and the ones named in a warning."""

import json
from pathlib import Path

import pytest

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.integrations.axolotl import NO_MEMORY_EFFECT, REFUSED, map_config, read_config
from memfit.plans import Plan

DATA = Path(__file__).resolve().parents[1] / "data" / "axolotl"
CARD = get_device("rtx4090")


def test_axolotls_qlora_example():
    c = read_config(DATA / "qlora-llama.yml", CARD)
    assert c.workload == "NousResearch/Llama-2-7b-hf"
    assert (c.batch_size, c.micro_batch_size, c.seq_len) == (4, 1, 4096)
    assert c.plan == Plan(adapter="lora:r=32,alpha=16,targets=linear-modules,dropout=0.05",
                          base_weights="nf4:double_quant=true", precision="bf16-base", checkpointing="blocks",
                          micro_batch_size=1, optimizer="adamw-paged")  # (paged_adamw_32bit: states in managed memory)
    assert c.plan.micro_batches(c.batch_size) == (1, 4)
    assert c.warnings == ()


def test_an_8bit_lora_with_named_targets():
    c = read_config(DATA / "lora-llama.yml", CARD)
    assert c.plan == Plan(adapter="lora:r=16,alpha=32,targets=q_proj+v_proj,dropout=0.05", base_weights="int8",
                          precision="bf16-base", checkpointing="blocks", optimizer="adamw8bit", micro_batch_size=2)
    assert (c.batch_size, c.seq_len, c.warnings) == (8, 2048, ())
    assert "batch 8 (2 a micro-batch x 4 accumulated) · seq 2048" in c.summary()


def test_unmapped_fields_are_named_one_a_line():
    c = read_config(DATA / "unmapped.yml", CARD)
    assert [w.split(": ", 1)[1] for w in c.warnings] == [
        "neftune_noise_alpha is not mapped; the estimate ignores it", "relora_steps is not mapped; the estimate ignores it"]
    assert c.plan == Plan(adapter="lora:r=8", precision="bf16-base") and c.batch_size == 4


def test_deepspeed_is_refused_in_one_line():
    with pytest.raises(UserError) as e:
        read_config(DATA / "deepspeed.yml", CARD)
    assert str(e.value).startswith(f"--from {DATA / 'deepspeed.yml'}: deepspeed: memfit does not model DeepSpeed")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_every_refused_field_names_itself(key):
    with pytest.raises(UserError, match=f"c.yml: {key}: "):
        map_config({"base_model": "org/model", key: "something"}, "c.yml", CARD)


def test_an_empty_refused_field_is_as_if_absent():
    c = map_config({"base_model": "org/model", "deepspeed": None, "fsdp": [], "fsdp_config": {}}, "c.yml", CARD)
    assert c.plan == Plan() and c.warnings == ()


@pytest.mark.parametrize("fields, message", [
    ({"adapter": "ia3"}, "adapter 'ia3' is not one memfit runs"),
    ({"optimizer": "lion_8bit"}, "optimizer 'lion_8bit' is not one memfit runs"),
    ({"load_in_4bit": True}, "without an adapter trains nothing"),
    ({"adapter": "lora", "load_in_4bit": True, "load_in_8bit": True}, "keep one"),
    ({"micro_batch_size": 0}, "micro_batch_size must be a whole number >= 1"),
    ({"adapter": "lora", "lora_target_modules": [1, 2]}, "must be a list of module names"),
])
def test_bad_values_are_one_line_errors(fields, message):
    with pytest.raises(UserError, match=message):
        map_config({"base_model": "org/model", **fields}, "c.yml", CARD)


def test_no_base_model():
    with pytest.raises(UserError, match="no base_model"):
        map_config({"adapter": "lora"}, "c.yml", CARD)


def test_bf16_auto_follows_the_card_and_an_adapter_stays_fp32():
    """axolotl loads the model in bf16; with an adapter, peft keeps it in fp32 (bf16-base)."""
    assert map_config({"base_model": "m", "bf16": "auto"}, "c", CARD).plan.precision == "bf16-pure"
    assert map_config({"base_model": "m", "bf16": True, "adapter": "lora"}, "c", CARD).plan.precision == "bf16-base"
    assert map_config({"base_model": "m", "bf16": "auto"}, "c", get_device("t4")).plan.precision == "fp16"
    assert map_config({"base_model": "m", "fp16": True}, "c", CARD).plan.precision == "fp16"
    assert map_config({"base_model": "m", "fp16": True, "adapter": "lora"}, "c", CARD).plan.precision == "fp16-base"


def test_the_run_around_the_step_is_ignored_in_silence():
    fields = {key: 1 for key in NO_MEMORY_EFFECT}
    assert map_config({"base_model": "m", **fields}, "c", CARD).warnings == ()


def test_dora_save_and_compile():
    c = map_config({"base_model": "m", "adapter": "lora", "lora_r": 4, "peft_use_dora": True,
                    "lora_modules_to_save": ["lm_head"], "torch_compile": True, "max_grad_norm": 1.0,
                    "gradient_checkpointing": True}, "c", CARD)
    assert c.plan == Plan(adapter="dora:r=4,save=lm_head", compile="full", max_grad_norm=1.0, checkpointing="blocks")
    assert c.warnings == ()


@pytest.mark.parametrize("fields,warned", [
    ({"gradient_checkpointing": "offload"}, False),  # (axolotl's deprecated spelling of activation_offloading: true)
    ({"gradient_checkpointing": True, "activation_offloading": True}, False),
    ({"gradient_checkpointing": True, "activation_offloading": "legacy"}, False),  # (Unsloth's)
    ({"gradient_checkpointing": True, "activation_offloading": "hidden_states"}, False),
    ({"gradient_checkpointing": "offload_disk"}, True),
])
def test_activation_offloading_holds_each_checkpointed_layers_input_on_the_host(fields, warned):
    """Before, ``gradient_checkpointing: offload`` was block checkpointing on the device with a warning, and
    ``activation_offloading`` a field "not mapped": each layer's input was predicted on the card."""
    c = map_config({"base_model": "m", "adapter": "lora", **fields}, "c", CARD)
    assert (c.plan.checkpointing, c.plan.offload) == ("blocks", ("activations",))
    assert bool(c.warnings) == warned and all("disk is predicted as held in host memory" in w for w in c.warnings)


@pytest.mark.parametrize("kwargs,extra,checkpointing,warned", [
    (None, {}, "blocks", False),  # (axolotl's default: use_reentrant false)
    ({"use_reentrant": True}, {}, "blocks:reentrant=true", False),
    ({"use_reentrant": False}, {}, "blocks", False),
    ({"preserve_rng_state": True}, {}, "blocks:reentrant=true", False),  # (no use_reentrant: torch's default)
    ({"use_reentrant": True}, {"torch_compile": True}, "blocks", True),
    ({"use_reentrant": True}, {"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}}, "blocks", True),
])
def test_gradient_checkpointing_kwargs_choose_torchs_checkpoint(kwargs, extra, checkpointing, warned):
    """``gradient_checkpointing_kwargs`` go to the Trainer as they are: ``use_reentrant: true`` (or no
    ``use_reentrant``: torch's default) is the reentrant checkpoint, which memfit runs unless torch.compile or FSDP
    is on (then the non-reentrant one, said in a line)."""
    fields = {"base_model": "m", "adapter": "lora", "gradient_checkpointing": True, **extra,
              **({"gradient_checkpointing_kwargs": kwargs} if kwargs else {})}
    c = map_config(fields, "c", CARD)
    assert c.plan.checkpointing == checkpointing
    assert [w for w in c.warnings if "reentrant" in w] == (["axolotl config c: the reentrant checkpoint beside "
        "torch.compile or FSDP is predicted as the non-reentrant one, which memfit runs with them (the reentrant one's "
        "first input gradient, one hidden state, is left out)"] if warned else [])


@pytest.mark.parametrize("fields,message", [
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": "yes"}},
     "gradient_checkpointing_kwargs: .* is not a mapping with use_reentrant: true or false"),
    ({"activation_offloading": True}, "activation_offloading needs gradient_checkpointing"),
    ({"gradient_checkpointing": "unsloth"}, "gradient_checkpointing: 'unsloth' is not axolotl's"),
    ({"gradient_checkpointing": True, "activation_offloading": "cpu"}, "activation_offloading: 'cpu' is not axolotl's"),
])
def test_checkpointing_values_axolotl_refuses_are_one_line(fields, message):
    from memfit.errors import UserError
    with pytest.raises(UserError, match=message):
        map_config({"base_model": "m", **fields}, "c", CARD)


@pytest.mark.parametrize("spec", ["configs/qlora.yml", "configs/qlora.yaml:base_model=x", "acme/qlora.yml:n_layer=2"])
def test_an_axolotl_config_given_as_the_workload_says_to_read_it_with_from(spec):
    from memfit.errors import UserError
    from memfit.workloads import load_workload
    with pytest.raises(UserError, match=r"is not a workload; an axolotl config is read with --from"):
        load_workload(spec)


def test_a_file_that_is_not_yaml_says_where(tmp_path):
    """PyYAML's first line (``while parsing a block mapping``) named neither the line nor the problem."""
    broken = tmp_path / "broken.yml"
    broken.write_text('base_model: "NousResearch/Llama-2-7b-hf\nadapter: "qlora"\n')
    with pytest.raises(UserError, match=r"not valid YAML at line 2, column 11: expected <block end>, but found "
                                        r"'<scalar>'; fix the file$"):
        read_config(broken, CARD)


def test_torchaos_optimizers_by_their_trainer_names():
    """axolotl's 3b-qat-mxfp4 example names ``adamw_torch_8bit`` (TrainingArguments' torchao AdamW8bit): refused before."""
    for name, ours in (("adamw_torch_8bit", "adamw8bit-ao"), ("adamw_torch_4bit", "adamw4bit-ao")):
        c = map_config({"base_model": "m", "optimizer": name}, "c.yml", CARD)
        assert c.plan.optimizer == ours


def test_ligers_fused_cross_entropy_is_a_chunked_loss_said():
    """axolotl's llama-3 FSDP examples set it: the [tokens, vocab] logits never whole (it was ignored, not mapped)."""
    c = map_config({"base_model": "m", "liger_fused_linear_cross_entropy": True}, "c.yml", CARD)
    assert c.plan.loss_chunks == 8 and any("liger_fused_linear_cross_entropy predicted as" in w for w in c.warnings)


@pytest.mark.parametrize("width,vocab,micro,seq,chunks", [
    (4096, 32000, 4, 4096, 8),  # (Liger-Kernel's own example: BT 4096*4, V 32000, H 4096: slices of 2048 tokens)
    (3072, 128256, 16, 8192, 32),  # (axolotl's llama-3/3b-qat-fsdp2.yaml on Llama-3.2-3B: slices of 4096 tokens)
    (3584, 152064, 1, 4096, 32),  # (Qwen2.5-7B: 128-token slices)
    (4096, 256, 1, 100, 1),  # (a vocabulary narrower than the width: one slice of all the tokens)
])
def test_ligers_slices_are_its_own_for_the_models_width_and_vocabulary(tmp_path, width, vocab, micro, seq, chunks):
    """Liger sizes its slices so that one slice's logits are about the hidden states' size; 8 slices for
    Llama-3.2-3B at 16 x 8192 tokens held logits 4x those of Liger's 32 (8.4 GB a slice in fp32)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": width, "vocab_size": vocab}))
    c = map_config({"base_model": str(tmp_path), "liger_fused_linear_cross_entropy": True, "micro_batch_size": micro,
                    "sequence_len": seq}, "c.yml", CARD)
    assert c.plan.loss_chunks == chunks and any(f"in Liger's {chunks} slices" in w for w in c.warnings)


def test_lora_target_linear_adapts_what_axolotl_adapts_on_a_mixture_of_experts(tmp_path):
    """axolotl's ``lora_target_linear`` takes the names of the modules whose class is a linear layer's
    (``find_all_linear_names``); PEFT's ``all-linear``, which it was read as, also adapts a transformers Mixtral's
    router and fused experts (and PEFT then refuses a dropout there: two of axolotl's Mixtral examples failed so)."""
    from memfit.plans import Plan
    from memfit.step import build_step
    from memfit.workloads import load_workload
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}))
    c = map_config({"base_model": str(tmp_path), "adapter": "lora", "lora_r": 4, "lora_dropout": 0.05,
                    "lora_target_linear": True}, "c.yml", CARD)
    assert c.plan.adapter == "lora:r=4,targets=linear-modules,dropout=0.05"
    step = build_step(load_workload(str(tmp_path), seq_len=16), Plan(adapter=c.plan.adapter), 2, "cpu")
    adapted = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n, _ in step.model.named_modules() if n.endswith("lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_the_attention_field_and_the_cut_cross_entropy_plugin_axolotls_examples_set(tmp_path):
    """``attn_implementation: flash_attention_2`` (220 of axolotl's 250 example configs set the field) was warned as not
    mapped in most configs; Cut Cross-Entropy's plugin (70 of them) was ignored with a warning, and the whole logits
    predicted. Now a fused kernel is what memfit predicts, in silence; CCE is memfit's chunked loss in Liger's slices,
    said; gpt-oss's dequantized MXFP4 is the bf16 model memfit plans; the fields of the run around the step are silent."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 2048, "vocab_size": 128256}))
    base = {"base_model": str(tmp_path), "micro_batch_size": 1, "sequence_len": 4096, "eot_tokens": ["<|end|>"],
            "model_quantization_config": "Mxfp4Config", "model_quantization_config_kwargs": {"dequantize": True}}
    for value in ("flash_attention_2", "sdpa", "kernels-community/vllm-flash-attn3"):
        c = map_config({**base, "attn_implementation": value}, "c.yml", CARD)
        assert c.warnings == () and c.plan.loss_chunks == 0
    cce = map_config({**base, "plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"]}, "c.yml", CARD)
    assert cce.plan.loss_chunks == 32  # (Liger's: the power of two over 4,096 / ceil(128,256 / 2,048) = 66 tokens)
    assert [w.split(": ", 1)[1] for w in cce.warnings] == [
        "Cut Cross-Entropy predicted as memfit's chunked loss in 32 slices of the micro-batch's tokens, each slice's "
        "logits about the hidden states' size: CCE holds no slice's logits, so the prediction is higher by about one "
        "slice's"]
    off = map_config({**base, "plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"],
                      "cut_cross_entropy": False}, "c.yml", CARD)
    assert off.plan.loss_chunks == 0 and off.warnings == ()
    other = map_config({"base_model": "m", "attn_implementation": "eager", "plugins": ["my.Plugin"],
                        "model_quantization_config": "Mxfp4Config"}, "c.yml", CARD)
    assert [w.split(": ", 1)[1] for w in other.warnings] == [
        "attn_implementation eager is not mapped; the estimate predicts the model's attention with SDPA's fused kernels",
        "plugin my.Plugin is not mapped; the estimate ignores it",
        "model_quantization_config Mxfp4Config is not mapped; the estimate ignores it"]
    with pytest.raises(UserError, match="plugins is a list of plugin class paths"):
        map_config({"base_model": "m", "plugins": "my.Plugin"}, "c.yml", CARD)
