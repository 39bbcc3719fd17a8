"""The rows of GPU ground truth (tests/data/h100.jsonl, h200.jsonl): reading them, the plan each
ran in today's plan fields, the library behaviour to emulate, and memfit's prediction of each.

``tools/gpu/ground_truth.py`` records the rows on a GPU; ``bench/gpu_accuracy.py`` prints the
prediction table from them; ``tools/fit/time_constants.py`` fits the time model to their step
times; ``bench/planner_choices.py`` replays the planner on them; tests/unit/test_gpu_ground_truth.py
checks every prediction.

A row without a ``bitsandbytes`` field ran without bitsandbytes: a plan naming ``adamw8bit``
there ran torch's fp32 AdamW, so that is what is predicted.

Library versions: a row records the versions it ran with (rows 1-39: torch 2.11, transformers
5.17; see tests/data/README.md). Where a library changed which kernels a model reaches between that
version and the installed one, the prediction emulates the recorded behaviour
(``recorded_environment``): transformers 5.23 made T5's SDPA position-bias mask contiguous; with
5.17's non-contiguous mask CUDA's SDPA takes the math path (memfit.memory.cuda.sdpa), with 5.23's
the memory-efficient one; torch 2.14 runs grouped-query attention in the memory-efficient kernel, where
2.11 took the math path (fp32 GQA: qwen2-4l-fp32), and 2.12 sends a dropout off cuDNN's 1/16 grid to flash, where
2.11 ran cuDNN (GPT-2's 0.1).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memfit.target import Target

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "tests" / "data" / "h100.jsonl"
DATA = DEFAULT
CLEAN_ROWS = 39
"""Rows 1-39 ran one case at a time; the rest overlapped four processes (their CPU-bound times are
inflated and noisy)."""
SHARED = Path("/work/shared/gpu-ground-truth/h100.jsonl")


def load_cases(path: str | os.PathLike | None = None) -> list[dict]:
    """The cases of a ground-truth jsonl (default tests/data/h100.jsonl)."""
    p = Path(path) if path else (DEFAULT if DEFAULT.exists() else SHARED)
    cases = []
    for line in p.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "max_memory_allocated" in row and not row.get("error"):
                cases.append(row)
    return cases


def recorded_cases() -> dict[str, dict]:
    """Every recorded row by its id: the H100's (tests/data/h100.jsonl) by case, the H200's prefixed ``h200:``."""
    cases = {c["case"]: c for c in load_cases(DEFAULT)}
    cases.update({f"h200:{c['case']}": c for c in load_cases(ROOT / "tests" / "data" / "h200.jsonl")})
    return cases


DEVICE_STEP_ROWS = {"gpt2-bf16-offopt", "t-llama4-offopt-b2"}
"""Rows recorded when ``offload: [optimizer_states]`` stepped on the device (before 2026-11-24); that
implementation is ``optimizer_states:step=device`` now."""


def plan_of(case: dict) -> dict:
    """The plan that ran, in today's plan fields: adamw8bit without bitsandbytes on the GPU machine
    fell back to AdamW; optimizer-state offload stepped on the device (``DEVICE_STEP_ROWS``)."""
    plan = dict(case.get("plan") or {})
    if plan.get("optimizer") == "adamw8bit" and not case.get("bitsandbytes"):
        plan["optimizer"] = "adamw"
    return in_todays_fields(case, plan)


def in_todays_fields(case: dict, plan: dict) -> dict:
    """``plan`` of ``case`` with the recorded optimizer-state offload named as it is now."""
    if case.get("case") not in DEVICE_STEP_ROWS:
        return plan
    return {**plan, "offload": ["optimizer_states:step=device" if o == "optimizer_states" else o
                                for o in plan["offload"]]}


RECORDED_TRANSFORMERS = "5.17.0"
"""transformers of rows without a ``transformers`` field (rows 1-39)."""
RECORDED_TORCH = "2.11.0"
"""torch of rows without a ``torch`` field (rows 1-39)."""


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("+")[0].split(".")[:2])


@contextlib.contextmanager
def _t5_mask_as_in_transformers_5_17():
    """transformers <= 5.17 handed SDPA T5's position bias in its own (permuted) layout; 5.23
    returns ``position_bias_mask.contiguous()``. Emulated by dropping that call."""
    import transformers.integrations.sdpa_attention as sdpa
    line = "return position_bias_mask.contiguous()"
    original = sdpa.create_position_bias_mask
    source = inspect.getsource(original)
    if line not in source:
        raise RuntimeError("transformers' create_position_bias_mask changed: update the 5.17 emulation")
    namespace: dict = {}
    exec(compile(source.replace(line, "return position_bias_mask"), sdpa.__file__, "exec"), sdpa.__dict__, namespace)
    sdpa.create_position_bias_mask = namespace["create_position_bias_mask"]
    try:
        yield lambda: True
    finally:
        sdpa.create_position_bias_mask = original


@contextlib.contextmanager
def _sdpa_as_in_torch(recorded: tuple[int, ...]):
    """SDPA's backend choice as the recorded torch made it (memfit.sdpa_backends: ``TORCH_CHECKS_CUDNN_DROPOUT``
    from 2.12, ``TORCH_EFFICIENT_GQA`` from 2.14; 2.11's memory-efficient kernel has no grouped-query heads, so
    such attention in fp32 took the math path on the recorded card). Yields whether any attention call of the
    prediction took another kernel than the installed torch would give it."""
    import torch

    from memfit import sdpa_backends
    from memfit.memory.cuda import sdpa as sdpa_rule
    installed = {name: getattr(sdpa_backends, name) for name in sdpa_backends.RULES_SINCE}
    then = {name: installed[name] and recorded >= since for name, since in sdpa_backends.RULES_SINCE.items()}
    select, changed = sdpa_rule.select_backend, []

    def under(rules: dict) -> None:
        for name, value in rules.items():
            setattr(sdpa_backends, name, value)

    def select_as_recorded(*args, **kwargs):
        under(installed)
        theirs = select(*args, **kwargs)
        under(then)
        recorded = select(*args, **kwargs)
        changed.append(theirs != recorded)
        return recorded

    # (Dynamo keeps a region's compiled code for its code object, with no guard on these rules: a region compiled
    # under the installed torch's choices would be reused as it is, so it is dropped on the way in and out)
    torch._dynamo.reset()
    under(then)
    sdpa_rule.select_backend = select_as_recorded
    try:
        yield lambda: any(changed)
    finally:
        under(installed)
        sdpa_rule.select_backend = select
        torch._dynamo.reset()


class _Emulations(contextlib.ExitStack):
    """Several emulations at once; ``changed()``: whether any of them changed what the prediction reached."""

    def __init__(self, emulations):
        super().__init__()
        self._emulations, self._changed = emulations, []

    def __enter__(self):
        super().__enter__()
        self._changed = [self.enter_context(e) for e in self._emulations]
        return self

    def changed(self) -> bool:
        return any(c() for c in self._changed)


def recorded_environment(case: dict) -> _Emulations | None:
    """What to emulate so that the prediction reaches the kernels the recorded run reached (None:
    nothing differs)."""
    import torch
    import transformers

    from memfit.sdpa_backends import RULES_SINCE
    emulations = []
    recorded = case.get("transformers") or RECORDED_TRANSFORMERS
    if case["workload"].split(":")[0] == "t5" and _version(recorded) < (5, 23) <= _version(transformers.__version__):
        emulations.append(_t5_mask_as_in_transformers_5_17())
    recorded_torch = _version(case.get("torch") or RECORDED_TORCH)
    if any(recorded_torch < since <= _version(torch.__version__) for since in RULES_SINCE.values()):
        emulations.append(_sdpa_as_in_torch(recorded_torch))
    return _Emulations(emulations) if emulations else None


def as_recorded(case: dict) -> contextlib.AbstractContextManager:
    """``recorded_environment(case)`` where something differs, else a context that does nothing: wrap any trace of a
    recorded row in it (the memory prediction, the time model's ops)."""
    return recorded_environment(case) or contextlib.nullcontext()


def preset_for(case: dict) -> str:
    """The preset of the card a row ran on (rows without a ``gpu`` field ran on an H100)."""
    from memfit.devices import preset_for_card
    return preset_for_card(case.get("gpu") or "NVIDIA H100", case.get("gpu_total_bytes"))


def predict(case: dict, device: str | None = None, *, emulate: bool = True) -> dict:
    """Predict one case; returns the case id with measured and predicted bytes and errors.
    ``emulate``: emulate library behaviour of the recorded environment (see the module docstring)."""
    warnings.simplefilter("ignore")
    import memfit
    t0 = time.perf_counter()
    device = device or preset_for(case)
    env = recorded_environment(case) if emulate else None
    with env or contextlib.nullcontext():
        report = memfit.estimate(workload_of(case), memfit.Plan(**plan_of(case)), batch_size=case["batch_size"],
                                 device=device)
    alloc, reserved = case["max_memory_allocated"], case["max_memory_reserved"]
    return {"case": case.get("case") or case.get("id"), "measured": alloc, "predicted": report.peak_bytes,
            "error": 100 * (report.peak_bytes - alloc) / alloc,
            "reserved_measured": reserved, "reserved_predicted": report.reserved_bytes,
            "reserved_error": 100 * (report.reserved_bytes - reserved) / reserved,
            "seconds": time.perf_counter() - t0, "emulated": env is not None and env.changed()}


def workload_of(case: dict):
    """The row's workload, built as its run built it: rows without ``"load": "checkpoint"`` ran
    before built-in models were loaded as checkpoints (memfit.techniques.loading): their model was
    built on the device (in the plan's build dtype) and converted there."""
    import dataclasses

    from memfit.workloads import load_workload
    wl = load_workload(case["workload"], seq_len=case.get("seq_len"))
    return wl if case.get("load") == "checkpoint" else dataclasses.replace(wl, from_checkpoint=False)


def predict_safe(case: dict, emulate: bool = True) -> dict:
    try:
        return predict(case, emulate=emulate)
    except Exception as e:  # noqa: BLE001 - report and carry on with the other cases
        return {"case": case.get("case") or case.get("id"), "failed": f"{type(e).__name__}: {str(e)[:200]}"}


def replaced(row: dict) -> bool:
    """Rows recorded with a technique implementation that has since been replaced (2026-11-24: the
    host EMA now averages in a thread beside the next step; offloaded activations go out on a side
    stream). Their times say nothing about today's step: shown, not counted, until re-measured on a
    GPU (``bench/offload_gpu.py``)."""
    ema = row["plan"].get("ema") or {}
    return (bool(ema) and ema.get("device", "cpu") == "cpu") or "activations" in row["plan"].get("offload", ())


def plan_fields(row: dict) -> dict:
    """The row's plan in today's fields (the recorded optimizer-state offload stepped on the device:
    ``DEVICE_STEP_ROWS``)."""
    return in_todays_fields(row, row["plan"])


def load_rows() -> list[dict]:
    """Every line of tests/data/h100.jsonl, in order (row indices count; ``CLEAN_ROWS``)."""
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def target_of(row: dict) -> Target:
    """The row resolved for the preset of the card it ran on (:func:`preset_for`): workload, plan in
    today's fields, batch, sequence."""
    from memfit.devices import get_device
    from memfit.plans import Plan
    from memfit.target import Target

    return Target.resolve(workload_of(row), Plan(**plan_fields(row)), row["batch_size"], get_device(preset_for(row)))


def plan_text(plan: dict) -> str:
    parts = []
    for k, v in plan.items():
        if isinstance(v, dict):
            v = ",".join(f"{a}={b}" for a, b in v.items())
        elif isinstance(v, list):
            v = ",".join(v)
        parts.append(f"{k}={v}")
    return " ".join(parts) or "fp32 (defaults)"
