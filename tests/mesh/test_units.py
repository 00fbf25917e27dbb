"""Tests of mesh/units.py."""

from __future__ import annotations

import pytest

from mesh.errors import MeshError
from mesh.units import format_age, format_bytes, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("15m", 900), ("24h", 86400), ("7d", 604800), ("1w", 604800), ("1.5h", 5400)],
)
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "-5m", "0s", "3 years", "1e9"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(MeshError, match="duration"):
        parse_duration(text)


def test_formats() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_age(None) == "never"
    assert format_age(5) == "5s ago"
    assert format_age(600) == "10m ago"
