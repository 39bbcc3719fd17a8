"""A Hugging Face checkpoint's stored format (config.json's ``quantization_config``) as memfit plans it.

bitsandbytes' formats are the plan's ``base_weights`` (``nf4``, ``fp4``, ``int8``): the checkpoint loads in them,
and every plan keeps them. A format transformers trains only dequantized (gpt-oss's MXFP4, compressed-tensors) is
the full-precision model (NOTE [ Checkpoints trained dequantized ]). A fine-grained FP8 checkpoint (Qwen3's and
DeepSeek's ``-FP8`` releases) is ``fp8`` on the cards whose FP8 kernels transformers runs, and the full-precision
model on the others (NOTE [ FP8 checkpoints by card ]). Any other format is one line naming the modelled format of
its size.
"""

from __future__ import annotations

from memfit.errors import UserError

# NOTE [ Checkpoints trained dequantized ]
# A pre-quantized format whose weights transformers cannot train is trained dequantized: gpt-oss ships its
# experts in MXFP4, and transformers refuses to train them so ("MXFP4 quantization don't support training,
# please consider dequantizing the model first by passing quantization_config=Mxfp4Config(dequantize=True)"),
# which OpenAI's and TRL's fine-tuning recipes do: the weights arrive in bf16. So such a checkpoint is the
# full-precision model here (its weights in the plan's precision: bf16-pure or bf16-base for bf16), and the
# report says so; refusing it, or planning it with a 4-bit stand-in, answered a question nobody runs.
# compressed-tensors (llm-compressor's FP8, INT8 and packed INT4 checkpoints) is alike: transformers' FP8 kernel
# path is "inference-only; load with `dequantize=True` to fine-tune", and its other path decompresses the weights
# on the first forward.
DEQUANTIZED_TO_TRAIN = {"mxfp4": "Mxfp4Config(dequantize=True)",
                        "compressed-tensors": "CompressedTensorsConfig(dequantize=True)"}
"""Pre-quantized formats transformers trains only dequantized -> the load argument that dequantizes them."""
FP8 = "fp8"
"""transformers' fine-grained FP8 format (``FineGrainedFP8Config``: float8 e4m3 weights, a scale per 128 x 128 block)."""
FP8_FROM = (8, 9)
"""The least compute capability whose FP8 kernels transformers runs a fine-grained FP8 checkpoint with."""


def trained_dequantized(data: dict) -> str | None:
    """How a checkpoint stored in a format transformers cannot train is loaded to train it, in words, or None
    (NOTE [ Checkpoints trained dequantized ]; a fine-grained FP8 one: NOTE [ FP8 checkpoints by card ])."""
    q = data.get("quantization_config")
    method = str(q.get("quant_method")) if isinstance(q, dict) else None
    if method == FP8:
        return (f"checkpoint: its weights are stored in FP8 (float8 e4m3, a scale per block); on cards of compute "
                f"capability {FP8_FROM[0]}.{FP8_FROM[1]} or later transformers keeps them so (its FP8Linear), planned "
                "as base_weights fp8 (memfit's float8 layer: the same byte a weight, upcast per matmul); on earlier "
                "cards it dequantizes them to bf16 as it loads, planned so"
                + ("" if not q.get("dequantize") else "; this config.json dequantizes them on every card"))
    if method not in DEQUANTIZED_TO_TRAIN:
        return None
    return (f"checkpoint: its weights are stored in {method.upper()}, which transformers does not train; planned "
            f"dequantized to bf16 as loaded with quantization_config={DEQUANTIZED_TO_TRAIN[method]} (the weights' "
            "precision is the plan's: bf16-pure or bf16-base keep them in bf16)")


# NOTE [ FP8 checkpoints by card ]
# A fine-grained FP8 checkpoint (``"quant_method": "fp8"``: Qwen3-*-FP8, DeepSeek-V3) is trainable in transformers
# with an adapter: its FP8Linear keeps the float8 weights and their block scales, quantizes each input to float8
# for a Triton block matmul in forward, and dequantizes the weight to bf16 for the input's gradient in backward. It
# does so where it finds FP8 kernels, a card of compute capability 8.9 or later (RTX 4090, L40S, H100); on an
# earlier card (A100, RTX 3090) it dequantizes the checkpoint to bf16 as it loads. So the format depends on the
# card (:func:`format_on`): ``fp8`` on the first, the full-precision model on the second. memfit's ``fp8`` layer
# stands in for FP8Linear: the same byte a weight (a scale per row for one per 128 x 128 block: 1/32 of a byte a
# weight at 128 columns, against 1/4096), the same weight-sized bf16 temporary in backward; in forward it upcasts
# the weight where FP8Linear quantizes the input, a temporary of the weight's size in place of the input's.
def by_card(fmt: str | None) -> bool:
    """Whether a checkpoint stored as ``fmt`` (:func:`checkpoint_format`) loads in a format the card decides: a
    fine-grained FP8 one (NOTE [ FP8 checkpoints by card ])."""
    return fmt == FP8


def format_on(fmt: str | None, device) -> str | None:
    """The ``base_weights`` a checkpoint stored as ``fmt`` loads in on ``device`` (NOTE [ FP8 checkpoints by card ]):
    a fine-grained FP8 one is fp8 only on a card whose FP8 kernels transformers runs, else full precision."""
    if not by_card(fmt):
        return fmt
    capability = getattr(device, "compute_capability", None) if device is not None and device.is_gpu else None
    return fmt if capability is not None and tuple(capability) >= FP8_FROM else None


def checkpoint_format(data: dict, where: str) -> str | None:
    """The ``base_weights`` value of a pre-quantized checkpoint (config.json's ``quantization_config``),
    None for a full-precision one; a format memfit does not model is refused in one line."""
    q = data.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method") or ("bitsandbytes" if q.get("load_in_4bit") or q.get("load_in_8bit") else "?"))
    if method == "bitsandbytes" and q.get("load_in_4bit"):
        kind = str(q.get("bnb_4bit_quant_type") or "fp4")
        if kind in ("nf4", "fp4"):
            return kind + (":double_quant=true" if q.get("bnb_4bit_use_double_quant") else "")
    elif method == "bitsandbytes" and q.get("load_in_8bit"):
        return "int8"
    elif method == FP8:  # (NOTE [ FP8 checkpoints by card ])
        return None if q.get("dequantize") else FP8
    elif method in DEQUANTIZED_TO_TRAIN:  # (NOTE [ Checkpoints trained dequantized ])
        return None
    nearest = _nearest_format(method, q)
    raise UserError(f"{where}: config.json's quantization_config is a pre-quantized {method} checkpoint, a format "
                    "memfit does not model (it models bitsandbytes' nf4, fp4 and int8, and fp8 weights upcast per "
                    f"layer); plan the full-precision checkpoint with --base-weights {nearest} instead, the modelled "
                    f"format of its size ({'half a byte' if nearest == 'nf4' else 'a byte'} a weight)")


def _nearest_format(method: str, q: dict) -> str:
    """The modelled ``base_weights`` format that stores as many bytes a weight as a pre-quantized
    checkpoint's ``method`` (its kernels and scales still differ): float8 checkpoints fp8, 8-bit
    integer ones int8, the rest (GPTQ, AWQ, HQQ... at 4 bits) nf4."""
    bits = q.get("bits") or q.get("w_bit") or q.get("nbits")
    if "fp8" in method.lower() or "float8" in str(q.get("weights", "")).lower() or q.get("fmt") in ("e4m3", "float8_e4m3fn"):
        return "fp8"
    return "int8" if method in ("eetq", "int8") or str(bits) == "8" else "nf4"
