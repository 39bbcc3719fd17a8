"""NOTE [ A technique pays for itself ] (memfit.planner.simpler): a plan with a subset of the chosen
plan's techniques, predicted within 1% of its time, is measured and chosen where it fits."""

import pytest

from memfit.devices import get_device
from memfit.planner.candidate import Candidate, Status
from memfit.planner.cost import TimeModel
from memfit.planner.search import plan
from memfit.planner.simpler import TIE, settle_simpler, techniques
from memfit.planner.space import default_space, model_facts
from memfit.plans import Plan
from memfit.workloads import load_workload

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128"


def _time_model(space, chunks: float) -> TimeModel:
    """Every technique slower than the plain step by 10% or more, but 8 loss chunks: ``chunks``."""
    m = TimeModel("fixed", 8, base_seconds={mb: 1.0 + 0.1 * (8 // mb - 1) for mb in space.micro_batches})
    m.factors = {(name, value): 1.1 for name, values in space.values.items() for value in values
                 if value != getattr(Plan(), name)}
    m.factors[("loss_chunks", 8)] = chunks
    return m


@pytest.mark.parametrize("chunks, chosen", [(0.995, Plan()), (0.98, Plan(loss_chunks=8))])
def test_a_technique_within_one_percent_of_the_plain_step_is_not_chosen(chunks, chosen):
    """The walk's fastest plan (8 loss chunks) is 0.5% faster than the plain step: the plain step,
    traced and fitting, is chosen, and the chunked plan is listed as not worth it. At 2% faster the
    chunks pay for themselves and stay chosen."""
    wl = load_workload(SPEC, seq_len=64)
    space = default_space(model_facts(wl), get_device("cpu"), 8)
    result = plan(wl, budget="1GiB", batch_size=8, time_model=_time_model(space, chunks))
    assert result.chosen.plan == chosen and result.chosen.used_bytes is not None
    chunked = next(c for c in result.candidates if c.plan == Plan(loss_chunks=8))
    if chosen == Plan():
        assert chunked.status is Status.NOT_WORTH and "(loss_chunks=8) does not pay for itself" in chunked.reason
        assert chunked.seconds < result.chosen.seconds <= chunked.seconds * (1 + TIE)
    else:
        assert chunked is result.chosen
        assert not any(c.status is Status.NOT_WORTH for c in result.candidates)


def test_techniques_are_the_values_a_default_plan_lacks_one_offloaded_item_each():
    p = Plan(checkpointing="blocks", offload=("optimizer_states", "activations"))
    assert techniques(p) == {("checkpointing", "blocks"), ("offload", "optimizer_states"), ("offload", "activations")}
    assert techniques(Plan(checkpointing="blocks", offload=("activations",))) < techniques(p)
    assert not techniques(Plan(checkpointing="selective")) < techniques(p)
    assert techniques(Plan()) == frozenset()


class _Walk:
    """Settles what ``fits`` says fits, as memfit.planner.walk.Walk.settle does after its traces."""

    def __init__(self, fits):
        self.fits, self.settled = fits, []

    def settle(self, c, chosen, within=0.0):
        self.settled.append(c.plan)
        return c if self.fits(c.plan) and c.seconds < chosen.seconds * (1 + within) else None


def _ranked(*pairs):
    out = [Candidate(p, s) for p, s in pairs]
    out[0].choose()
    return out


def test_the_simplest_plans_are_tried_first_and_only_those_within_the_tie():
    full = Plan(checkpointing="blocks", offload=("optimizer_states",), loss_chunks=8)
    ranked = _ranked((full, 1.000), (Plan(checkpointing="blocks", loss_chunks=8), 1.004),
                     (Plan(checkpointing="blocks"), 1.008), (Plan(loss_chunks=8), 1.02),
                     (Plan(checkpointing="selective"), 1.001))
    walk = _Walk(fits=lambda p: p.loss_chunks == 8)  # (blocks alone does not fit)
    chosen = settle_simpler(walk, ranked, ranked[0])
    # fewest techniques first; 1.02x is outside the tie, selective is not a subset: neither is tried
    assert walk.settled == [Plan(checkpointing="blocks"), Plan(checkpointing="blocks", loss_chunks=8)]
    assert chosen.plan == Plan(checkpointing="blocks", loss_chunks=8) and chosen.status is Status.CHOSEN
    assert ranked[0].status is Status.NOT_WORTH and "(offload=optimizer_states)" in ranked[0].reason


def test_nothing_changes_where_no_simpler_plan_fits_or_the_chosen_is_a_field_recipe():
    full = Plan(checkpointing="blocks", offload=("optimizer_states",))
    ranked = _ranked((full, 1.0), (Plan(checkpointing="blocks"), 1.001))
    assert settle_simpler(_Walk(fits=lambda p: False), ranked, ranked[0]) is ranked[0]
    assert ranked[0].status is Status.CHOSEN
    recipe = Candidate(full, 1.0, recipe=object())
    walk = _Walk(fits=lambda p: True)
    assert settle_simpler(walk, [recipe, ranked[1]], recipe) is recipe and not walk.settled
