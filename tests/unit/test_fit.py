"""``memfit fit`` (memfit.planner.fit): each cell's batch is exact on its own card, checked by full
traces of ``memfit estimate`` on that card (not the table's shared, shallow traces); the cards of one
architecture share their traces; where one card is too small, the fewest FSDP2 cards; the diffusion
built-ins take full and LoRA."""

import dataclasses

import pytest

from memfit.devices import GPU_PRESETS, architecture, get_device
from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate_target
from memfit.planner.fit import fit_table
from memfit.planner.methods import parse_methods
from memfit.planner.recipes import recipes
from memfit.planner.space import model_facts
from memfit.plans import Plan
from memfit.quiet import silenced_warnings
from memfit.target import Target
from memfit.workloads import load_workload

# 6 blocks: the shallow pairs (2 and 3 blocks) and the deep stream are used, as for a 7B
LLAMA = ("llama:num_hidden_layers=6,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
         "vocab_size=512")
SD3 = ("dit-sd3:num_layers=6,num_attention_heads=2,attention_head_dim=16,joint_attention_dim=32,"
       "caption_projection_dim=32,pooled_projection_dim=16,pos_embed_max_size=16")


def _used(workload, plan: Plan, batch: int, card) -> int:
    with silenced_warnings():
        report = estimate_target(Target.resolve(workload, plan, batch, card))
    return Budget(0, card).used_bytes(report)


@pytest.fixture(scope="module")
def llama_table():
    workload = load_workload(LLAMA, seq_len=64)
    cards = [get_device(n) for n in ("rtx4060", "rtx4090", "rtx3070")]
    return workload, cards, fit_table(workload, parse_methods("full,lora"), cards, budget="4.5%")


def test_each_cell_fits_and_the_next_batch_does_not_by_full_traces_on_its_own_card(llama_table):
    workload, cards, table = llama_table
    facts = model_facts(workload)
    for card in cards:
        for method in parse_methods("full,lora"):
            cell = table.cells[(card.name, method.name)]
            assert cell.world == 1 and cell.batch >= 2, cell
            frugal = recipes(method, facts, card)[-1].plan
            assert _used(workload, cell.plan, cell.batch, card) == cell.used_bytes <= cell.budget_bytes
            assert _used(workload, frugal, cell.batch + 1, card) > cell.budget_bytes
            assert cell.throughput > 0 and cell.seconds > 0


def test_one_architectures_cards_share_their_traces(llama_table):
    workload, cards, table = llama_table
    assert architecture(cards[0]) == architecture(cards[1]) != architecture(cards[2])
    assert table.groups == 2
    alone = sum(fit_table(workload, parse_methods("full,lora"), [card], budget="4.5%").traces for card in cards[:2])
    assert table.traces < alone - table.traces // 4  # (lines at batches 1 and 2, drawn once for both)


def test_no_single_card_the_fewest_with_fsdp2():
    workload = load_workload(LLAMA, seq_len=64)
    card = get_device("rtx4060")
    one = fit_table(workload, parse_methods("full"), [card], budget="4.5%").cells[(card.name, "full")]
    squeezed = dataclasses.replace(card, name="rtx4060-squeezed", total_bytes=one.used_bytes + 2**20)
    cell = fit_table(workload, parse_methods("full"), [squeezed], budget="100%", max_world=4).cells[
        ("rtx4060-squeezed", "full")]
    assert cell.world == 1 and cell.batch >= 1  # the card itself: it fits
    tiny = dataclasses.replace(card, name="tiny", total_bytes=card.context_bytes + 6 * 2**20)
    cell = fit_table(workload, parse_methods("full"), [tiny], budget="100%", max_world=4).cells[("tiny", "full")]
    assert cell.world in (2, 4) and cell.batch % cell.world == 0, cell
    assert cell.plan.world_size == cell.world and cell.recipe.startswith("FSDP2")
    assert cell.used_bytes <= cell.budget_bytes < cell.next_used_bytes


def test_nothing_fits_even_sharded_says_what_a_rank_needs():
    workload = load_workload(LLAMA, seq_len=64)
    card = get_device("rtx4060")
    tiny = dataclasses.replace(card, name="tiny", total_bytes=card.context_bytes + 2**20)
    cell = fit_table(workload, parse_methods("full"), [tiny], budget="100%", max_world=2).cells[("tiny", "full")]
    assert cell.world == 0 and cell.error.startswith("needs ") and "a rank on 2 cards" in cell.error


def test_a_diffusion_model_full_and_lora():
    pytest.importorskip("diffusers")
    workload = load_workload(SD3, resolution=64)
    table = fit_table(workload, parse_methods("full,lora"), [GPU_PRESETS["rtx4060"]], budget="5%")
    assert table.unit == "images/s"
    for method in ("full", "lora"):
        cell = table.cells[("rtx4060", method)]
        assert cell.world == 1 and cell.batch >= 1 and cell.throughput > 0, cell
        assert _used(workload, cell.plan, cell.batch, GPU_PRESETS["rtx4060"]) <= cell.budget_bytes
