"""The step-time model's held-out table (docs/planner.md, tools/fit/held_out.py) replayed here, without
a GPU: the quick held-out rows are traced again for their card's preset and priced with their
machine's host, and must give the table's predicted times (so the documented figures are what the
code predicts); the split by family stays what it was decided to be; the host profiles act on the
host part of a step only."""

import re
from pathlib import Path

import pytest

from memfit.hosts import HOSTS, get_host, host_for_card, host_for_row
from memfit.planner.roofline import DISPATCH_FIELDS, H100, for_host
from tools.fit import held_out

ROOT = Path(__file__).resolve().parents[2]
QUICK = ("cnn-fp32", "lstm-fp32", "mha-bf16", "mha-chunked", "dit-bf16", "transformer-fp32")
"""Held-out rows whose traces take seconds here (the others: bert, t5, vit at full batch)."""


def _documented() -> dict[tuple[str, str], float]:
    """(card, case) -> predicted ms, from docs/planner.md's held-out table."""
    out = {}
    for line in (ROOT / "docs" / "planner.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] in ("h100", "h200") and re.fullmatch(r"[\d.]+", cells[5]):
            out[(cells[0], cells[1])] = float(cells[5])
    return out


def test_the_split_is_by_family_and_the_held_out_rows_are_the_other_families():
    rows = held_out.clean_rows()
    assert held_out.FIT_FAMILIES == {"gpt2", "llama"}
    held = {held_out.family(r) for r in rows if held_out.family(r) not in held_out.FIT_FAMILIES}
    assert held >= {"bert", "cnn", "lstm", "mha", "t5", "vit"}
    assert all(int(r.get("overlapped_jobs") or 1) == 1 for r in rows)


def test_the_quick_held_out_rows_replay_the_documented_table():
    documented = _documented()
    rows = [r for r in held_out.clean_rows() if r["card"] == "h100" and r["case"] in QUICK]
    assert len(rows) == len(QUICK)
    for result in held_out.predict(rows, cache=None):
        want = documented[(result.row["card"], result.row["case"])]
        assert result.predicted * 1e3 == pytest.approx(want, abs=0.051), result.row["case"]


def test_a_host_scales_the_host_constants_only():
    slow = get_host("2")
    k = for_host(slow)
    assert all(getattr(k, n) == pytest.approx(2 * getattr(H100, n)) for n in DISPATCH_FIELDS)
    assert k.mm_eff_half == H100.mm_eff_half and k.mem_eff == H100.mem_eff and k.host_bw == pytest.approx(H100.host_bw / 2)
    assert for_host(get_host(None)) is H100 and host_for_card("h200") is HOSTS["h200-box"]


def test_a_row_names_the_host_it_ran_behind():
    """NOTE [ One kind of machine, several hosts ]: the 2026-12-04 H200 rows ran behind another machine."""
    rows = [r for r in held_out.clean_rows() if r["card"] == "h200"]
    loan_b = [r for r in rows if r.get("host") == "h200-box-b"]
    assert {r["case"] for r in loan_b} >= {"h-phi3-lora-bf16", "h-qwen7b-full-purebf16-blocks-inbw"}
    assert host_for_row(loan_b[0], "h200") is HOSTS["h200-box-b"]
    assert host_for_row({"case": "x"}, "h200") is HOSTS["h200-box"] is host_for_card("h200")


def test_a_loan_whose_host_was_never_fitted_or_probed_gets_the_references_costs():
    """The 2026-11-23 H200 loan (rows 1-59, memfit db2feed to dde7aa7) ran behind a machine nobody measured:
    not the 2026-11-27 one whose host was fitted (``h200-box``, 1.97x)."""
    import json
    rows = [json.loads(line) for line in (ROOT / "tests" / "data" / "h200.jsonl").read_text().splitlines() if line.strip()]
    loan_a = [r for r in rows if r.get("memfit_commit") in ("db2feed", "cd0fea3", "dde7aa7")]
    assert len(loan_a) == 59 and all(r.get("host") == "h200-box-a" for r in loan_a)
    assert not any(r.get("host") == "h200-box-a" for r in rows if r not in loan_a)
    alone = [r for r in held_out.clean_rows() if r.get("host") == "h200-box-a"]
    assert [r["case"] for r in alone] == ["t5-bf16-tf523"]
    assert for_host(host_for_row(alone[0], "h200")) == H100  # (the reference's constants)


@pytest.mark.slow
def test_the_recipe_rows_are_priced_with_their_machines_host():
    """Issue 51's recipe rows (h200.jsonl 85-86): memfit's plan with the optimizer on the host within 3%
    (its host's memory was fitted on it), torchtune's paged recipe, with the migration, within 10% (+7.0%)."""
    import json

    from memfit.devices import get_device
    from memfit.planner.roofline import for_host
    from memfit.planner.timing import time_from_ops
    from memfit.plans import Plan
    from tools.fit.time_constants import trace
    from tools.gpu.predict_cases import migration_seconds
    from tools.gpu.rows import plan_fields, preset_for
    blind = {r["case"]: r["predicted"] for r in map(json.loads, (ROOT / "tools" / "gpu" / "recipe_predicted.jsonl")
                                                    .read_text().splitlines())}
    rows = [json.loads(line) for line in (ROOT / "tests" / "data" / "h200.jsonl").read_text().splitlines()
            if '"r-memfit-l3-8b-b2"' in line or '"r-torchtune-l3-8b-b2"' in line]
    assert len(rows) == 2
    for row in rows:
        ops, _ = trace({**row, "case": f"h200-{row['case']}"}, None)
        stub = held_out._Stub(Plan(**plan_fields(row)), get_device(preset_for(row)))
        t = time_from_ops(ops, stub, for_host(host_for_row(row, "h200"))).seconds
        t += migration_seconds(row, blind[row["case"]], "h200-141gb")
        assert t / row["step_seconds_median"] - 1 == pytest.approx(0.0, abs=0.03 if "memfit" in row["case"] else 0.10)


def test_a_measured_host_is_this_machines_memory_bandwidth(monkeypatch):
    """--host measure without a GPU: the memory figure is a fused CPU AdamW's bandwidth against the
    reference constant; the dispatch costs stay the reference's, and the host's name says why."""
    import memfit.hosts as hosts
    monkeypatch.setattr(hosts, "adamw_bandwidth", lambda: H100.host_fused_bw / 2)
    host = get_host("measure")
    assert host.memory == pytest.approx(0.5) and host.dispatch == 1.0 and "no GPU" in host.name
    assert for_host(host).host_fused_bw == pytest.approx(H100.host_fused_bw / 2)


def test_planning_for_this_machines_gpu_measures_its_host_by_default(monkeypatch):
    import memfit.hosts as hosts
    monkeypatch.setattr(hosts, "adamw_bandwidth", lambda: H100.host_fused_bw / 4)
    assert hosts.host_for(None, "cuda").memory == pytest.approx(0.25)
    assert hosts.host_for(None, "cuda:0").memory == pytest.approx(0.25)
    assert hosts.host_for(None, "rtx4090") is HOSTS["h100-box"] and hosts.host_for("h200-box-b", "cuda") is HOSTS["h200-box-b"]


def test_the_adamw_probe_counts_the_bytes_the_time_model_counts():
    """The probe's bytes are the four bf16 tensors the fused update reads (as memfit.planner.opcost counts
    a host update), so its bandwidth is comparable with host_fused_bw; here a small one just runs to a rate."""
    from memfit.hosts import adamw_bandwidth
    assert 1e8 < adamw_bandwidth(params=1 << 20, repeats=1) < 1e13


@pytest.mark.parametrize("text", ["fast", "0", "-1", "100"])
def test_a_bad_host_is_one_line(text):
    from memfit.errors import UserError
    with pytest.raises(UserError, match="--host") as e:
        get_host(text)
    assert "\n" not in str(e.value)


def test_a_step_the_host_sets_on_an_unmeasured_host_says_so():
    """NOTE [ A step the host sets ]: the note where the host's update is at least half the step and the host
    is a preset; none where the card sets the pace, or where the host was measured or named by a multiple."""
    from memfit.hosts import Host
    from memfit.planner.gpu_time import _host_note, _host_sets_pace
    from memfit.planner.roofline import StepTime
    bound, card_bound = StepTime(seconds=1.8, worker=1.2), StepTime(seconds=1.8, worker=0.5)
    assert _host_sets_pace(bound, HOSTS["h100-box"]) and _host_sets_pace(bound, None)
    assert not _host_sets_pace(card_bound, HOSTS["h100-box"])
    assert not _host_sets_pace(bound, Host("this machine (memory 0.64x h100-box's)", memory=0.64))
    assert not _host_sets_pace(bound, get_host("1.3"))
    note = _host_note(bound, HOSTS["h200-box-b"])
    assert "1200 of 1800 ms" in note and "h200-box-b" in note and "--device cuda" in note
