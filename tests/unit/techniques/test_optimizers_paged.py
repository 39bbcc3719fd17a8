"""bitsandbytes' paged AdamW (adamw8bit-paged, adamw-paged): memory predicted against the profiler
on this CPU, the managed states booked apart on GPU presets and counted against the card, the pages
that migrate when the card is short, and refusals. The twin (equality) tests are in
test_twin_optimizers_paged.py."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.memory.allocator import round_size
from memfit.memory.budget import Budget
from memfit.memory.estimate import estimate
from memfit.memory.managed import migration
from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.workloads import load_workload

pytest.importorskip("bitsandbytes")

LLAMA = ("llama:num_hidden_layers=2,hidden_size=256,intermediate_size=688,num_attention_heads=4,"
         "num_key_value_heads=4,vocab_size=1000")
STATE_BYTES = {"adamw8bit-paged": 2, "adamw-paged": 8}
"""Bytes per element of the two moments: 8-bit codes, or fp32."""


def _large_elements(spec: str = LLAMA) -> list[int]:
    """Elements of each trained tensor bitsandbytes pages (1e5 or more), from the model on the meta
    device: independent of the optimizer and of memfit's trace."""
    with torch.device("meta"):
        model = load_workload(spec, seq_len=64).model()
    return [p.numel() for p in model.parameters() if p.requires_grad and p.numel() >= 100_000]


@pytest.mark.parametrize("name", ["adamw8bit-paged", "adamw-paged"])
def test_small_llama_predicted_within_1_percent_of_the_profiler(name):
    """On the cpu device nothing is paged (bitsandbytes keeps plain tensors): the prediction of the
    step, bitsandbytes' update included, is held to the profiler's measured peak (measured: -0.008%
    for adamw8bit-paged, +0.000% for adamw-paged)."""
    r = profile(LLAMA, Plan(optimizer=name), batch_size=2, seq_len=64, repeats=0)
    assert abs(r.error_percent) <= 1.0, (name, r.error_percent)
    assert r.predicted.managed_bytes == 0 and r.measured.managed_bytes == 0


@pytest.mark.parametrize("name", ["adamw8bit-paged", "adamw-paged"])
def test_managed_states_are_booked_apart_on_a_gpu_preset(name):
    """On a GPU preset the states of every tensor of 1e5 elements or more are managed memory: exactly
    those bytes, outside the allocator's peak and breakdown (the allocator holds what the non-paged
    twin holds less them, at its 512-byte blocks; the 2-layer Llama trains 21 tensors), and counted
    against the card by the Budget."""
    plain = "adamw8bit" if name == "adamw8bit-paged" else "adamw"
    paged = estimate(LLAMA, Plan(optimizer=name), batch_size=2, seq_len=64, device="h100-80gb")
    base = estimate(LLAMA, Plan(optimizer=plain), batch_size=2, seq_len=64, device="h100-80gb")
    large = _large_elements()
    assert paged.managed_bytes == STATE_BYTES[name] * sum(large)
    assert base.managed_bytes == 0
    per_state = STATE_BYTES[name] // 2
    steps = 21 * round_size(4) if plain == "adamw" else 0  # (torch's AdamW: a step tensor per parameter; bnb: an int)
    assert base.breakdown["optimizer_states"] - paged.breakdown["optimizer_states"] == \
        2 * sum(round_size(per_state * n) for n in large) + steps
    budget = Budget.of_device(get_device("h100-80gb"))
    assert budget.used_bytes(paged) == paged.reserved_bytes + paged.cuda_context_bytes + paged.managed_bytes
    assert any("not in torch.cuda.max_memory_reserved()" in a for a in paged.approximations)
    assert paged.to_json()["managed_bytes"] == paged.managed_bytes


def test_in_backward_with_paged_8bit_states_on_a_gpu_preset():
    """torchtune's recipe, smaller: bf16-pure, blocks checkpointed, paged 8-bit AdamW stepped in
    backward. Each parameter's own optimizer pages its large states: the same managed bytes as
    stepped after backward, and no gradient is alive at the peak."""
    plan = Plan(precision="bf16-pure", checkpointing="blocks", optimizer="adamw8bit-paged", optimizer_in_backward=True)
    r = estimate(LLAMA, plan, batch_size=2, seq_len=64, device="rtx4090")
    assert r.managed_bytes == 2 * sum(_large_elements())
    assert r.breakdown["gradients"] == 0


def test_the_fit_check_counts_managed_bytes_against_the_card_up_to_the_budget():
    """Budget (NOTE [ Managed memory over the budget ]): the allocator side (reserved + context) plus
    the managed bytes that fit beside it. Managed states over the card do not make a step fail: they
    page to the host, and their migration is priced; an allocator side over the budget does not fit."""
    device = get_device("rtx4090")
    budget = Budget.of_device(device)
    room = 1 << 30
    report = SimpleNamespace(reserved_bytes=device.total_bytes - device.context_bytes - room,
                             peak_bytes=0, cuda_context_bytes=device.context_bytes, managed_bytes=3 << 30)
    assert budget.used_bytes(report) == device.total_bytes and budget.fits(report)
    assert budget.paged_out(budget.allocator_bytes(report), report.managed_bytes) == 2 << 30
    moved = budget.migration(budget.allocator_bytes(report), report.managed_bytes)
    assert moved.short_bytes == 2 << 30 and moved.in_bytes == 3 << 30
    assert moved.seconds == pytest.approx(2 * (3 << 30) / device.host_link_bandwidth)
    fitting = SimpleNamespace(**{**vars(report), "managed_bytes": room})
    assert budget.used_bytes(fitting) == device.total_bytes and budget.migration(device.total_bytes - room, room).seconds == 0
    over = SimpleNamespace(**{**vars(report), "reserved_bytes": report.reserved_bytes + 2 * room})
    assert not budget.fits(over) and budget.used_bytes(over) == device.total_bytes + room
    assert budget.enforced_fits(report)  # (the allocator's limit caps reserved bytes only: managed pages out)


def test_pages_migrate_each_step_when_the_card_is_short():
    """NOTE [ Pages that migrate ]: nothing moves while the managed bytes fit the room the allocator and
    the context leave; once they do not, the LRU sweep moves every managed byte in and out each step,
    at the host link's bandwidth (and at least the bytes short each way)."""
    assert migration(10 << 30, 10 << 30, 25e9).in_bytes == 0
    m = migration(10 << 30, 8 << 30, 25e9)
    assert (m.short_bytes, m.in_bytes, m.out_bytes, m.least_bytes) == (2 << 30, 10 << 30, 10 << 30, 2 << 30)
    assert m.seconds == pytest.approx(2 * (10 << 30) / 25e9)


def test_a_report_on_a_card_too_small_for_the_managed_states_says_what_migrates():
    """An estimate on a card (the rtx4090 preset, shrunk) with room for the allocator and the context
    but not for all the managed states: it fits, the states paging, and the report gives the bytes
    that migrate each step and their time over the host link."""
    full = estimate(LLAMA, Plan(optimizer="adamw-paged"), batch_size=2, seq_len=64, device="rtx4090")
    small = dataclasses.replace(get_device("rtx4090"), total_bytes=full.reserved_bytes + full.cuda_context_bytes
                                + full.managed_bytes // 2)
    r = estimate(LLAMA, Plan(optimizer="adamw-paged"), batch_size=2, seq_len=64, device=small)
    assert r.managed_bytes == full.managed_bytes and r.fits is True  # (the rest pages: NOTE [ Managed memory over the budget ])
    m = migration(r.managed_bytes, full.managed_bytes // 2, small.host_link_bandwidth)
    note = next(a for a in r.approximations if "short for the managed states" in a)
    assert f"~{m.seconds * 1e3:.0f} ms" in note


def test_the_tracker_books_a_managed_buffer_no_op_made():
    """On a real GPU bitsandbytes' managed buffer is ``torch.frombuffer`` of cudaMallocManaged memory,
    made by no ATen op: the observer's ``managed`` books it, on the device ``managed``."""
    import numpy as np

    from memfit.memory.tracker import MANAGED, MemoryTracker
    tracker = MemoryTracker()
    array = np.zeros(1000, dtype=np.float32)
    with tracker:
        t = torch.frombuffer(array, dtype=torch.float32)
        tracker.managed(t)
    (rec,) = [r for r in tracker.state.records if r.device == MANAGED]
    assert rec.nbytes == 4000


def test_refused_with_offloaded_states_and_fsdp():
    """Offloaded states live on the host, where nothing pages; bitsandbytes' states do not take DTensors."""
    with pytest.raises(UserError, match="adamw8bit-paged cannot be combined with offload"):
        Plan(optimizer="adamw8bit-paged", offload=["optimizer_states"])
    with pytest.raises(UserError, match=r"adamw-paged.*shard|shard.*adamw-paged"):
        Plan(optimizer="adamw-paged", shard="fsdp", world_size=2)


def test_missing_bitsandbytes_is_one_line_with_the_install_hint(monkeypatch):
    from memfit.techniques import bnb_optim
    monkeypatch.setattr(bnb_optim, "bitsandbytes_available", lambda: False)
    with pytest.raises(UserError, match=r"adamw8bit-paged needs bitsandbytes.*pip install bitsandbytes"):
        Plan(optimizer="adamw8bit-paged")


def test_planner_searches_the_paged_variants_on_gpu_presets_only():
    from memfit.techniques.base import SearchContext
    from memfit.techniques.optimizers import default_optimizers, search
    assert {"adamw8bit-paged", "adamw-paged"} <= set(search(SearchContext(model=None, device=get_device("rtx4090"),
                                                                          batch_size=1)))
    assert not {"adamw8bit-paged", "adamw-paged"} & set(default_optimizers(get_device("cpu")))


def test_states_loaded_from_a_state_dict_are_paged_again():
    """NOTE [ Loaded states are paged again ]: bitsandbytes' load_state_dict puts every state on its
    parameter's device (the caching allocator); memfit's paged optimizer copies each large moment back
    into a managed buffer, with the same values. (On CPU tensors, as a GPU preset's trace has them.)"""
    from memfit.techniques.optimizers_paged import paged_class
    from memfit.techniques.placement import HostPlacement

    class Observer:
        def __init__(self):
            self.seen = []

        def managed(self, t):
            self.seen.append(t)

    def build(observer):
        placement = HostPlacement()
        placement.observer = observer
        return paged_class("PagedAdamW8bit")(params, gpu=True, placement=placement, lr=1e-3, betas=(0.9, 0.999),
                                             eps=1e-8, weight_decay=0.0)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(400, 300)), torch.nn.Parameter(torch.randn(10))]
    first, second = Observer(), Observer()
    opt = build(first)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert len(first.seen) == 2  # (the large tensor's two moments; the small one stays with PyTorch)
    saved = {k: v.clone() for k, v in opt.state[params[0]].items() if torch.is_tensor(v)}
    again = build(second)
    again.load_state_dict(opt.state_dict())
    state = again.state[params[0]]
    assert [id(t) for t in second.seen] == [id(state["state1"]), id(state["state2"])]
    assert all(torch.equal(state[k], v) for k, v in saved.items())
