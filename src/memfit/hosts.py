"""The training machine's host CPU: what the host part of a GPU step costs on it.

An eager GPU step is also a CPU program: every op is dispatched from Python (modules, autocast),
the autograd engine (backward) or an optimizer loop; compiled regions cost their guards and
wrappers; an offloaded optimizer steps on the host, and an EMA on host weights averages there. When
those costs outrun the kernels they issue, the card waits: the step is host-bound, and its time is
the host's, whatever the card. So the host is a property of the machine that trains, not of the
card: the same step ran 19-51% slower behind the H200 machine's CPU than the time model, fitted
behind the H100 machine's, predicted.

A :class:`Host` scales the time model's host constants (memfit.planner.roofline.Constants: the
per-op dispatch costs ``cpu_*``, ``host_bw``, ``host_fused_bw``) relative to the machine they were
fitted on. Presets, by ``--host`` (left out: ``measure`` when planning for this machine's own GPU, ``--device cuda``;
else ``h100-box``):

- ``h100-box`` (the default): the machine the H100 rows ran on; the constants' reference (all 1.0).
- ``h200-box``: the machine the H200 rows of 2026-11-27 ran on, fitted on its rows that ran alone
  (``python -m tools.fit.held_out --fit-host h200``).
- ``h200-box-a``: the machine of the 2026-11-23 H200 loan (rows 1-59 of tests/data/h200.jsonl), never
  probed: the reference's costs taken, as for any machine not measured.
- ``h200-box-b``: the machine of the 2026-12-04 H200 loan (rows 85-98 of tests/data/h200.jsonl). The
  same kind of machine, another host: NOTE [ One kind of machine, several hosts ].
- ``h200-box-c``: the machine of the second loan that day (rows 99-104), its host probed.
- ``measure``: this machine, measured (:func:`measured_host`): its memory bandwidth by a fused CPU
  AdamW (a host-side optimizer's update), and, with a GPU, its dispatch costs by issuing small CUDA ops
  from Python against the same measurement's value recorded on the reference machine.
- a number: the host's dispatch costs as a multiple of the reference's (``--host 1.3``: 30% slower).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from memfit.errors import UserError


@dataclass(frozen=True)
class Host:
    name: str
    dispatch: float = 1.0
    """The per-op CPU costs (dispatch, autograd engine, optimizer loops, compiled calls) as a multiple
    of the reference machine's."""
    memory: float = 1.0
    """Host memory bandwidth (a host-side optimizer step, an EMA on the host) as a multiple of the
    reference machine's."""
    doc: str = ""


HOSTS: dict[str, Host] = {h.name: h for h in (
    Host("h100-box", doc="the machine the H100 rows ran on (an H100 80GB HBM3 cloud instance, 16 host cores): "
                         "the time model's constants were fitted there"),
    Host("h200-box", dispatch=1.971, memory=1.0,
         doc="the machine the H200 rows of 2026-11-27 ran on: dispatch 1.97x the H100 box's, fitted on its 15 GPT-2 "
             "and Llama rows that ran alone (tools/fit/held_out.py --fit-host h200)"),
    Host("h200-box-a", doc="the machine of the 2026-11-23 H200 loan (rows 1-59): never probed, and all its rows but "
                           "one ran beside 3 other jobs; the reference's costs taken, as for any machine not measured"),
    Host("h200-box-b", dispatch=1.0, memory=0.645,
         doc="the machine of the 2026-12-04 H200 loan: host memory 0.645x the H100 box's, fitted on its one Llama row with "
             "the optimizer on the host (8B, r-memfit-l3-8b-b2); dispatch not measured there, the reference's taken"),
    Host("h200-box-c", dispatch=1.0, memory=0.799,
         doc="the machine of the second 2026-12-04 H200 loan: host memory 0.799x the H100 box's, its fused CPU AdamW "
             "measured there (tools/gpu/host_probe.py, rows 99-104); dispatch: the reference's launch time is not "
             "recorded, the reference's taken"),
)}
DEFAULT = "h100-box"
CARD_HOSTS = {"h100": "h100-box", "h200": "h200-box"}
"""The host each recorded card's rows ran behind (tests/data/<card>.jsonl)."""

REFERENCE_HOST_FUSED_BW = 6.336e10
"""Host-memory bytes/s of torch's fused CPU AdamW on the reference machine, as the time model counts its
bytes: the time model's ``host_fused_bw`` (memfit.planner.roofline.Constants, where it is explained),
and what :func:`adamw_bandwidth` is set beside in :func:`measured_host`."""

REFERENCE_LAUNCH_SECONDS: float | None = None
""":func:`measured_host`'s figure on the reference machine (the H100 box): not recorded yet (no GPU
has been lent since the measurement was written), so ``--host measure`` refuses until it is."""


def get_host(name: str | Host | None) -> Host:
    """A host by preset name, a number (dispatch multiple of the reference), or None (the default)."""
    if isinstance(name, Host):
        return name
    if name is None:
        return HOSTS[DEFAULT]
    text = str(name).strip().lower()
    if text in HOSTS:
        return HOSTS[text]
    if text == "measure":
        return measured_host()
    try:
        factor = float(text)
    except ValueError:
        raise UserError(f"--host {name!r}: give a host preset ({', '.join(HOSTS)}), measure (with --device cuda), "
                        "or a number (its dispatch costs as a multiple of the h100-box's)") from None
    if not 0.1 <= factor <= 20:
        raise UserError(f"--host {name!r}: a multiple of the reference host's dispatch costs between 0.1 and 20")
    return Host(f"{factor:g}x h100-box", dispatch=factor, memory=1.0 / factor)


def host_for(name: str | Host | None, device) -> Host:
    """The host ``--host`` names; left out, this machine measured when the plan is for its own GPU
    (``--device cuda``, or a memfit.devices.Device that is this machine's: the machine that trains is
    this one), else the reference (:data:`DEFAULT`)."""
    local = getattr(device, "is_local_gpu", None)
    if local is None:
        local = str(device or "").split(":")[0].lower() in ("cuda", "gpu")
    return measured_host() if name is None and local else get_host(name)


def host_for_card(card: str) -> Host:
    """The host a recorded card's rows ran behind (rows without a ``host`` of their own)."""
    return HOSTS[CARD_HOSTS.get(card, DEFAULT)]


# NOTE [ One kind of machine, several hosts ]
# A device loan names the card, not the machine around it. The H200 rows of 2026-11-27 ran
# behind a host whose per-op costs were 1.97x the H100 machine's (fitted on their GPT-2 and Llama
# rows); the ten held-out plans measured on 2026-12-04, on an H200 machine of the same description
# (16 cores, 128 GiB), came out 20-74% faster than that host predicts wherever the step is
# host-bound, and within 0-10% of the H100 machine's host: another host. The same loan's 8B step
# with its optimizer on the host ran 1.45x what the reference host's memory bandwidth predicts. So
# a row names the host it ran behind (``"host"``, a preset here) when it is not its card's first
# one, and each device call now records the host's own figures beside its rows
# (tools/gpu/host_probe.py: CPU model, the launch time of :func:`launch_seconds`, a fused CPU AdamW's
# bandwidth), from which the next loan's host is read rather than assumed. A loan whose host was
# neither fitted nor probed gets the reference's costs, as the planner gives any machine it has not
# measured: the 2026-11-23 loan (``h200-box-a``), whose rows had been given the 11-27 host until
# 2026-12-07. That had priced its one row that ran alone (T5, 3,595 ops in 46.5 ms: host-bound at the
# 1.97x host) at 93 ms, +101%; at the reference's costs it is +2.5%. The row had been seen before this
# was changed, so it is no longer blind evidence for the time model.
def host_for_row(row: dict, card: str) -> Host:
    """The host a recorded row ran behind: its own ``host`` field, else its card's."""
    return HOSTS[row["host"]] if row.get("host") else host_for_card(card)


def launch_seconds(device: str = "cuda", ops: int = 2000) -> float:
    """Seconds to issue one small op from Python on ``device`` (the median of 5 runs of ``ops`` adds of
    a 1-element tensor, synchronised only at the end): the host's dispatch and launch cost, the
    GPU's time for such an op being smaller."""
    import torch
    x = torch.zeros(1, device=device)
    runs = []
    for _ in range(5):
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(ops):
            x = x + 1
        sync()
        runs.append((time.perf_counter() - t0) / ops)
    return sorted(runs)[2]


def adamw_bandwidth(params: int = 1 << 26, repeats: int = 3) -> float:
    """Bytes/s of torch's fused CPU AdamW on ``params`` bf16 parameters (weights, gradients and both
    states bf16, as a bf16-pure plan's offloaded update runs), its bytes counted as the time model
    counts a host update (every tensor the op reads: memfit.planner.opcost); the default's 512 MiB of
    tensors are well past any CPU cache."""
    import torch
    p = torch.nn.Parameter(torch.randn(params, dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()  # creates the states
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - t0)
    return 4 * p.numel() * p.element_size() / sorted(seconds)[len(seconds) // 2]


def measured_host() -> Host:
    """This machine's host: its memory bandwidth by a fused CPU AdamW against the reference constant
    (``host_fused_bw``), and its dispatch costs by CUDA launches against the reference machine's, where
    there is a GPU and that figure is recorded (else the reference's, and the name says so)."""
    import torch

    memory = adamw_bandwidth() / REFERENCE_HOST_FUSED_BW
    if torch.cuda.is_available() and REFERENCE_LAUNCH_SECONDS is not None:
        dispatch = launch_seconds("cuda") / REFERENCE_LAUNCH_SECONDS
        return Host(f"this machine (dispatch {dispatch:.2f}x, memory {memory:.2f}x h100-box's)", dispatch=dispatch,
                    memory=memory)
    why = "no GPU here" if not torch.cuda.is_available() else "the reference's launch time is not recorded"
    return Host(f"this machine (memory {memory:.2f}x h100-box's; dispatch as h100-box's: {why})", memory=memory)
