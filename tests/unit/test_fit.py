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
from memfit.units import fmt_bytes
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


SEQ = 512  # (a sample's activations well over the allocator's 2 MiB steps: a few traces a cell)


@pytest.fixture(scope="module")
def llama_table():
    workload = load_workload(LLAMA, seq_len=SEQ)
    cards = [get_device(n) for n in ("rtx4060", "rtx4090")]
    return workload, cards, fit_table(workload, parse_methods("full,lora"), cards, budget="4.5%")


@pytest.mark.slow  # (a minute on 2 cores: keeps the default suite under 10 minutes)
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


@pytest.mark.slow  # (keeps the default suite under 10 minutes on 2 cores)
def test_one_architectures_cards_share_their_traces(llama_table):
    workload, cards, table = llama_table
    assert architecture(cards[0]) == architecture(cards[1]) and table.groups == 1
    alone = [fit_table(workload, parse_methods("full,lora"), [card], budget="4.5%") for card in cards]
    for one in alone:  # the same answers
        for key, cell in one.cells.items():
            assert (cell.batch, cell.recipe, cell.used_bytes) == (table.cells[key].batch, table.cells[key].recipe,
                                                                  table.cells[key].used_bytes)
    assert table.traces < sum(one.traces for one in alone) - 4  # (batches 1 and 2 of each method, traced once)


# 24 blocks of 26 MB of bf16 weights, a short sequence: a LoRA's frozen weights outweigh what FSDP2
# adds (a block gathered and the next prefetched), so two ranks hold less than one card
DEEP = ("llama:num_hidden_layers=24,hidden_size=1024,intermediate_size=2816,num_attention_heads=8,"
        "num_key_value_heads=8,vocab_size=4096")


@pytest.mark.slow  # (minutes on 2 cores: keeps the default suite under 10 minutes)
def test_no_single_card_the_fewest_with_fsdp2():
    workload = load_workload(DEEP, seq_len=16)
    card = get_device("rtx4060")
    small = dataclasses.replace(card, name="small", total_bytes=card.context_bytes + 550 * 2**20)
    cell = fit_table(workload, parse_methods("lora"), [small], budget="100%", max_world=4).cells[("small", "lora")]
    assert cell.world == 2 and cell.batch % 2 == 0, cell
    assert cell.plan.world_size == 2 and cell.recipe.startswith("FSDP2 over 2")  # (+expandable: its batch needs them)
    assert cell.used_bytes <= cell.budget_bytes < cell.next_used_bytes
    assert _used(workload, cell.plan, cell.batch, small) == cell.used_bytes  # a rank's full trace, on the card
    one = recipes(parse_methods("lora")[0], model_facts(workload), small)[-1].plan
    for allocator in ("default", "expandable"):  # one card alone does not take batch 1, with either segments
        assert _used(workload, one.replace(allocator=allocator), 1, small) > cell.budget_bytes


def test_nothing_fits_even_sharded_says_what_a_rank_needs():
    workload = load_workload(DEEP, seq_len=16)
    card = get_device("rtx4060")
    tiny = dataclasses.replace(card, name="tiny", total_bytes=card.context_bytes + 100 * 2**20)
    cell = fit_table(workload, parse_methods("lora"), [tiny], budget="100%", max_world=2).cells[("tiny", "lora")]
    assert cell.world == 0 and cell.error.startswith("needs ") and "a rank on 2 cards" in cell.error


def test_a_card_without_bf16_says_why_fsdp2_is_not_the_answer():
    """A T4 takes fp16 (no bf16), which FSDP2 is not run with here: the cell names FSDP2 and the missing bf16, not
    the plan's internal wording (``shard: fsdp with ...``)."""
    workload = load_workload(DEEP, seq_len=16)
    card = get_device("t4")
    tiny = dataclasses.replace(card, name="tiny", total_bytes=card.context_bytes + 100 * 2**20)
    cell = fit_table(workload, parse_methods("full"), [tiny], budget="100%", max_world=2).cells[("tiny", "full")]
    assert cell.world == 0 and "on one card; FSDP2 with precision: fp16" in cell.error, cell.error
    assert cell.error.endswith("(this card has no bf16)") and "shard: fsdp" not in cell.error


@pytest.mark.slow  # (minutes on 2 cores: keeps the default suite under 10 minutes)
def test_a_diffusion_model_full_and_lora():
    pytest.importorskip("diffusers")
    workload = load_workload(SD3, resolution=64)
    table = fit_table(workload, parse_methods("full,lora"), [GPU_PRESETS["rtx4060"]], budget="5%")
    assert table.unit == "images/s"
    for method in ("full", "lora"):
        cell = table.cells[("rtx4060", method)]
        assert cell.world == 1 and cell.batch >= 1 and cell.throughput > 0, cell
        assert _used(workload, cell.plan, cell.batch, GPU_PRESETS["rtx4060"]) <= cell.budget_bytes


@pytest.mark.slow  # (keeps the default suite under 10 minutes on 2 cores); the planner's: test_planner_gpu
def test_a_batch_that_fits_only_with_expandable_segments_is_taken_with_them():
    """NOTE [ Expandable segments where they decide the fit ]: LoRA of the 6-block Llama at 12 samples
    reserves 56 MiB with the default segments and 54 MiB with expandable ones; under a budget of 55 MiB
    (with the context) the cell takes 12 samples with ``allocator: expandable``, at the figure a full
    trace of that plan gives, and the plan as written would not fit."""
    workload, card = load_workload(LLAMA, seq_len=SEQ), get_device("rtx4090")
    cell = fit_table(workload, parse_methods("lora"), [card],
                     budget=f"{(card.context_bytes >> 20) + 55}MiB").cells[(card.name, "lora")]
    assert cell.batch == 12 and cell.plan.allocator == "expandable" and cell.recipe.endswith("+expandable")
    assert _used(workload, cell.plan, 12, card) == cell.used_bytes <= cell.budget_bytes < cell.next_used_bytes
    assert _used(workload, cell.plan.replace(allocator="default"), 12, card) > cell.budget_bytes


def test_an_adapter_swaps_every_block_where_the_weights_fill_the_card():
    """The ``swapped`` recipe (memfit.planner.recipes): an adapter's most frugal recipe keeps every block's frozen
    weights on the host where the weights take more than 3/4 of the card's budget, as the planner's search
    does (memfit.techniques.swap_blocks.search); not on a card they leave room on, and never for full
    fine-tuning (no frozen weights) or QLoRA (bitsandbytes' layers do not stream)."""
    facts = model_facts(load_workload(DEEP, seq_len=16))
    card = get_device("rtx4060")
    weights = sum(p.numel() for p in facts.model.parameters()) * 2  # (bf16-pure on an sm89 card)
    full, lora, qlora = parse_methods("full,lora,qlora")
    swapped = recipes(lora, facts, card, weights)[-1]
    assert swapped.name == "swapped" and swapped.plan.swap_blocks == 24 and swapped.plan.checkpointing == "blocks"
    assert recipes(lora, facts, card, 2 * weights)[-1].name == "checkpointed"
    assert all(r.plan.swap_blocks == 0 for m in (full, qlora) for r in recipes(m, facts, card, weights))


@pytest.mark.slow  # (a minute on 2 cores: keeps the default suite under 10 minutes)
def test_a_card_the_weights_fill_takes_an_adapter_with_every_block_swapped():
    """A LoRA whose frozen weights fill the card (24 blocks of 26 MB, a card of 300 MiB and its context) trains on
    one card with every block swapped, not on two with FSDP2; its batch fits and the next does not, by full
    traces of that card (the pair's allocations at full depth: NOTE [ A block's first fetches two ])."""
    workload = load_workload(DEEP, seq_len=256)
    card = get_device("rtx4060")
    small = dataclasses.replace(card, name="small", total_bytes=card.context_bytes + 300 * 2**20)
    cell = fit_table(workload, parse_methods("lora"), [small], budget="100%", max_world=4).cells[("small", "lora")]
    assert cell.world == 1 and cell.recipe.startswith("swapped") and cell.plan.swap_blocks == 24, cell
    assert _used(workload, cell.plan, cell.batch, small) == cell.used_bytes <= cell.budget_bytes
    assert _used(workload, cell.plan, cell.batch + 1, small) > cell.budget_bytes


def test_each_cells_first_faster_recipe_is_queued_when_its_batch_is_found_and_the_first_round_asks_it(monkeypatch):
    # NOTE [ Faster recipes in rounds ]: the shallower trace queued in the background is the first round's
    # own ask (the same plan, batch and book), so the workers trace nothing the table does not use.
    from memfit.planner.fit_books import Books
    queued, rounds = [], []
    real_queue, real_shallower = Books.queue_shallower, Books.trace_shallower

    def key(book, plan, batch):
        return (id(getattr(book, "source", book)), plan, batch)

    monkeypatch.setattr(Books, "queue_shallower",
                        staticmethod(lambda asks: (queued.extend(key(*a) for a in asks), real_queue(asks))))
    monkeypatch.setattr(Books, "trace_shallower",
                        staticmethod(lambda asks: (rounds.append([key(*a) for a in asks]), real_shallower(asks))))
    workload = load_workload(LLAMA, seq_len=SEQ)
    fit_table(workload, parse_methods("lora"), [get_device("rtx4090")], budget="4.5%")
    assert queued and rounds and sorted(queued, key=str) == sorted(rounds[0], key=str)


FULL = ("llama:num_hidden_layers=2,hidden_size=512,intermediate_size=1408,num_attention_heads=8,num_key_value_heads=8,"
        "vocab_size=4096")


def test_a_recipe_over_the_host_memory_is_passed_over_for_paged_states_and_the_cell_says_so():
    """NOTE [ A recipe over the host's memory ]: on a card that takes full fine-tuning only with AdamW stepped on
    the host, the cell holds that recipe's host bytes (those of ``memfit estimate``'s full trace at its batch);
    with ``host_memory`` below them, the recipe is passed over for the paged 8-bit AdamW (its batch exact by
    full traces), and the cell says what the offloaded one would need."""
    workload = load_workload(FULL, seq_len=64)
    card = get_device("rtx4060")
    small = dataclasses.replace(card, name="small", total_bytes=card.context_bytes + 100 * 2**20)
    cell = fit_table(workload, parse_methods("full"), [small], budget="100%", max_world=2).cells[("small", "full")]
    assert cell.world == 1 and cell.recipe.startswith("offloaded") and cell.plan.offload == ("optimizer_states",), cell
    with silenced_warnings():
        report = estimate_target(Target.resolve(workload, cell.plan, cell.batch, small))
    assert cell.host_bytes == report.host_peak_bytes > 0 and not cell.passed_over
    limit = cell.host_bytes - 2**20
    held = fit_table(workload, parse_methods("full"), [small], budget="100%", max_world=2,
                     host_memory=f"{limit}B").cells[("small", "full")]
    assert held.world == 1 and held.recipe.startswith("paged") and held.plan.optimizer == "adamw8bit-paged", held
    assert held.host_bytes <= limit and held.passed_over.startswith("offloaded needs ")
    assert f"of host memory > {fmt_bytes(limit)} (--host-memory)" in held.passed_over
    assert _used(workload, held.plan, held.batch, small) <= held.budget_bytes < _used(workload, held.plan, held.batch + 1, small)


@pytest.mark.slow  # (13 s: the suite under 10 minutes)
def test_paged_states_are_held_to_the_host_memory_at_any_batch():
    """The paged states' pages out grow with the batch: held to the limit at any batch, as if all were out."""
    workload = load_workload(FULL, seq_len=64)
    card = get_device("rtx4060")
    small = dataclasses.replace(card, name="small", total_bytes=card.context_bytes + 100 * 2**20)
    cell = fit_table(workload, parse_methods("full"), [small], budget="100%", max_world=2).cells[("small", "full")]
    held = fit_table(workload, parse_methods("full"), [small], budget="100%", max_world=2,
                     host_memory=f"{cell.host_bytes - 2**20}B").cells[("small", "full")]
    tight = held.host_bytes + 2**20
    below = fit_table(workload, parse_methods("full"), [small], budget="100%", max_world=2,
                      host_memory=f"{tight}B").cells[("small", "full")]
    assert below.host_bytes <= tight and "paged needs " in below.passed_over, below


def test_the_header_says_a_size_once():
    """An image model's name says a size other than its own (``dit-flux 1216x832px``): the header does not
    repeat it; a native size or a sequence length is said beside the name."""
    from memfit.planner.fit import FitTable
    from memfit.report.fit import markdown
    cards = [GPU_PRESETS["rtx4090"]]
    for name, sizes, said in (("dit-flux 1216x832px", "1216x832 px", "dit-flux 1216x832px · 1 cards"),
                              ("dit-wan 832x480px", "832x480 px", "dit-wan 832x480px · 1 cards"),
                              ("dit-flux", "1024 px", "dit-flux · 1024 px · 1 cards"),
                              ("llama", "seq 2048", "llama · seq 2048 · 1 cards")):
        assert markdown(FitTable(name, sizes, "images/s", [], cards)).startswith(f"`memfit fit` {said}"), name
