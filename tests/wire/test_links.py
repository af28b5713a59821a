"""`auto` encoding by measured link rate (ADR-0037): the estimator and the choice, table-driven."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet.wire import compression as c
from meshnet.wire.headers import HOLD
from meshnet.wire.links import MAX_LINKS, RATE_MIN_BYTES, LinkRates, hold_header, hold_s

DECODE = 2 * 576 * 2  # a decode step's request and answer bodies
CHUNK = 2 * 128 * 576 * 2  # a 128-token prefill chunk's, both ways


def rates(samples: list[tuple[int, float, float | None]]) -> float | None:
    links = LinkRates()
    for wire_bytes, elapsed_s, held_s in samples:
        links.record("n-1", wire_bytes, elapsed_s, held_s)
    return links.bytes_per_s("n-1")


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([], None),
        ([(DECODE, 0.010, 0.002)], None),  # a round trip, no rate yet
        ([(CHUNK, 0.050, 0.020)], None),  # a rate needs the round trip
        # round trip 10 ms (12 - 2 held); the chunk 40 ms at the link after 30 ms held
        ([(DECODE, 0.012, 0.002), (CHUNK, 0.080, 0.030)], CHUNK / 0.040),
        # the round trip is the median small frame: jitter falls on either side of it, as
        # on the large frames (the least small frame would make every rate read low)
        (
            [(DECODE, 0.030, 0.0), (DECODE, 0.011, 0.001), (DECODE, 0.012, 0.002)]
            + [(CHUNK, 0.050, 0.010)],
            CHUNK / 0.030,
        ),
        # an answer that says no hold is no measurement
        ([(DECODE, 0.012, None), (CHUNK, 0.080, 0.030)], None),
        # a chunk no slower than the round trip: too fast to time, 10 GB/s
        ([(DECODE, 0.012, 0.0), (CHUNK, 0.010, 0.0)], 1e10),
    ],
)
def test_the_rate_is_what_a_large_frame_took_beyond_the_round_trip(
    samples: list[tuple[int, float, float | None]], expected: float | None
) -> None:
    got = rates(samples)
    assert got == (None if expected is None else pytest.approx(expected))


def test_the_rate_is_the_median_of_the_last_large_frames() -> None:
    slow = [(CHUNK, 0.010 + CHUNK / 2e6, 0.0)] * 5  # 2 MB/s, then faster
    fast = [(CHUNK, 0.010 + CHUNK / 200e6, 0.0)] * 3
    assert rates([(DECODE, 0.010, 0.0), *slow]) == pytest.approx(2e6)
    assert rates([(DECODE, 0.010, 0.0), *slow, *fast]) == pytest.approx(200e6)


def test_links_beyond_the_cap_forget_the_least_recently_measured() -> None:
    links = LinkRates()
    for i in range(MAX_LINKS + 1):
        links.record(f"n-{i}", DECODE, 0.01, 0.0)
    links.record("n-1", DECODE, 0.01, 0.0)
    links.record("late", DECODE, 0.01, 0.0)
    assert len(links.links) == MAX_LINKS
    assert "n-0" not in links.links and "n-2" not in links.links and "n-1" in links.links


def test_reported_rates_are_in_mbit_per_second() -> None:
    links = LinkRates()
    links.record("n-1", DECODE, 0.010, 0.0)
    links.record("n-1", RATE_MIN_BYTES * 4, 0.010 + RATE_MIN_BYTES * 4 / 12.5e6, 0.0)
    links.record("n-2", DECODE, 0.010, 0.0)  # no rate yet: not reported
    assert links.report_mbit_s() == {"n-1": 100.0}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("12.500", 0.0125),
        ("0", 0.0),
        ("-1", None),
        ("nan", None),
        ("inf", None),
        ("1e30", None),
        ("twelve", None),
        ("1" * 30, None),
    ],
)
def test_a_hold_header_counts_only_when_sane(value: str, expected: float | None) -> None:
    assert hold_s({HOLD.lower(): value}) == expected


def test_the_hold_header_round_trips() -> None:
    assert hold_s(hold_header(10.0, 10.25)) == pytest.approx(0.25)
    assert hold_s(hold_header(10.0, 9.0)) == 0.0  # a clock step never reads as negative
    assert hold_s({}) is None


MB = 1e6
MIN = 64 * 1024


@pytest.mark.parametrize(
    ("choice", "payload", "link", "expected"),
    [
        ("auto", DECODE // 2, None, c.NONE),  # a decode step: never worth it
        ("auto", DECODE // 2, 1 * MB, c.NONE),
        ("auto", MIN, None, c.ZSTD_SHUFFLE),  # not measured yet: compress
        ("auto", MIN, 12.5 * MB, c.ZSTD_SHUFFLE),  # 100 Mbit/s
        ("auto", MIN, 74 * MB, c.ZSTD_SHUFFLE),
        ("auto", MIN, 75 * MB, c.NONE),  # 600 Mbit/s and faster: sent as it is
        ("auto", MIN, 3000 * MB, c.NONE),  # loopback
        ("zstd", DECODE // 2, 3000 * MB, c.ZSTD),  # an explicit choice stands
        ("none", MIN, 1 * MB, c.NONE),
    ],
)
def test_auto_compresses_large_payloads_over_slow_links_only(
    choice: str, payload: int, link: float | None, expected: str
) -> None:
    assert c.choose(choice, payload, MIN, link, 75 * MB) == expected


@pytest.mark.parametrize(
    ("choice", "request_encoding", "expected"),
    [
        ("auto", c.NONE, c.NONE),
        ("auto", c.ZSTD_SHUFFLE, c.ZSTD_SHUFFLE),
        ("auto", c.ZSTD, c.ZSTD),
        ("none", c.ZSTD_SHUFFLE, c.NONE),
        ("zstd", c.NONE, c.ZSTD),
    ],
)
def test_an_auto_answer_takes_the_request_s_encoding(
    choice: str, request_encoding: str, expected: str
) -> None:
    assert c.answering(choice, request_encoding) == expected


@given(
    st.lists(
        st.tuples(
            st.integers(1, 1 << 24),
            st.floats(0, 10, allow_nan=False),
            st.one_of(st.none(), st.floats(0, 10, allow_nan=False)),
        ),
        max_size=40,
    )
)
def test_any_samples_give_no_rate_or_a_positive_finite_one(
    samples: list[tuple[int, float, float | None]],
) -> None:
    got = rates(samples)
    assert got is None or 0 < got <= 1e10 * (1 << 24)
