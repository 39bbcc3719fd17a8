"""A Hugging Face checkpoint's stored format (config.json's ``quantization_config``) as memfit plans it.

bitsandbytes' formats are the plan's ``base_weights`` (``nf4``, ``fp4``, ``int8``): the checkpoint loads in them,
and every plan keeps them. A format transformers trains only dequantized (gpt-oss's MXFP4) is the full-precision
model (NOTE [ Checkpoints trained dequantized ]). Any other format is one line naming the modelled format of its
size.
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
DEQUANTIZED_TO_TRAIN = {"mxfp4": "Mxfp4Config(dequantize=True)"}
"""Pre-quantized formats transformers trains only dequantized -> the load argument that dequantizes them."""


def trained_dequantized(data: dict) -> str | None:
    """How a checkpoint stored in a format transformers cannot train is loaded to train it, in words, or None
    (NOTE [ Checkpoints trained dequantized ])."""
    q = data.get("quantization_config")
    method = str(q.get("quant_method")) if isinstance(q, dict) else None
    if method not in DEQUANTIZED_TO_TRAIN:
        return None
    return (f"checkpoint: its weights are stored in {method.upper()}, which transformers does not train; planned "
            f"dequantized to bf16 as loaded with quantization_config={DEQUANTIZED_TO_TRAIN[method]} (the weights' "
            "precision is the plan's: bf16-pure or bf16-base keep them in bf16)")


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
