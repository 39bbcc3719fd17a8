"""Plain tensor attributes of a model built on the meta device (NOTE [ Plain tensors of a meta build ]):
made again on the host with the values a real build gives them, in-place calls included; one made from
a parameter is left on the meta device."""

import torch

from bench.buffer_replay import LiveBytes
from memfit.techniques.loading import on_meta


class Rotary(torch.nn.Module):
    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        index = torch.arange(n)
        table = torch.outer(index.float(), 1.0 / torch.pow(100.0, torch.arange(0, 4, 2).float() / 4))
        table.mul_(2.0)
        self.table = torch.polar(torch.ones_like(table), table)  # (complex, as Qwen-Image's)
        self.flags = torch.zeros(n, dtype=torch.bool)
        self.flags[0] = True
        self.from_weight = self.proj.weight.detach() * 2  # (a parameter's: its values are the checkpoint's)
        self.per_axis = [torch.arange(n, dtype=torch.float64) * k for k in (1, 3)]  # (Lumina2's freqs_cis: a list)


def test_plain_tensors_are_made_on_the_host_with_their_build_values():
    with on_meta() as record:
        model = Rotary()
    assert model.table.device.type == "meta" and model.proj.weight.device.type == "meta"
    record.host_tensors(model)
    real = Rotary()
    assert model.table.device.type == "cpu" and torch.equal(model.table, real.table)
    assert torch.equal(model.flags, real.flags)  # (an in-place write after the tensor was made)
    assert type(model.per_axis) is list and all(a.device.type == "cpu" and torch.equal(a, b)
                                                 for a, b in zip(model.per_axis, real.per_axis, strict=True))
    assert model.proj.weight.device.type == "meta"  # (parameters are the load's: memfit.techniques.loading)
    assert model.from_weight.device.type == "meta"


def test_a_build_without_plain_tensors_is_left_as_it_is():
    with on_meta() as record:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    before = {n: id(t) for n, t in model.state_dict(keep_vars=True).items()}
    record.host_tensors(model)
    assert {n: id(t) for n, t in model.state_dict(keep_vars=True).items()} == before


class MadeInTheDefaultDtype(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        inv = torch.ones(8)
        t = torch.arange(4, dtype=inv.dtype)
        self.register_buffer("table", t[:, None] @ inv[None, :], persistent=False)


def test_buffers_are_replayed_in_the_builds_default_dtype():
    """``bf16-pure`` builds with bf16 as the default dtype; its replay, after the build, must too (in fp32
    ``ones`` and an ``arange`` in the recorded bf16 no longer multiply)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with on_meta() as record:
            model = MadeInTheDefaultDtype()
        real = MadeInTheDefaultDtype()
    finally:
        torch.set_default_dtype(before)
    values = record.buffer_values(model)
    assert values["table"].dtype == torch.bfloat16 and torch.equal(values["table"], real.table)


class LongChain(torch.nn.Module):
    """A table computed through many steps, none of which the build keeps (SD3's sin-cos table is made so)."""

    def __init__(self, n: int = 1 << 18) -> None:
        super().__init__()
        x = torch.arange(n, dtype=torch.float32)
        for k in range(12):
            x = torch.sin(x * 0.5 + k)
        self.register_buffer("table", x)


def test_the_replay_holds_no_more_than_the_build_itself():
    """The replay of a buffer drops each step's value after its last use, as the build's Python does: its
    peak of live host bytes (counted by bench.buffer_replay's dispatch mode, not by memfit) is the eager
    build's, not the sum of every step (13 tensors of 1 MiB)."""
    with LiveBytes() as eager:
        real = LongChain()
    with on_meta() as record:
        model = LongChain()
    with LiveBytes() as replay:
        values = record.buffer_values(model)
    assert torch.equal(values["table"], real.table)
    assert 2 * 2**20 <= eager.peak <= 4 * 2**20 and replay.peak <= eager.peak, (replay.peak, eager.peak)


class WrittenThroughViews(torch.nn.Module):
    """Values written through a view of a tensor, or into a tensor a view was taken of, before the buffer reads it."""

    def __init__(self) -> None:
        super().__init__()
        x = torch.arange(8.0)
        x.view(2, 4)[0] = 9.0  # (a write through a view, read through its base)
        y = x.view(2, 4)
        x.mul_(2.0)  # (a write into the base, read through a view taken before it)
        c = torch.polar(torch.ones(4), torch.arange(4.0))
        c.real.mul_(3.0)  # (a write into the real part of a complex tensor)
        self.register_buffer("through_view", x * 1)
        self.register_buffer("view_of_written", y + 0)
        self.register_buffer("complex", c * 1)
        w = torch.arange(4.0)
        self.register_buffer("written_after", w)
        w[0:2].fill_(7.0)  # (a write through a view after the buffer was registered)


def test_writes_through_views_are_replayed():
    """A write into a view is a write into its storage (a review found these values lost: the replay ran
    only the calls that wrote the very tensor the buffer read)."""
    with on_meta() as record:
        model = WrittenThroughViews()
    values, real = record.buffer_values(model), WrittenThroughViews()
    for name, b in real.named_buffers():
        assert torch.equal(values[name], b), (name, values[name], b)
