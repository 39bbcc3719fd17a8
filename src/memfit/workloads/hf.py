"""Hugging Face workloads built from config classes only (no weights, no tokenizer, no network)."""

from __future__ import annotations

import torch

from memfit.errors import UserError, brief
from memfit.workload import Workload, WorkloadInfo
from memfit.workloads.checks import check_value, describe, simple_types


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("built-in Hugging Face workloads need transformers; install it with "
                        "pip install 'memfit[hf]' (or pip install transformers)") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _config(cls_name: str, arch: str, overrides: dict, defaults: dict | None = None):
    """The config class with the user's overrides. Each override is checked on its own (field and
    type, named in the error), then the config is built with them all: fields a config derives in
    its constructor (LlamaConfig's ``head_dim = hidden_size // num_attention_heads``) follow the
    overrides, as they do for a config.json."""
    tf = _transformers()
    cls = getattr(tf, cls_name)
    config = cls(**(defaults or {}))
    values = {}
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise UserError(f"{arch}: {cls_name} has no field {key!r}; see transformers' {cls_name} for valid names")
        default = getattr(config, key)
        allowed = _field_types(cls, key, default)
        if allowed is not None:
            value = check_value(arch, key, value, allowed, example=default)
        try:  # transformers 5.x validates fields itself (StrictDataclassFieldValidationError)
            setattr(config, key, value)
        except Exception as e:  # noqa: BLE001 - whatever the config class refuses is the override's fault
            detail = brief(e, 160)
            example = f", e.g. {arch}:{key}={default}" if isinstance(default, (int, float, str)) else ""
            raise UserError(f"{arch}: {cls_name} refuses {key}={value!r} ({detail}); "
                            f"give a value of the field's type{example}") from None
        values[key] = value
    if values:
        try:
            config = cls(**{**(defaults or {}), **values})
        except Exception as e:  # noqa: BLE001 - values each valid, refused together: the overrides' fault
            raise UserError(f"{arch}: {cls_name} refuses {describe(values)} ({brief(e, 160)}); "
                            "change the overrides") from None
    config.use_cache = False  # training: no KV cache
    return config


def _field_types(cls, key: str, default) -> tuple[type, ...] | None:
    """The plain types config field ``key`` takes: its dataclass annotation (transformers 5.x), else
    the type of its default value (4.x); None when unknown or not a plain type (then unchecked)."""
    import dataclasses
    if dataclasses.is_dataclass(cls):
        field = next((f for f in dataclasses.fields(cls) if f.name == key), None)
        if field is not None:
            return simple_types(field.type)
    if isinstance(default, bool):
        return (bool,)
    if isinstance(default, (int, float, str)):
        return (type(default),)
    return None


def _lm_batch(vocab: int, seq_len: int, with_labels_key: str = "labels"):
    def batch(batch_size: int):
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        return {"input_ids": ids, with_labels_key: ids.clone()}
    return batch


def _hf_loss(model, batch):
    return model(**batch).loss


def _check_seq(arch: str, seq_len: int, limit: int | None, field: str) -> None:
    if limit is not None and seq_len > limit:
        raise UserError(f"{arch}: --seq-len {seq_len} exceeds the model's {field}={limit}; "
                        f"use --seq-len <= {limit} or override {arch}:{field}={seq_len}")


def gpt2(overrides: dict, seq_len: int | None) -> Workload:
    config = _config("GPT2Config", "gpt2", overrides)
    seq = seq_len or config.n_positions
    _check_seq("gpt2", seq, config.n_positions, "n_positions")
    tf = _transformers()
    return Workload(model=lambda: tf.GPT2LMHeadModel(config), batch=_lm_batch(config.vocab_size, seq),
                    loss=_hf_loss, name="gpt2", default_batch_size=8,
                    info=WorkloadInfo(arch="gpt2", text_lm=True, seq_len=seq, vocab_size=config.vocab_size,
                                      config={"n_layer": config.n_layer, "n_embd": config.n_embd}))


def llama(overrides: dict, seq_len: int | None) -> Workload:
    # transformers' LlamaConfig defaults are the Llama-2-7B sizes.
    config = _config("LlamaConfig", "llama", overrides)
    seq = seq_len or config.max_position_embeddings
    tf = _transformers()
    return Workload(model=lambda: tf.LlamaForCausalLM(config), batch=_lm_batch(config.vocab_size, seq),
                    loss=_hf_loss, name="llama", default_batch_size=1,
                    info=WorkloadInfo(arch="llama", text_lm=True, seq_len=seq, vocab_size=config.vocab_size,
                                      config={"layers": config.num_hidden_layers, "hidden": config.hidden_size}))


def bert(overrides: dict, seq_len: int | None) -> Workload:
    config = _config("BertConfig", "bert", overrides)
    seq = seq_len or config.max_position_embeddings
    _check_seq("bert", seq, config.max_position_embeddings, "max_position_embeddings")
    tf = _transformers()
    return Workload(model=lambda: tf.BertForMaskedLM(config), batch=_lm_batch(config.vocab_size, seq),
                    loss=_hf_loss, name="bert", default_batch_size=8,
                    info=WorkloadInfo(arch="bert", seq_len=seq, config={"layers": config.num_hidden_layers}))


def t5(overrides: dict, seq_len: int | None) -> Workload:
    config = _config("T5Config", "t5", overrides,  # defaults: t5-small sizes
                     defaults={"decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1})
    seq = seq_len or 512
    tf = _transformers()
    return Workload(model=lambda: tf.T5ForConditionalGeneration(config), batch=_lm_batch(config.vocab_size, seq),
                    loss=_hf_loss, name="t5", default_batch_size=8,
                    info=WorkloadInfo(arch="t5", seq_len=seq,
                                      config={"layers": config.num_layers, "d_model": config.d_model}))


def vit(overrides: dict, seq_len: int | None) -> Workload:
    if seq_len is not None:
        raise UserError("vit: --seq-len does not apply to an image model; override vit:image_size=N instead")
    config = _config("ViTConfig", "vit", overrides, defaults={"num_labels": 1000})
    tf = _transformers()

    def batch(batch_size: int):
        return {"pixel_values": torch.randn(batch_size, config.num_channels, config.image_size, config.image_size),
                "labels": torch.randint(0, config.num_labels, (batch_size,))}
    return Workload(model=lambda: tf.ViTForImageClassification(config), batch=batch, loss=_hf_loss,
                    name="vit", default_batch_size=8,
                    info=WorkloadInfo(arch="vit", config={"image_size": config.image_size,
                                                          "layers": config.num_hidden_layers}))


BUILDERS = {
    "gpt2": (gpt2, "GPT-2 causal LM (GPT2Config; default 124M, seq 1024)"),
    "llama": (llama, "Llama causal LM (LlamaConfig; default Llama-2-7B sizes, seq 2048)"),
    "bert": (bert, "BERT masked LM (BertConfig; default bert-base, seq 512)"),
    "t5": (t5, "T5 encoder-decoder (T5Config; default t5-small, seq 512)"),
    "vit": (vit, "ViT image classifier (ViTConfig; default ViT-B/16, 224px)"),
}
