"""Stop sequences over streamed text: what is safe to emit, and where text ends."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet.text.stops import Scan, scan


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello", [], Scan(5, False)),
        ("hello wor", ["world"], Scan(6, False)),  # "wor" could become "world": held back
        ("hello world!", ["world"], Scan(6, True)),
        ("abc", ["x", "bc"], Scan(1, True)),
        ("abcab", ["abd"], Scan(3, False)),
        ("one\n\ntwo", ["\n\n", "two"], Scan(3, True)),  # the earliest stop wins
        ("caf\ufffd", [], Scan(3, False)),  # half a character: wait for the rest
        ("stop", ["", "zz"], Scan(4, False)),  # empty stops are ignored
    ],
)
def test_scan(text: str, stops: list[str], expected: Scan) -> None:
    assert scan(text, stops) == expected


@given(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=4), max_size=3))
def test_emitted_text_never_contains_a_stop(text: str, stops: list[str]) -> None:
    cut = scan(text, stops)
    assert 0 <= cut.safe_end <= len(text)
    assert not any(s in text[: cut.safe_end] for s in stops)
    assert cut.stopped == any(s in text for s in stops)
