"""Twin runs: the same workload under two plans, step by step, from the same seed."""

from __future__ import annotations

import math
import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.memory.measure import profile
from memfit.plans import Plan
from memfit.step import build_step
from memfit.workloads import load_workload

# GPT-2 with dropout on (resid/embd/attn 0.1), small enough for CPU tests.
GPT2_DROPOUT = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=500,n_positions=128"


def run_steps(spec, plan: Plan, steps: int = 3, batch_size: int = 4, seq_len: int | None = 64):
    """Losses and parameters after each step; dropout masks drawn from the same seeds."""
    wl = load_workload(spec, seq_len=seq_len) if isinstance(spec, str) else spec
    torch.manual_seed(0)
    step = build_step(wl, plan, batch_size, "cpu")
    torch.manual_seed(1)
    batch = wl.batch(batch_size)
    losses, params = [], []
    for i in range(steps):
        torch.manual_seed(100 + i)
        losses.append(step(batch))
        params.append({n: p.detach().float().clone() for n, p in step.model.named_parameters()})
    return losses, params, step


def assert_same_training(a, b, exact: bool = True, rtol: float = 1e-5, atol: float = 1e-6):
    (la, pa, _), (lb, pb, _) = a, b
    for i, (x, y) in enumerate(zip(pa, pb)):
        for name in x:
            if exact:
                assert torch.equal(x[name], y[name]), f"step {i + 1}: {name} differs"
            else:
                torch.testing.assert_close(x[name], y[name], rtol=rtol, atol=atol, msg=f"step {i + 1}: {name}")
    if exact:
        assert la == lb
    else:
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=rtol, atol=atol)


def measured(spec, plan: Plan, batch_size: int = 4, seq_len: int | None = 64):
    """profile(): measured peak (profiler, independent) and the prediction for it (no timed steps:
    no memory test reads a CPU step's time, and each costs a real step)."""
    return profile(spec, plan, batch_size=batch_size, seq_len=seq_len, repeats=0)


class OpShapes(TorchDispatchMode):
    """Record (op name, output shape) of every op: an independent view of what ran."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.seen.append((func.overloadpacket.__name__, tuple(out.shape)))
        return out


def accumulated_step(model, optimizer, scheduler, batch, loss_fn, accum: int) -> torch.Tensor:
    """A plain loop's step (the twin tests' reference): zero, loss / ``accum`` per micro-batch,
    backward (gradients accumulate), step, schedule. Returns the batch's loss."""
    optimizer.zero_grad(set_to_none=True)
    total = None
    for micro in zip(*(t.chunk(accum) for t in batch)):
        loss = loss_fn(model, micro) / accum
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    optimizer.step()
    scheduler.step()
    return total


def cosine_with_warmup(steps: int):
    """LambdaLR factor: linear warmup over a tenth of ``steps``, then a cosine to 0."""
    warmup = max(1, steps // 10)
    return lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))


def with_two_workers(script: str, *args: str, timeout: int = 120, flags: tuple = ()) -> str:
    """Run ``script`` in a fresh Python (``python -c``) with two trace worker processes (a forked pool: the
    test process itself may have run a backward pass, after which autograd does not survive a fork);
    its stdout, stripped, or its stderr's tail where it printed something else than ``ok``."""
    env = {"MEMFIT_PLAN_WORKERS": "2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, *flags, "-c", script, *args], capture_output=True, text=True, env=env,
                         timeout=timeout)
    return out.stdout.strip() if out.stdout.strip() == "ok" else out.stdout.strip() + "\n" + out.stderr[-2000:]


def peft_loop(spec, lora_kwargs, steps=3, batch_size=2, half=None, autocast=True, config=None, inject=None):
    """The PEFT user's own loop: the model loaded (as from_pretrained loads it: built on the meta device,
    its weights materialised), the adapter injected, AdamW on what requires grad, plain steps. ``half``
    (torch.bfloat16 or torch.float16): the model loaded with that dtype, the adapter upcast to fp32 as
    get_peft_model upcasts it (autocast_adapter_dtype=True), the steps under its autocast, an fp16 loss
    scaled by a GradScaler (Trainer(bf16=True) / Trainer(fp16=True)); not ``autocast``: the steps without it and
    no loss scaled (ai-toolkit's loop, and a Trainer left without bf16=True). ``config``: PEFT's config class
    (LoraConfig by default; LoKrConfig); ``inject(model)``: the adapter made another way (a LyCORIS network), which
    returns the model whose trainable parameters train."""
    import contextlib

    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype

    from memfit.techniques.loading import materialise
    wl = load_workload(spec, seq_len=64)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(half or default)
    try:
        with torch.device("meta"):
            base = wl.model()
    finally:
        torch.set_default_dtype(default)
    materialise(base, "cpu")
    model = inject(base) if inject else inject_adapter_in_model((config or LoraConfig)(**lora_kwargs), base)
    if half:
        cast_adapter_dtype(model, "default")
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=half == torch.float16 and autocast)
    torch.manual_seed(1)
    batch = wl.batch(batch_size)
    losses, params = [], []
    for i in range(steps):
        torch.manual_seed(100 + i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=half) if half and autocast else contextlib.nullcontext():
            loss = wl.loss(model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss))
        params.append({n: p.detach().float().clone() for n, p in model.named_parameters()})
    return losses, params


def assert_same_run(losses, params, plain_losses, plain_params) -> None:
    """Two runs' losses equal and every parameter of the plain run's equal after each step, bit for bit."""
    assert losses == plain_losses
    for i, (a, b) in enumerate(zip(params, plain_params)):
        for name in b:
            assert torch.equal(a[name], b[name]), f"step {i + 1}: {name}"
