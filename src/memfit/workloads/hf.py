"""Hugging Face workloads built from config classes only (no weights, no tokenizer, no network):
the built-in architectures by name, and a local model folder from its config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from memfit.errors import UserError, brief
from memfit.workload import Workload, WorkloadInfo
from memfit.workloads import diffusers_folders, image_text, timm_folders
from memfit.workloads.checkpoint_formats import checkpoint_format, trained_dequantized
from memfit.workloads.checks import check_value, describe, simple_types, split_resolution, width_said_as_given
from memfit.workloads.config_overrides import apply_overrides
from memfit.workloads.speech import encoder_batch, speech_batch


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


def _classified_batch(task: str, config, vocab: int, seq: int):
    """Tokens and one label a sequence (a reward model, ``num_labels`` 1: a score) or a token."""
    if task == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        # A decoder finds each sequence's last token by its padding, and refuses a batch without a pad
        # token: trainers set the tokenizer's (TRL's RewardTrainer: model.config.pad_token_id). No bytes change.
        config.pad_token_id = vocab - 1
    classes = config.num_labels

    def batch(batch_size: int):
        shape = (batch_size,) if task == "sequence-classification" else (batch_size, seq)
        labels = torch.randn(shape) if classes == 1 else torch.randint(0, classes, shape)
        return {"input_ids": torch.randint(0, vocab, (batch_size, seq)), "labels": labels}
    return batch


def _hf_loss(model, batch):
    return model(**batch).loss


_TARGETS = {"seq2seq-lm": " in, as many label tokens out", "sequence-classification": " and one label",
            "token-classification": " and a label each"}
PAIRED = ("clip", "siglip", "metaclip_2")
"""Image-text models trained on pairs with their own contrastive loss (``return_loss=True``): CLIP's
softmax over the batch's pairs, SigLIP's sigmoid over each pair."""


def _pairs_batch(model_type: str, config, seq_len: int | None, where: str):
    """(batch, caption tokens, text vocabulary) of an image-text model: a batch of matching pairs."""
    if model_type not in PAIRED:
        raise UserError(f"{where}: memfit feeds image-text pairs to {', '.join(PAIRED)} models, not {model_type!r} "
                        "(its processor's own inputs); write a file workload (path/to/file.py:NAME) that builds it")
    text, vision = config.text_config, config.vision_config
    limit = text.max_position_embeddings
    seq = seq_len or limit
    if seq > limit:
        raise UserError(f"{where}: --seq-len {seq} exceeds the text encoder's max_position_embeddings={limit}; "
                        f"use --seq-len <= {limit}")
    size = vision.image_size

    def batch(batch_size: int):
        return {"input_ids": torch.randint(0, text.vocab_size, (batch_size, seq)),
                "pixel_values": torch.randn(batch_size, vision.num_channels, size, size)}
    return batch, seq, text.vocab_size


def _contrastive_loss(model, batch):
    return model(**batch, return_loss=True).loss


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


# -- local model folders ------------------------------------------------------------------------
# NOTE [ Model folders ]: ``memfit estimate ./Llama-3-8B`` builds the model that folder's
# config.json describes, with transformers' own config and model classes, exactly as the built-ins
# above are built (``ModelClass(config)``, default dtype, no KV cache): its weights are never read
# and nothing is fetched (``local_files_only``), so a downloaded config.json alone is enough. The
# head follows the config's ``architectures`` (else the model type's first of the tasks below) and
# decides the synthetic batch, as the built-ins' do. The config's dtype is not used: the plan's
# precision decides (bf16-pure for bf16 weights).

# (task, the name of transformers' Auto mapping of model_type -> model class name)
_TASKS = (("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
          ("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),  # NOTE [ Synthetic audio ]
          ("ctc", "MODEL_FOR_CTC_MAPPING_NAMES"),  # (speech encoders: NOTE [ Synthetic audio ])
          ("audio-classification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
          ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
          ("image-text-to-text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),  # NOTE [ Image-text batches ]
          ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
          ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
          ("contrastive", "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES"),  # CLIP, SigLIP: image-text pairs
          ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),  # (also reward models)
          ("token-classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"))
_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
FOLDER_SEQ_LEN = 2048
"""A folder's default sequence length: its position limit, capped here (long-context configs
would otherwise be estimated at 128k tokens); ``--seq-len`` sets another."""
NO_POSITION_LIMIT_SEQ_LEN = 512  # configs without a position limit (relative positions, as T5's built-in)


def folder(path_text: str, seq_len: int | None, *, name: str | None = None, where: str | None = None,
           resolution: int | None = None, overrides: dict | None = None) -> Workload:
    """The workload of a local Hugging Face model folder (or its config.json): see NOTE [ Model folders ].
    ``name`` and ``where`` name it in reports and errors (a hub id's snapshot: the id, not the cache path).
    A diffusers pipeline or denoiser folder is built by memfit.workloads.diffusers_folders (``resolution``).
    ``overrides``: config.json fields to change (NOTE [ Overrides of a config.json ])."""
    path = Path(path_text).expanduser()
    where = where or f"model folder {path_text}"
    if path.is_file() and path.name == "config.json":
        path = path.parent
    elif not path.exists():
        raise UserError(f"{where} not found; give a folder holding config.json, or a hub id as org/name")
    elif not path.is_dir():
        raise UserError(f"{where} is a file, not a folder; give the folder that holds config.json")
    root, path = path, diffusers_folders.pipeline_denoiser(path, where) or path
    data = _read_config_json(path, where)
    clip = diffusers_folders.size_overrides(data, overrides)  # (an image's width=, a Wan clip's frames=: not config fields)
    if clip and name and ":" in name:  # (the name says the sizes after it: dit-wan's "832x480px 33 frames")
        head, _, text = name.rpartition(":")
        rest = [kv for kv in text.split(",") if kv.split("=", 1)[0].strip() not in clip]
        name = f"{head}:{','.join(rest)}" if rest else head
    data = apply_overrides(data, {k: v for k, v in (overrides or {}).items() if k not in clip}, where)
    given, given_clip = resolution, dict(clip)
    if isinstance(resolution, tuple) and diffusers_folders.is_diffusers_config(data):
        resolution, clip = split_resolution(resolution, clip, where)  # NOTE [ A resolution's width ]
    if resolution == image_text.TEXT_ONLY and (diffusers_folders.is_diffusers_config(data) or
                                                timm_folders.is_timm_config(data)):
        raise UserError(f"{where}: --resolution 0 (text only) applies to vision-language models; give the "
                        "image's side in pixels")
    if diffusers_folders.is_diffusers_config(data):
        with width_said_as_given(given, given_clip):
            return diffusers_folders.diffusers_workload(data, name or path_text, where, seq_len, resolution, clip,
                                                        diffusers_folders.pipeline_of(root, path))
    if timm_folders.is_timm_config(data):
        return timm_folders.timm_workload(data, name or path_text, where, seq_len, resolution)
    tf = _transformers()
    config = _folder_config(tf, path, data, where, overridden=bool(overrides))
    task, cls = _folder_model_class(tf, config, data, where)
    if resolution is not None and task != "image-text-to-text":
        raise UserError(f"{where}: --resolution applies to image models (diffusers' denoisers, timm's classifiers, "
                        "vision-language models); a transformers model takes --seq-len (an image classifier: "
                        "image_size in its config.json)")
    for c in image_text.config_and_text(config):
        c.use_cache = False  # training: no KV cache (a multimodal model's language model reads its own config's)
    model_type = data["model_type"]
    split = text_only = None  # (set where a vision-language model's samples hold an image: NOTE [ Image-text batches ])
    if task == "image-classification":
        if seq_len is not None:
            raise UserError(f"{where}: --seq-len does not apply to an image model; set image_size in its config.json")
        size = getattr(config, "image_size", 224)
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        channels, labels = getattr(config, "num_channels", 3), config.num_labels

        def batch(batch_size: int):
            return {"pixel_values": torch.randn(batch_size, channels, height, width),
                    "labels": torch.randint(0, labels, (batch_size,))}
        seq, vocab = None, None
        sample = f"a {height}x{width} image and its class"
    elif task == "speech-seq2seq":
        batch, seq, audio = speech_batch(model_type, config, seq_len, FOLDER_SEQ_LEN, where)
        sample = f"{audio} and {seq} label tokens"
        vocab = config.vocab_size
    elif task == "contrastive":
        batch, seq, vocab = _pairs_batch(model_type, config, seq_len, where)
        size = config.vision_config.image_size
        sample = f"a {size}x{size} image and its {seq}-token caption (a matching pair)"
    elif task in ("ctc", "audio-classification"):
        batch, seq, audio = encoder_batch(task, model_type, cls, config, seq_len, where)
        sample = f"{audio} and " + (f"{seq} CTC labels" if task == "ctc" else "its class")
        vocab = config.vocab_size if task == "ctc" else None
    else:
        text = image_text.language_config(config)  # (multimodal: its LM)
        vocab = getattr(text, "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 1:
            raise UserError(f"{where}: config.json has no vocab_size for the token batch; add \"vocab_size\": N")
        named = sorted(_POSITION_FIELDS, key=lambda f: f not in data)  # the file's own name for it first
        field, limit = next(((f, v) for f in named
                             if isinstance(v := getattr(text, f, None), int) and v > 0), (None, None))
        seq = seq_len or (min(limit, FOLDER_SEQ_LEN) if limit else NO_POSITION_LIMIT_SEQ_LEN)
        if limit is not None and seq > limit:
            raise UserError(f"{where}: --seq-len {seq} exceeds config.json's {field}={limit}; "
                            f"use --seq-len <= {limit} or raise {field} in config.json")
        batch = _classified_batch(task, config, vocab, seq) if task.endswith("classification") else _lm_batch(vocab, seq)
        sample = f"{seq} tokens" + _TARGETS.get(task, "")
        if task == "image-text-to-text":  # NOTE [ Image-text batches ]
            batch, sample, split, text_only = image_text.with_images(cls, config, path, seq, vocab, resolution,
                                                                     where, batch, sample)
        elif getattr(config, "vision_config", None) is not None:  # (a vision-language model fed its LM's input)
            sample += "; text only: no image is fed, so the vision encoder's weights count and its activations do not"
    sizes = {k: v for k in ("num_hidden_layers", "hidden_size") if isinstance(v := getattr(config, k, None), int)}
    dequantized = trained_dequantized(data)
    quantized = checkpoint_format(data, where)
    if quantized is not None or dequantized:
        config.quantization_config = None  # memfit's base_weights quantizes (transformers' own would at from_pretrained)
    images = split is not None
    loss = _contrastive_loss if task == "contrastive" else image_text.image_text_loss if images else _hf_loss
    if text_only:
        loss = image_text.fed_text_only(loss, text_only, where)
    return Workload(model=lambda: cls(config), batch=batch, loss=loss, split=split,
                    name=name or path_text,
                    default_batch_size=1 if task in ("causal-lm", "image-text-to-text") else 8,
                    info=WorkloadInfo(arch=model_type, text_lm=task in ("causal-lm", "image-text-to-text") and not images,
                                      seq_len=seq, vocab_size=vocab,
                                      sample=sample,
                                      coupled_samples=f"{cls.__name__}'s contrastive loss compares each image-text "
                                      "pair with every other pair of the batch" if task == "contrastive" else None,
                                      config={"model_class": cls.__name__, **sizes}, quantized=quantized,
                                      loaded=dequantized))


def _read_config_json(path: Path, where: str) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise UserError(f"{where} has no config.json; give the folder a Hugging Face model was saved to "
                        "(config.json is enough, no weights are read)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: config.json is not valid JSON ({brief(e, 120)}); fix the file or download "
                        "it again") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: config.json holds a {type(data).__name__}, not a JSON object; download it again")
    if diffusers_folders.is_diffusers_config(data) or timm_folders.is_timm_config(data):
        return data
    if not isinstance(data.get("model_type"), str) or not data["model_type"]:
        raise UserError(f"{where}: config.json has no model_type; add the architecture's name, "
                        "e.g. \"model_type\": \"llama\"")
    return data


def _folder_config(tf, path: Path, data: dict, where: str, overridden: bool = False):
    """The folder's config; ``overridden``: built from ``data``, the config.json with the user's overrides
    (as from_pretrained builds it from the file's: fields the class derives follow them)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    model_type = data["model_type"]
    if model_type not in CONFIG_MAPPING_NAMES:
        custom = " (its auto_map names custom code, which memfit does not run)" if "auto_map" in data else ""
        raise UserError(f"{where}: transformers {tf.__version__} does not know model_type {model_type!r}{custom}; "
                        "upgrade transformers, or write a file workload (path/to/file.py:NAME) that builds it")
    try:
        if overridden:
            return CONFIG_MAPPING[model_type].from_dict(data)
        return tf.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the config class refuses is the file's (or the overrides') fault
        fix = "change the overrides" if overridden else "fix the file or download it again"
        raise UserError(f"{where}: transformers cannot read its config.json ({type(e).__name__}: {brief(e, 160)}); "
                        f"{fix}") from None


def _takes(cls, config) -> bool:
    """Whether model class ``cls`` is built from ``config`` (a model type's class for one task may take only
    a part of its config: MusicGen's ``MusicgenForCausalLM`` its decoder's, not the whole ``MusicgenConfig``)."""
    wanted = getattr(cls, "config_class", None)
    return cls is not None and (not isinstance(wanted, type) or isinstance(config, wanted))


def _first(names) -> str | None:
    """A task mapping's class for a model type: its one name, or the first of several (DeiT's classifier before
    its distilled head ``...WithTeacher``, which trains on no labels)."""
    return names if isinstance(names, str) else next((n for n in names or () if isinstance(n, str)), None)


def _folder_model_class(tf, config, data: dict, where: str):
    """(task, model class): the config's ``architectures`` if it names one memfit can feed, else the
    model type's class for the first task of :data:`_TASKS` that has one."""
    from transformers.models.auto import modeling_auto
    tasks = [(task, {k: _first(v) for k, v in getattr(modeling_auto, names, {}).items() if _first(v)})
             for task, names in _TASKS]
    model_type = data["model_type"]
    fallback = next(((task, m[model_type]) for task, m in tasks if model_type in m
                     and _takes(getattr(tf, m[model_type], None), config)), None)
    feeds = ("causal LM, vision-language, seq2seq LM, speech seq2seq, CTC, audio-classification, masked LM, image-classification, "
             "image-text contrastive, sequence-classification and token-classification heads")
    for name in data.get("architectures") or ():
        task = next((task for task, m in tasks if name in m.values()), None)
        if task is not None and hasattr(tf, name):
            return task, getattr(tf, name)
        fix = (f"set \"architectures\": [\"{fallback[1]}\"]" if fallback else
               "write a file workload (path/to/file.py:NAME) that builds it")
        if not hasattr(tf, name):
            raise UserError(f"{where}: transformers {tf.__version__} has no class {name} (config.json's "
                            f"architectures); upgrade transformers or {fix}")
        raise UserError(f"{where}: config.json's architectures names {name}, a head memfit cannot feed a synthetic "
                        f"batch to (it builds {feeds}); {fix}")
    partial = next((getattr(tf, m[model_type], None) for _, m in tasks if model_type in m), None)
    if fallback is None and partial is not None:
        raise UserError(f"{where}: transformers' {partial.__name__} for model_type {model_type!r} is built from a "
                        f"part of its config ({partial.config_class.__name__}), and memfit builds no head of the "
                        f"whole; write a file workload (path/to/file.py:NAME) that builds the model")
    if fallback is None:
        raise UserError(f"{where}: transformers has no {feeds.replace(' and ', ' or ')} for model_type "
                        f"{model_type!r}; write a file workload (path/to/file.py:NAME) that builds the model")
    return fallback[0], getattr(tf, fallback[1])
