"""A recorded GPU row predicted with each of pad_mm's choices (NOTE [ Padded matmuls without timing ] in
memfit.techniques.cuda_lowering): memfit's rule, no matmul padded, or every one the pass asks about.

A compiled row measured before memfit's regions padded by the rule (2026-12-04) padded what the GPU's timing
chose; the choice that reproduces the row's own prediction on the device (``predicted_cuda``) tells which.

    python -m tools.gpu.pad_choices h200:b-gpt2-bf16-full [--choices rule,none,all]

Run it with the torch the row ran with (tools/gpu/device_torch_env.sh): Inductor's choices differ between
versions. Inductor's caches are off, so each choice is compiled anew (~20 s a compiled GPT-2 row here).
"""

from __future__ import annotations

import argparse
import json
import os
import unittest.mock


def predict(case: dict, choice: str) -> dict:
    """The row's prediction with ``choice`` (rule, none or all), and the matmuls (mat1, mat2 shapes) asked about."""
    import torch

    from memfit.techniques import cuda_lowering
    from tools.gpu import rows
    rule = cuda_lowering._PadTiming.padded_is_faster
    asked = {}

    def chosen(self, key):
        padded = {"all": True, "none": False}[choice] if choice != "rule" else rule(self, key)
        asked[str(tuple(tuple(t.shape) for t in self.asked[1:3]))] = padded
        return padded

    torch._dynamo.reset()  # (the choice before's compiled graphs are not run again)
    with unittest.mock.patch.object(cuda_lowering._PadTiming, "padded_is_faster", chosen):
        r = rows.predict(case)
    return {"case": r["case"], "choice": choice, "torch": torch.__version__, "predicted": r["predicted"],
            "error": round(r["error"], 2), "reserved_predicted": r["reserved_predicted"],
            "reserved_error": round(r["reserved_error"], 2), "on_device": case.get("predicted_cuda"), "padded": asked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", help="a row's case id (h200: rows prefixed h200:)")
    parser.add_argument("--choices", default="rule,none,all")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # (each choice compiled, not served from a cache)
    from tools.gpu import rows
    case = rows.recorded_cases()[args.case]
    for choice in args.choices.split(","):
        print(json.dumps(predict(case, choice)), flush=True)


if __name__ == "__main__":
    main()
