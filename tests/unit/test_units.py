import pytest

from memfit.errors import UserError
from memfit.units import fmt_bytes, parse_positive_int, parse_size


@pytest.mark.parametrize("text,expected", [
    ("20GiB", 20 * 2**30), ("1.5GB", 1_500_000_000), ("512MiB", 512 * 2**20), ("100", 100),
    ("2 gib", 2 * 2**30), ("4k", 4000), (123, 123),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_percent_of_capacity():
    assert parse_size("80%", total_bytes=1000) == 800
    with pytest.raises(UserError, match="percentage"):
        parse_size("80%")


@pytest.mark.parametrize("bad", ["", "abc", "12XB", "-5GB", "0", "150%", "GB"])
def test_parse_size_rejects(bad):
    with pytest.raises(UserError):
        parse_size(bad, total_bytes=1000)


def test_fmt_bytes():
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(1536) == "1.50 KiB"
    assert fmt_bytes(3 * 2**30) == "3.00 GiB"


def test_parse_positive_int():
    assert parse_positive_int("8", "--batch-size") == 8
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(UserError, match="--batch-size"):
            parse_positive_int(bad, "--batch-size")
