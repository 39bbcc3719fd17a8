"""GPU predictions against a real H100 and H200 (tests/data/h100.jsonl, h200.jsonl), on this CPU.

Every recorded case is predicted for its card's preset (``h100-80gb``, ``h200-141gb``) and compared
with what the real steady-state step gave: ``max_memory_allocated`` within 3%, ``max_memory_reserved`` within 5%
(see the data's README for how they were measured). A representative subset (one case per CUDA
kernel rule and technique) runs in the default suite; the rest are marked slow. The same table,
with timings, is ``.venv/bin/python bench/gpu_accuracy.py``.

Rows record the library versions they ran with; where a library changed which kernels a model
reaches since then, the prediction emulates the recorded behaviour (``bench/gpu_accuracy.py``,
``recorded_environment``: T5's SDPA mask layout in transformers 5.17, which sends CUDA's SDPA to the
math path). Cases that still miss are listed in ``KNOWN_MISSES`` with the reason; they are
expected to fail (strict: a case that starts passing must be taken off the list).
"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOCATED_TOLERANCE = 0.03
RESERVED_TOLERANCE = 0.05


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_accuracy", ROOT / "bench" / "gpu_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench()
CASES = {c["case"]: c for c in BENCH.load_cases(ROOT / "tests" / "data" / "h100.jsonl")}
CASES.update({f"h200:{c['case']}": c for c in BENCH.load_cases(ROOT / "tests" / "data" / "h200.jsonl")})

# One per rule or technique (~45 s here): memory-efficient attention in fp32 (gpt2-fp32), cuDNN
# attention with CUDA autocast (gpt2-bf16, vit-bf16, dit-bf16), selective checkpointing, offloaded
# states on a prefetch stream, foreach AdamW at the peak (llama4), cuDNN convolution (cnn) and RNN
# (lstm), nn.MultiheadAttention (mha, chunked), masks and dropout (transformer), SDPA's math path
# with CUDA autocast inside a loss (t5), bitsandbytes' CUDA 8-bit update with pure bf16 and
# checkpointing; cases nobody had measured when the rules were written: grouped-query attention in
# fp32 (qwen2, SDPA's math path), a plain-torch LSTM LM (cuDNN RNN reserve), a timm ConvNeXt, a
# residual MLP with block checkpointing; and the H200.
DEFAULT = {
    "gpt2-fp32", "gpt2-bf16", "gpt2-bf16-selective", "gpt2-bf16-offopt", "vit-bf16", "cnn-fp32",
    "mha-bf16", "mha-chunked", "dit-bf16", "transformer-fp32", "t5-bf16", "llama4-bf16", "t-llama4-offopt-b2",
    "t-llama4-pure-8bit-blocks-b2", "qwen2-4l-fp32", "lstm_lm-fp32", "timm-convnext_tiny-bf16",
    "resmlp-bf16-blocks", "h200:gpt2-bf16", "h200:unet-bf16",
}

_CONV_RESERVED = ("reserved only: the caching allocator's segments around cuDNN convolution workspaces "
                  "(allocated within 0.2%); snapshots in tests/data/snapshots/rsv-*")
KNOWN_MISSES = {
    "lstm-fp32": "allocated +4.3% (reserved +4.4%) on this 145 MiB LSTM: cuDNN's RNN workspace follows the "
                 "algorithm cuDNN picks by shape, and memfit's fit to 276 measured shapes is ~2 MB over here; "
                 "~5 MB more of the gap is not located yet",
    "h200:lstm-fp32": "as lstm-fp32 on the H100 (same kernels)",
    "t-llama4-selective-b2": "reserved only (-5.5%; allocated -1.5%): the real run (torch 2.11) kept ~350 MiB "
                             "more than selective checkpointing does in torch 2.14's trace",
    "timm-vit_small-bf16-blocks": "reserved only (+8.7%; allocated -0.04%): allocator segments under block "
                                  "checkpointing; snapshot tests/data/snapshots/rsv-vit_small-bf16-blocks",
    "h200:timm-vit_small-bf16-blocks": "as on the H100",
    "unet-bf16-blocks": _CONV_RESERVED + " (+9.0%)",
    "h200:unet-bf16-blocks": _CONV_RESERVED + " (+9.0%)",
    "unet-fp32": _CONV_RESERVED + " (-6.8%)",
    "h200:unet-fp32": _CONV_RESERVED + " (-6.8%)",
    "timm-convnext_tiny-fp32": _CONV_RESERVED + " (-7.3%)",
    "h200:timm-convnext_tiny-fp32": _CONV_RESERVED + " (-7.3%)",
    "timm-resnet50-bf16": _CONV_RESERVED + " (-5.4%)",
    "h200:timm-resnet50-bf16": _CONV_RESERVED + " (-5.4%)",
}


def _params(names):
    return [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_MISSES[n], strict=True)) if n in KNOWN_MISSES
            else n for n in sorted(names)]


def _check(name: str) -> None:
    r = BENCH.predict(CASES[name])
    alloc_err, res_err = r["error"] / 100, r["reserved_error"] / 100
    assert abs(alloc_err) <= ALLOCATED_TOLERANCE and abs(res_err) <= RESERVED_TOLERANCE, (
        f"{name}: allocated {r['predicted']:,} vs measured {r['measured']:,} ({alloc_err:+.2%}), "
        f"reserved {r['reserved_predicted']:,} vs {r['reserved_measured']:,} ({res_err:+.2%})")


def test_the_recorded_cases_are_there():
    assert len(CASES) >= 75 + 49 and DEFAULT <= set(CASES) and set(KNOWN_MISSES) <= set(CASES)


@pytest.mark.parametrize("name", _params(DEFAULT))
def test_gpu_prediction_matches_measurement(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(set(CASES) - DEFAULT))
def test_gpu_prediction_matches_measurement_all_cases(name):
    _check(name)
