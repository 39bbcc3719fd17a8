"""Parsing what users type: byte sizes ("20GiB", "1.5GB", "512MiB", "80%"), whole numbers and
``key=value,key=value`` lists; and formatting byte sizes."""

from __future__ import annotations

import re

from memfit.errors import UserError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, total_bytes: int | None = None, what: str = "size") -> int:
    """Parse a byte size. ``"80%"`` is a fraction of ``total_bytes`` (e.g. a device's capacity)."""
    if isinstance(text, int):
        if text <= 0:
            raise UserError(f"{what} must be positive, got {text}; write e.g. 20GiB")
        return text
    s = str(text).strip()
    if s.endswith("%"):
        if total_bytes is None:
            raise UserError(f"{what} {s!r} is a percentage but no device capacity is known; give bytes, e.g. 20GiB")
        try:
            pct = float(s[:-1])
        except ValueError:
            raise UserError(f"malformed {what} {s!r}; write a percentage like 80%") from None
        if not 0 < pct <= 100:
            raise UserError(f"{what} {s!r} must be between 0% and 100%")
        return int(total_bytes * pct / 100)
    m = _SIZE_RE.match(s)
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"malformed {what} {s!r}; write a number with a unit, e.g. 20GiB, 1.5GB or 512MiB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise UserError(f"{what} must be positive, got {s!r}")
    return int(value)


def fmt_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


MAX_SIZE = 2**32
"""The largest batch size or sequence length taken (tensor sizes must stay far inside 64 bits)."""


def fmt_rate(rate: float) -> str:
    """A throughput in three significant figures or more: 1,530; 40.2; 0.21 (a FLUX.1 step at 1024 px)."""
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}" if rate >= 10 else f"{rate:.2f}"


def parse_positive_int(text: str | int, what: str, maximum: int | None = None) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise UserError(f"malformed {what} {text!r}; give a positive whole number, e.g. 8") from None
    if value <= 0:
        raise UserError(f"{what} must be a positive whole number, got {text!r}")
    if maximum is not None and value > maximum:
        raise UserError(f"{what} {text} is too large; give at most {maximum}")
    return value


def parse_key_values(text: str, what: str, example: str | None = None) -> dict:
    """'a=1,b=0.5,c=true' -> {'a': 1, 'b': 0.5, 'c': True} (values parsed as YAML scalars).
    ``what`` names the option in errors; ``example`` shows a well-formed one."""
    out: dict = {}
    if not text:
        return out
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"malformed override {item!r} for {what}; write key=value pairs separated by commas, "
                            f"e.g. {example or what + ':key=value,key=value'}")
        out[key] = parse_scalar(value)
    return out


def parse_scalar(text: str):
    """``text`` as a YAML scalar ('1' -> 1, 'true' -> True), or as it is where YAML cannot read it."""
    import yaml
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text
