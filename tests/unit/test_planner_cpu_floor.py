"""The CPU's floor under a GPU-preset plan's estimated time (NOTE [ The CPU's floor under an
estimate ] in memfit.planner.cpu_floor)."""

from __future__ import annotations

import pytest

from memfit.devices import get_device
from memfit.memory.budget import Budget
from memfit.planner.cpu_floor import FLOOR_SHARE, cpu_floor, overlap_group, update_signature
from memfit.planner.search import gpu_search
from memfit.planner.space import default_space, model_facts
from memfit.planner.time_model import factor_estimate
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target

MS = 1e-3


def test_floor_counts_per_micro_batch_work_per_micro_batch_and_shared_work_once():
    extras = [(("checkpointing", "selective"), 40 * MS, 20 * MS),   # scaled to the 10 ms step: 20 ms
              (("loss_chunks", 8), 2 * MS, 10 * MS),
              (("optimizer", "adamw8bit-ao"), 3 * MS, 10 * MS),
              (("optimizer_in_backward", True), 30 * MS, 20 * MS),   # scaled: 15 ms, the larger update
              (("offload", ("activations",)), 8 * MS, 10 * MS)]      # with checkpointing: the larger counts
    work = 10 * MS + 3 * 8 * MS + 4 * (20 + 2) * MS + 15 * MS
    assert cpu_floor(10 * MS, 8 * MS, 4, extras) == pytest.approx(FLOOR_SHARE * work)
    assert overlap_group(("offload", ("optimizer_states:step=device",))) == "update"
    assert overlap_group(("offload", ("activations",))) == overlap_group(("checkpointing", "blocks"))


def test_a_value_that_saves_cpu_time_lowers_the_floor_in_every_micro_batch():
    with_saving = cpu_floor(10 * MS, 8 * MS, 2, [(("attention", "sdpa"), -1 * MS, 10 * MS)])
    assert with_saving == pytest.approx(FLOOR_SHARE * (10 + 8 - 2) * MS)


@pytest.fixture(scope="module")
def gpt2_model():
    """GPT-2's width at 2 blocks, batch 8 x 1024 on the h100-80gb preset: its step waits on the GPU,
    its selective checkpointing split into 4 micro-batches waits on the CPU."""
    yield from _gpt2_time_model({"precision": ["bf16-pure"], "checkpointing": ["none", "selective"]})


def _gpt2_time_model(values: dict):
    """The time model of GPT-2's width at 2 blocks, batch 8 x 1024 on the h100-80gb preset, over ``values``
    and micro-batches of 8 and 2, its base and each value measured alone."""
    target = Target.resolve("gpt2:n_layer=2", None, 8, "h100-80gb", seq_len=1024)
    facts = model_facts(target.workload)
    space = default_space(facts, get_device("h100-80gb"), 8)
    space.values, space.micro_batches = values, [8, 2]
    book, model, _ = gpu_search(target, space, facts, Budget.resolve("3GiB", target.device))
    with silenced_warnings():
        model.prepare()
    yield model
    book.close()


def test_the_estimate_of_a_cpu_bound_combination_rests_on_the_floor_and_stays_under_its_measured_time(gpt2_model):
    model = gpt2_model
    plan = Plan(precision="bf16-pure", checkpointing="selective", micro_batch_size=2)
    ratios_only = factor_estimate(model.seconds(model.base), model.technique_keys(plan), model.ratios)
    estimate, floor = model.predict(plan), model.cpu_floor(plan)
    with silenced_warnings():
        model.book.measure(plan)
    measured = model.step(plan)
    assert estimate == floor  # (the ratios' product errs low: the CPU sets the pace)
    assert ratios_only < 0.75 * measured.seconds
    assert 0.8 * measured.seconds < floor <= measured.cpu_seconds <= measured.seconds * 1.001


def test_no_floor_for_compiled_plans_or_host_updates(gpt2_model):
    model = gpt2_model
    assert model.cpu_floor(Plan(precision="bf16-pure", compile="blocks")) == 0.0
    assert model.cpu_floor(Plan(precision="bf16-pure", offload=["optimizer_states"])) == 0.0


def test_no_floor_at_a_precision_never_measured_alone(gpt2_model):
    """(fp32 is outside this space: nothing measured its step, so nothing bounds its plans.)"""
    assert gpt2_model.cpu_floor(Plan(precision="fp32", checkpointing="selective", micro_batch_size=2)) == 0.0
    assert gpt2_model.cpu_floor(Plan(precision="bf16-pure", checkpointing="selective", micro_batch_size=2)) > 0.0


def test_the_update_signature_leaves_out_what_does_not_change_the_host_update():
    a = Plan(precision="bf16-pure", optimizer="adamw8bit", offload=["optimizer_states"])
    alike = [a.replace(checkpointing="selective", micro_batch_size=2, loss_chunks=8),
             a.replace(optimizer_in_backward=True), a.replace(offload=["optimizer_states", "activations"])]
    other = [a.replace(optimizer="adamw"), a.replace(precision="bf16"), a.replace(offload=["optimizer_states:step=device"]),
             a.replace(max_grad_norm=1.0)]
    assert all(update_signature(p) == update_signature(a) for p in alike)
    assert all(update_signature(p) != update_signature(a) for p in other)


@pytest.fixture(scope="module")
def host_update_model():
    """GPT-2's width at 2 blocks, batch 8 x 1024, full fine-tuning on the h100-80gb preset, its optimizer
    states stepped on the host: 8-bit AdamW's host update is slow, the step waits for it."""
    yield from _gpt2_time_model({"precision": ["bf16-pure"], "optimizer": ["adamw", "adamw8bit"],
                                 "offload": [(), ("optimizer_states",)], "checkpointing": ["none", "selective"],
                                 "optimizer_in_backward": [False, True]})


def test_a_measured_host_update_floors_the_estimates_of_plans_that_update_alike(host_update_model):
    """NOTE [ The host's update under an estimate ]: once one 8-bit AdamW plan stepping on the host is
    measured, every plan updating alike is estimated at least FLOOR_SHARE of its worker's seconds, which
    stays under each one's own measured time; a plan updating otherwise (torch's AdamW) gets no floor from it."""
    model = host_update_model
    first = Plan(precision="bf16-pure", optimizer="adamw8bit", offload=["optimizer_states"], checkpointing="selective",
                 optimizer_in_backward=True)
    alike = [Plan(precision="bf16-pure", optimizer="adamw8bit", offload=["optimizer_states"], micro_batch_size=2),
             Plan(precision="bf16-pure", optimizer="adamw8bit", offload=["optimizer_states"])]
    other = Plan(precision="bf16-pure", optimizer="adamw", offload=["optimizer_states"], checkpointing="selective")
    assert all(model.update_floor(p) == 0.0 for p in [first, *alike])  # (no 8-bit update on the host measured)
    torch_adamw = model.update_floor(other)  # (the state offload measured alone, before the walk: torch's AdamW)
    before = [model.predict(p) for p in alike]
    with silenced_warnings():
        model.book.measure(first)
    worker = model.step(first).worker
    assert worker > 0.5 * model.seconds(first)  # (the step waits for the host's 8-bit update)
    assert model.estimate_depends_on(alike[0], [first]) and not model.estimate_depends_on(other, [first])
    assert 0 < torch_adamw < FLOOR_SHARE * worker and model.update_floor(other) == torch_adamw
    for plan, estimate in zip(alike, before):
        assert model.update_floor(plan) == pytest.approx(FLOOR_SHARE * worker)
        assert model.predict(plan) > estimate  # (the ratios alone estimated it under the floor)
        with silenced_warnings():
            model.book.measure(plan)
        assert model.step(plan).worker == pytest.approx(worker, rel=1e-6)
        assert FLOOR_SHARE * worker <= model.seconds(plan)
