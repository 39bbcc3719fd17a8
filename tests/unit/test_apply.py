"""memfit.apply: a plan on the user's own model, loss and optimizer, for their own loop. The step is
build_step's (the same techniques), so it trains as the user's plain loop does (exactly, or to the
order of float sums where the plan reorders them), and its measured peak is memfit's prediction
of it, traced on a fake copy of the user's model."""

import pytest
import torch

import memfit
from memfit.errors import UserError
from memfit.integrations.apply import estimate_applied
from memfit.memory.measure import PeakWindow

BATCH = 256


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                              torch.nn.Linear(256, 64)) for _ in range(4))
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def make_batch(n):
    return torch.randn(n, 64), torch.randint(0, 10, (n,))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _plain_loop(model, batches):
    opt = adamw(model.parameters())
    for b in batches:
        opt.zero_grad()
        loss_fn(model, b).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _applied_loop(model, batches, plan, *, parts: bool):
    step = memfit.apply(model, plan, batch_size=BATCH, loss_fn=loss_fn, optimizer_factory=adamw, device="cpu")
    for b in batches:
        if parts:  # the user's loop, three lines changed
            step.zero_grad()
            step.forward_backward(b)
            step.update()
        else:
            step(b)
    return {n: p.detach().clone() for n, p in step.model.named_parameters()}


@pytest.mark.parametrize("plan, exact", [(None, True), ({"micro_batch_size": 64, "checkpointing": "blocks"}, False),
                                         ({"optimizer_in_backward": True, "checkpointing": "blocks"}, False)])
@pytest.mark.parametrize("parts", [True, False])
def test_an_applied_plan_trains_as_the_plain_loop(plan, exact, parts):
    torch.manual_seed(0)
    batches = [make_batch(BATCH) for _ in range(3)]
    torch.manual_seed(1)
    reference = _plain_loop(Net(), batches)
    torch.manual_seed(1)
    got = _applied_loop(Net(), batches, plan, parts=parts)
    for name, p in reference.items():
        if exact:
            assert torch.equal(got[name], p), name
        else:  # micro-batches and per-parameter updates reorder float sums
            torch.testing.assert_close(got[name], p, rtol=1e-4, atol=1e-5)


def test_a_hugging_face_model_with_its_own_loss_and_chunked_loss():
    """The default loss is the model's own (``model(**batch).loss``); a chunked loss on it (the
    head and cross-entropy in chunks) gives the same loss and gradients, to float order."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0, embd_pdrop=0,
                        attn_pdrop=0)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 32))
    batch = {"input_ids": ids, "labels": ids}
    torch.manual_seed(1)
    plain = GPT2LMHeadModel(config)
    opt = adamw(plain.parameters())
    plain_loss = plain(**batch).loss
    plain_loss.backward()
    opt.step()
    torch.manual_seed(1)
    step = memfit.apply(GPT2LMHeadModel(config), {"loss_chunks": 4}, batch_size=4, optimizer_factory=adamw,
                        device="cpu")
    loss = step(batch)
    assert loss == pytest.approx(float(plain_loss.detach()), rel=1e-5)
    for (name, a), b in zip(plain.named_parameters(), step.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("plan", [None, {"micro_batch_size": 64, "checkpointing": "blocks"}])
def test_the_applied_steps_measured_peak_is_memfits_prediction(plan):
    """Measured with the profiler's allocator events from before the model exists (as ``profile``
    measures), predicted on a fake copy of the model (no memory): within 1%."""
    torch.manual_seed(0)
    predicted = estimate_applied(Net(), plan, batch_size=BATCH, example_batch=make_batch, loss_fn=loss_fn,
                                 device="cpu").measurable_peak_bytes
    with PeakWindow(memfit.get_device("cpu")) as window:
        step = memfit.apply(Net(), plan, batch_size=BATCH, loss_fn=loss_fn, device="cpu")
        step(make_batch(BATCH))
        with window.step(2):
            step(make_batch(BATCH))
        measured = window.finish(2)
    assert abs(measured - predicted) <= 0.01 * measured, (measured, predicted)


def test_the_fake_copy_holds_no_memory_and_leaves_the_model_alone():
    """Predicting traces a fake copy: the user's model keeps its real parameters."""
    net = Net()
    before = {n: p.clone() for n, p in net.named_parameters()}
    estimate_applied(net, {"checkpointing": "blocks"}, batch_size=8, example_batch=make_batch, loss_fn=loss_fn,
                     device="cpu")
    for n, p in net.named_parameters():
        assert type(p) is torch.nn.Parameter and torch.equal(p, before[n])


@pytest.mark.parametrize("call, message", [
    (lambda: memfit.apply(object(), batch_size=2), "model must be a torch.nn.Module"),
    (lambda: memfit.apply(Net(), batch_size=0), "batch_size must be a whole number >= 1"),
    (lambda: memfit.apply(Net(), 3, batch_size=2), "plan must be a Plan, a plan file or a dict"),
    (lambda: memfit.apply(Net(), {"precision": "fp8"}, batch_size=2), "precision"),
    (lambda: memfit.apply(Net(), batch_size=2, device="tpu"), "device 'tpu'"),
    (lambda: memfit.apply(Net(), batch_size=2, device="cpu")(make_batch(2)[0]), "the model's output has no loss"),
    (lambda: estimate_applied(Net(), batch_size=2, example_batch=None, device="cpu"), "pass example_batch"),
])
def test_bad_arguments_are_one_line(call, message):
    with pytest.raises(UserError, match=message) as info:
        call()
    assert "\n" not in str(info.value)
