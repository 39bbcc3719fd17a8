"""The largest batch, sequence length or resolution that fits a budget: a few traces, not a scan.

``--batch-size max``, ``--seq-len max`` and ``--resolution max`` ask for a value instead of giving one.
The answer is exact: the trace at the value N fits the budget, and the trace at the next value (N+1
samples, N+64 tokens, one latent step more pixels) does not; both figures are shown.

NOTE [ The largest value from a line ]
A step's memory is close to affine in the batch and the sequence length (activations, inputs and the
loss's logits grow with them; weights, gradients and optimizer states do not), and in the latent area
for a resolution (a DiT's tokens, a UNet's feature maps). So the search traces the two smallest values,
draws the line through them, and traces the value where the line meets the budget; then the next value.
Each new trace redraws the line: through the smallest value and the largest that fits (a long base,
which the caching allocator's steps in reserved bytes do not tilt), then, once a value over the budget
is known, through the two values around it; so an error of the line costs a trace or two, not a scan,
and where the line twice errs to the same side the search halves the bracket instead. A value
the model cannot take (a sequence beyond its position table) bounds the search, and halving finds the
last one it takes. It ends when a value fits and the next one does not: typically four traces. The
search assumes that more of a value never needs less memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from memfit.errors import UserError
from memfit.units import MAX_SIZE, fmt_bytes


@dataclass(frozen=True)
class Axis:
    """A value ``max`` can stand for, and its grid."""

    key: str
    """``batch_size``, ``seq_len`` or ``resolution``."""
    flag: str
    words: str
    """What it is, in words ("batch size")."""
    step: int
    """Between two values of the grid (and the smallest value)."""
    squared: bool = False
    """Memory grows with the value's square (a resolution: the latent area)."""

    def x(self, value: int) -> float:
        return float(value) ** 2 if self.squared else float(value)

    def value_at(self, x: float) -> int:
        """The largest value of the grid at or below coordinate ``x``."""
        v = math.sqrt(max(x, 0.0)) if self.squared else x
        if not math.isfinite(v):
            return MAX_SIZE
        return max(self.step, int(min(v, MAX_SIZE)) // self.step * self.step)

    def number(self, value: int) -> str:
        return f"{value:,}" + (" px" if self.key == "resolution" else "")

    def show(self, value: int) -> str:
        return f"{self.words} {self.number(value)}"


SEQ_STEP = 64
"""Tokens between two sequence lengths ``--seq-len max`` tries."""


def batch_axis() -> Axis:
    return Axis("batch_size", "--batch-size", "batch size", 1)


def seq_axis() -> Axis:
    return Axis("seq_len", "--seq-len", "sequence length", SEQ_STEP)


def resolution_axis(step: int, squared: bool = True) -> Axis:
    """``step``: pixels of one latent step (the workload's ``resolution_step``); ``squared``: the image
    grows on both sides with it (memory near-affine in its square), not only in height (a video of a
    fixed width: affine in the value)."""
    return Axis("resolution", "--resolution", "resolution" if squared else "height", step, squared=squared)


@dataclass
class Largest:
    """The answer of :func:`find_largest`."""

    axis: Axis
    budget_bytes: int
    value: int | None
    """The largest value that fits (None: not even the smallest)."""
    used_bytes: int | None
    """What the budget counts at ``value`` (at the smallest value when none fits)."""
    next_value: int
    next_used_bytes: int | None
    """What the next value needs (None: the model cannot take it, see ``next_error``)."""
    next_error: str | None = None
    measured: dict[int, int | None] = field(default_factory=dict)
    """Every value traced -> what it needs (None: the model cannot take it)."""

    @property
    def traces(self) -> int:
        """Values traced (not those the model refused before any trace)."""
        return sum(used is not None for used in self.measured.values())

    def describe(self) -> str:
        """One line: the value, and why the next one is out."""
        a = self.axis
        if self.value is None:
            return (f"not even {a.show(self.next_value)} fits {fmt_bytes(self.budget_bytes)}: it needs "
                    f"{fmt_bytes(self.next_used_bytes)}")
        why = (f"{a.show(self.next_value)} needs {fmt_bytes(self.next_used_bytes)}" if self.next_used_bytes is not None
               else f"{a.show(self.next_value)} is beyond the model ({self.next_error})")
        return (f"largest {a.words} that fits {fmt_bytes(self.budget_bytes)}: {a.number(self.value)}, needing "
                f"{fmt_bytes(self.used_bytes)}; {why} ({self.traces} traces)")

    def to_json(self) -> dict:
        return {"axis": self.axis.key, "value": self.value, "used_bytes": self.used_bytes,
                "next_value": self.next_value, "next_used_bytes": self.next_used_bytes,
                "next_error": self.next_error, "budget_bytes": self.budget_bytes, "traces": self.traces,
                "measured": {str(k): v for k, v in sorted(self.measured.items())}}


GROWTH = 1024
"""At most this many times the largest value that fits so far is traced next (a line drawn through
two small values may point far off)."""


def find_largest(axis: Axis, measure: Callable[[int], int], budget_bytes: int, *, most: int = MAX_SIZE,
                 first: int | None = None, second: int | None = None) -> Largest:
    """The largest value of ``axis``'s grid whose ``measure(value)`` (the bytes the budget counts) is
    within ``budget_bytes`` (NOTE [ The largest value from a line ]). ``measure`` raises a UserError
    where the model cannot take the value (a bound; at the smallest value the error is raised).
    ``first``: the smallest value to try (default: the grid's first); ``second``: the next one traced
    (default: one step more; a resolution's: the model's native one, where the line is drawn better)."""
    step = axis.step
    measured: dict[int, int | None] = {}
    errors: dict[int, str] = {}

    def m(v: int) -> int | None:
        if v not in measured:
            try:
                measured[v] = measure(v)
            except UserError as e:
                if not measured:
                    raise
                measured[v], errors[v] = None, str(e)
        return measured[v]

    start = first or step
    if m(start) > budget_bytes:
        return Largest(axis, budget_bytes, None, measured[start], start, measured[start], measured=measured)
    lo, hi = start, None
    sides: list[bool] = []
    while hi is None or hi - lo > step:
        v = _next_value(axis, measured, budget_bytes, lo, hi, sides, most)
        if len(measured) == 1 and second is not None and second > start:
            v = min(second, most) // step * step
        if v is None:  # the grid's end
            break
        used = m(v)
        fits = used is not None and used <= budget_bytes
        sides.append(fits)
        if fits:
            lo = v
        else:
            hi = v
    nxt = lo + step
    if hi is None:  # (the grid's end: the value nothing could exceed)
        return Largest(axis, budget_bytes, lo, measured[lo], nxt, None, f"more than {most:,} is not taken",
                       measured=measured)
    return Largest(axis, budget_bytes, lo, measured[lo], nxt, measured[nxt], errors.get(nxt), measured=measured)


def _next_value(axis: Axis, measured: dict, budget: int, lo: int, hi: int | None, sides: list[bool],
                most: int) -> int | None:
    """The value to trace next, inside (lo, hi): where a line meets the budget (before a value over it
    is known, the line through the smallest value and the largest that fits, which steps in the
    allocator's reserved bytes do not tilt; then through the two values around the budget); halfway
    where the line erred to one side twice, or where ``hi`` is a value the model cannot take."""
    step = axis.step
    top = min(most, max(lo * GROWTH, lo + step)) // step * step if hi is None else hi - step
    if top <= lo:
        return None
    if hi is not None and (measured[hi] is None or (len(sides) >= 2 and sides[-1] == sides[-2])):
        return min(max(lo + step, (lo + hi) // 2 // step * step), top)
    first = min(v for v, used in measured.items() if used is not None)
    if hi is None and first == lo:
        return min(lo + step, top)
    a, b = (first, lo) if hi is None else (lo, hi)
    ua, ub = measured[a], measured[b]
    slope = (ub - ua) / (axis.x(b) - axis.x(a))
    if slope <= 0:  # nothing grows (yet): double
        return min(max(lo * 2, lo + step), top)
    guess = axis.value_at(axis.x(a) + (budget - ua) / slope)
    return min(max(guess, lo + step), top)
