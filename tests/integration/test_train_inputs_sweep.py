"""A property-based sweep (hypothesis) of plan files and ``memfit train`` flag values: every
combination ends in a result (exit 0, a JSON summary) or in one line with exit 2 that names the
problem; never an internal error, never a traceback.

Plan files are YAML or JSON built from the plan's own keys (and unknown ones) with values of every
kind, or text that is no plan at all; flags are each left out, valid, or wrong in a way people
type. The default suite tries a few dozen; the slow one several hundred."""

import contextlib
import dataclasses
import io
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from memfit.cli.main import main
from memfit.plans import Plan

TINY = "mha:vocab=64,dim=16,heads=2,layers=1,seq_len=8"
KEYS = [f.name for f in dataclasses.fields(Plan) if not f.name.startswith("_")]
WORDS = ["bf16", "fp16", "fp32", "bf16-pure", "blocks", "blocks:every=2", "selective", "budget:0.5", "adamw",
         "adamw8bit", "sgd", "adafactor", "activations", "optimizer_states", "lora", "nf4", "auto", "none", "true",
         "default", "expandable", "fsdp2", "device", "cpu", "decay=0.9", "-1", "0", "1e400", "nan", ""]

values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(WORDS) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(WORDS + ["decay", "every"]), inner,
                                                                max_size=3),
    max_leaves=6)
VALID = {"precision": ["fp32", "bf16"], "checkpointing": ["none", "blocks"], "micro_batch_size": [1, 2],
         "optimizer": ["adamw", "sgd", "adafactor"], "max_grad_norm": [1.0, 0.5], "ema": [{"decay": 0.9}],
         "loss_chunks": [0], "optimizer_in_backward": [True, False], "attention": ["auto"]}
valid_plans = st.dictionaries(st.sampled_from(sorted(VALID)), st.none(), max_size=3).flatmap(
    lambda keys: st.fixed_dictionaries({k: st.sampled_from(VALID[k]) for k in keys}))
plans = st.one_of(
    valid_plans.map(lambda d: ("yaml", d)),
    st.dictionaries(st.sampled_from(KEYS + ["not_a_key", "Precision"]), values, max_size=4).map(
        lambda d: ("yaml", d)),
    st.dictionaries(st.sampled_from(KEYS), values, max_size=3).map(lambda d: ("json", d)),
    st.text(max_size=40).map(lambda t: ("text", t)),
    st.binary(max_size=20).map(lambda b: ("bytes", b)),
    st.none(),
)
NUMBERS = ["1", "2", "0", "-1", "3.5", "1e3", "x", "", " 2", "99999999999999999999999", "0x10"]


def flag(name: str, good: list[str], numbers=NUMBERS):
    """Left out (most often), a good value, or any value."""
    return st.one_of(st.none(), st.none(), st.none(), st.sampled_from(good).map(lambda v: [name, v]),
                     st.sampled_from(good + numbers).map(lambda v: [name, v]))


flags = st.tuples(flag("--steps", ["1", "2"], [n for n in NUMBERS if len(n) < 5]),  # (no long runs) flag("--batch-size", ["2", "4"]), flag("--seq-len", ["8", "16"]),
                  flag("--checkpoint-every", ["1"]), flag("--keep-checkpoints", ["1", "3"]),
                  flag("--seed", ["7", str(2**64)]), flag("--workers", ["0"]),
                  flag("--budget", ["1GiB", "80%"], ["1B", "huge", "-5GiB", "0"]), flag("--device", ["cpu"], ["h100", "tpu", "cuda"]))


def _write(folder: Path, plan) -> list[str]:
    if plan is None:
        return []
    kind, content = plan
    path = folder / ("plan.json" if kind == "json" else "plan.yaml")
    if kind == "yaml":
        import yaml
        path.write_text(yaml.safe_dump(content, allow_unicode=True))
    elif kind == "json":
        path.write_text(json.dumps(content))  # (nan and inf as JSON's extensions)
    elif kind == "text":
        path.write_text(content)
    else:
        path.write_bytes(content)
    return ["--plan", str(path)]


def _check(plan, chosen) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        argv = ["train", TINY, *_write(folder, plan), "--out", str(folder / "out"), "--no-report", "--json",
                *[x for pair in chosen if pair for x in pair]]
        if not any(pair and pair[0] == "--steps" for pair in chosen):
            argv += ["--steps", "1"]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        event(f"exit {code}")  # (--hypothesis-show-statistics: how many ran, how many were refused)
        lines = err.getvalue().strip().splitlines()
        errors = [x for x in lines if x.startswith("memfit train: error:")]
        assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue(), (argv, lines)
        if code == 0:
            assert json.loads(out.getvalue())["steps"] >= 1, argv
        else:
            assert code == 2 and len(errors) == 1 and errors == lines[-1:], (argv, code, lines)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(plans, flags)
def test_plan_files_and_flags_end_in_a_result_or_one_line(plan, chosen):
    _check(plan, chosen)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(plans, flags)
def test_plan_files_and_flags_end_in_a_result_or_one_line_many(plan, chosen):
    _check(plan, chosen)
